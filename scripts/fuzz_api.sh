#!/usr/bin/env bash
# Fuzzes the HTTP API with schemathesis (from PyPI) against the OpenAPI document the server
# itself serves, and fails on any 5xx or response that does not match the document. The server
# runs on tiny random-weight models so hundreds of requests take seconds; the API surface,
# validation and error paths are the same as with the default models.
#
# Usage: scripts/fuzz_api.sh [MAX_EXAMPLES]   (after `cargo build --release`)
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_EXAMPLES="${1:-40}"
CACHE="${SPECRAG_CACHE:-$HOME/.cache/specrag}"
VENV="$CACHE/venv-schemathesis"
if [ ! -x "$VENV/bin/schemathesis" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet 'schemathesis>=4,<5'
fi
BIN=target/release/specrag
TMP="$(mktemp -d)"
PORT="${SPECRAG_FUZZ_PORT:-18080}"
cleanup() {
    if [ -n "${PID:-}" ]; then kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; fi
    rm -rf "$TMP"
}
trap cleanup EXIT
"$BIN" tiny-models "$TMP/models" >/dev/null
MODELS=(--target "$TMP/models/target.gguf" --speculator "$TMP/models/speculator.gguf")
"$BIN" "${MODELS[@]}" ingest --data "$TMP/data" README.md ARCHITECTURE.md >/dev/null
"$BIN" "${MODELS[@]}" serve --data "$TMP/data" --addr "127.0.0.1:$PORT" --queue 256 --timeout-secs 60 \
    2>"$TMP/server.log" &
PID=$!
for _ in $(seq 1 100); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
    sleep 0.2
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { cat "$TMP/server.log"; exit 1; }
"$VENV/bin/schemathesis" run "http://127.0.0.1:$PORT/openapi.json" \
    --checks all --max-examples "$MAX_EXAMPLES" --seed 1 --no-color
echo "schemathesis: no server errors, every response matched the OpenAPI document"
