#!/usr/bin/env bash
# Builds specrag's CUDA binaries on a machine without a GPU or a CUDA install, from PyPI's
# CUDA 13.0 wheels, and packs them for the GPU machine (docs/gpu.md).
#
#   scripts/gpu/build.sh            # build and pack into target/gpu-pack (~25 min cold on 2 cores)
#   scripts/gpu/build.sh --check    # only `cargo check --features cuda` (~9 min cold; .ci/run runs it)
#   scripts/gpu/build.sh --deps     # only the CUDA dependencies (warms the cache)
#
# What it does, and why:
# - installs nvcc, ptxas, fatbinary, cicc, the CUDA runtime headers and CCCL from the pinned
#   wheel set `cuda-toolkit[nvcc,nvvm,crt,cudart,cccl]==13.0.2` (~100 MB) into
#   $SPECRAG_CACHE/gpu/cuda. 13.0 on purpose: the GPU machines run driver 580 (CUDA 13.0), and
#   PTX from a newer toolkit does not load there. candle-kernels runs nvcc at build time;
#   CUDA_COMPUTE_CAP=90 makes it build for sm_90a (H100/H200) without asking nvidia-smi.
# - compiles the kernels the engine compiles at run time (kernels/src/cuda/*.cu) with NVRTC
#   from the nvrtc wheel and assembles them for sm_90 (scripts/gpu/nvrtc_check.py): a compile
#   error or a register spill fails here, not on the GPU machine.
# - builds from a copy of this checkout (in $SPECRAG_CACHE/gpu/src) whose Cargo.toml patches
#   candle-core to load the CUDA driver, cuBLAS, cuRAND and NVRTC at run time (cudarc's
#   `dynamic-loading`) instead of linking them (candle forces `dynamic-linking`, which needs
#   libcuda and cuBLAS on the build machine). The GPU machine has them (the driver, and
#   PyTorch's CUDA 13 libraries); check.sh points the loader at them. Only libcudart is linked
#   here (candle-kernels' static kernels need it), from the runtime wheel. The copy keeps the
#   patch, and the Cargo.lock it rewrites, out of the checkout.
# - packs the stripped `gpu_check` binary, check.sh (with torch_anchor.py and ratios.py, the
#   device's own PyTorch as the yardstick), the CUDA `specrag` binary with serve_check.sh,
#   serve_client.py, random_model, real passages and the Qwen2.5 tokenizer (the serving
#   check), and the wheel's libcudart into one folder ($SPECRAG_GPU_PACK, default
#   target/gpu-pack), compressed to fit a 64 MiB transfer (~24 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
MODE="${1:-build}"
CACHE="${SPECRAG_CACHE:-$HOME/.cache/specrag}"
GPU="$CACHE/gpu"
CUDA="$GPU/cuda/nvidia/cu13"
PACK="${SPECRAG_GPU_PACK:-$ROOT/target/gpu-pack}"
mkdir -p "$GPU"

log() { echo "[gpu-build $(date +%H:%M:%S)] $*"; }

if [ ! -x "$CUDA/bin/nvcc" ]; then
    log "installing the CUDA 13.0 build wheels into $GPU/cuda"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$GPU/wheels" \
        "cuda-toolkit==13.0.2" "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" \
        "nvidia-cuda-crt==13.0.88" "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85"
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$GPU/cuda" \
        "$GPU"/wheels/*.whl
fi
# The runtime wheel ships only the versioned name; the linker asks for libcudart.so.
ln -sf libcudart.so.13 "$CUDA/lib/libcudart.so"
"$CUDA/bin/nvcc" --version | tail -1
# NVRTC in a folder of its own: pip --target replaces a folder it installs into.
NVRTC="$GPU/nvrtc/nvidia/cu13/lib"
if [ ! -e "$NVRTC/libnvrtc.so.13" ]; then
    log "installing NVRTC 13.0 (the run-time kernels' compiler) into $GPU/nvrtc"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps \
        --dest "$GPU/nvrtc-wheel" "nvidia-cuda-nvrtc==13.0.88"
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$GPU/nvrtc" \
        "$GPU"/nvrtc-wheel/nvidia_cuda_nvrtc-*.whl
fi
log "NVRTC and ptxas on the run-time kernels (kernels/src/cuda), as the engine compiles them"
LD_LIBRARY_PATH="$NVRTC${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" python3 scripts/gpu/nvrtc_check.py \
    --nvrtc "$NVRTC/libnvrtc.so.13" --ptxas "$CUDA/bin/ptxas"

log "copying the checkout to $GPU/src"
mkdir -p "$GPU/src"
# Tracked and untracked-but-not-ignored files (what a build of this checkout sees), staged,
# then only those whose content changed copied over, with the time of the copy: cargo rebuilds
# what changed and nothing else. (Keeping each file's own time would miss an edit made while an
# earlier build ran: older than that build's outputs, it would be taken as built.)
STAGE="$(mktemp -d)"
git ls-files -z --cached --others --exclude-standard \
    | grep -zv -E '^(models/|eval/data/)' \
    | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf - | tar -xf - -C "$STAGE"
(cd "$STAGE" && find . -type f -print0) | while IFS= read -r -d '' f; do
    if ! cmp -s "$STAGE/$f" "$GPU/src/$f"; then
        mkdir -p "$(dirname "$GPU/src/$f")"
        cp "$STAGE/$f" "$GPU/src/$f"
    fi
done
# Files gone from the checkout go from the copy too.
(cd "$GPU/src" && find . -type f -print0) | while IFS= read -r -d '' f; do
    [ -e "$STAGE/$f" ] || rm -f "$GPU/src/$f"
done
rm -rf "$STAGE"
# On a fresh machine the registry holds no sources until something fetched them: fetch first
# (a no-op once they are there), so the candle-core copy below finds its source.
log "cargo fetch (the registry candle-core is copied from)"
cargo fetch --locked
REG="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-core-0.11.1 2>/dev/null | head -1 || true)"
if [ -z "$REG" ]; then
    echo "error: candle-core 0.11.1 is not in the cargo registry after cargo fetch" >&2
    exit 1
fi
if [ ! -f "$GPU/candle-core/Cargo.toml" ] || [ "$REG/Cargo.toml" -nt "$GPU/candle-core/Cargo.toml" ]; then
    rm -rf "$GPU/candle-core"
    cp -r "$REG" "$GPU/candle-core"
    sed -i 's/"dynamic-linking",/"dynamic-loading",/' "$GPU/candle-core/Cargo.toml"
fi
grep -q '"dynamic-loading",' "$GPU/candle-core/Cargo.toml"
cat >>"$GPU/src/Cargo.toml" <<EOF

[patch.crates-io]
candle-core = { path = "$GPU/candle-core" }
EOF

export PATH="$CUDA/bin:$PATH"
export CUDA_ROOT="$CUDA" CUDA_PATH="$CUDA" CUDA_COMPUTE_CAP=90 CUDARC_CUDA_VERSION=13000
export LIBRARY_PATH="$CUDA/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
export CARGO_TARGET_DIR="$GPU/target"
cd "$GPU/src"
if [ "$MODE" = "--deps" ]; then
    log "cargo build --release -p kernels --features cuda (the CUDA dependencies alone)"
    cargo build --release -p kernels --features cuda
    exit 0
fi
if [ "$MODE" = "--check" ]; then
    log "cargo check --release --features cuda (target-engine, its GPU check)"
    cargo check --release -p target-engine --features cuda --example gpu_check
    exit 0
fi
log "cargo build --release --features cuda --example gpu_check --example random_model"
cargo build --release -p target-engine --features cuda --example gpu_check --example random_model
log "cargo build --release -p gateway --features cuda --bin specrag (serve_check.sh's server)"
cargo build --release -p gateway --features cuda --bin specrag
rm -rf "$PACK" && mkdir -p "$PACK"
strip -o "$PACK/gpu_check" "$CARGO_TARGET_DIR/release/examples/gpu_check"
strip -o "$PACK/random_model" "$CARGO_TARGET_DIR/release/examples/random_model"
strip -o "$PACK/specrag" "$CARGO_TARGET_DIR/release/specrag"
cp "$ROOT/scripts/gpu/check.sh" "$ROOT/scripts/gpu/libs.sh" "$ROOT/scripts/gpu/torch_anchor.py" \
    "$ROOT/scripts/gpu/ratios.py" "$ROOT/scripts/gpu/serve_check.sh" \
    "$ROOT/scripts/gpu/serve_client.py" "$PACK/"
cp "$CUDA/lib/libcudart.so.13" "$PACK/"
# serve_check.sh's data: real passages and questions, and the Qwen2.5 tokenizer its
# random-weight models carry (the default model's, from where setup-tests.sh put it).
python3 "$ROOT/scripts/gpu/serve_client.py" prepare --out "$PACK"
TOKENIZER_SRC=""
for d in "${SPECRAG_MODELS:-}" "$ROOT/models" "$CACHE/models"; do
    f="$d/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    if [ -n "$d" ] && [ -f "$f" ]; then TOKENIZER_SRC="$f"; break; fi
done
if [ -n "$TOKENIZER_SRC" ]; then
    # The CUDA build links libcudart (from the runtime wheel here); it opens no GPU.
    LD_LIBRARY_PATH="$CUDA/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$PACK/random_model" --extract-tokenizer "$TOKENIZER_SRC" --out "$PACK/qwen25-tokenizer.gguf"
else
    log "warning: no qwen2.5-coder-1.5b-instruct-q4_k_m.gguf (scripts/setup-tests.sh fetches it):"
    log "serve_check.sh's models will carry the tests' tiny vocabulary instead of Qwen2.5's"
fi
# Compressed: the transfer to the GPU machine carries at most 64 MiB.
(cd "$PACK" && xz -T0 -6 gpu_check random_model specrag libcudart.so.13 \
    && { [ ! -f qwen25-tokenizer.gguf ] || xz -T0 -6 qwen25-tokenizer.gguf; })
du -sh "$PACK" "$PACK"/*
log "packed into $PACK: carry it to the GPU machine and run check.sh, serve_check.sh there (docs/gpu.md)"
