#!/usr/bin/env bash
# `specrag serve` on the GPU, timed over HTTP: runs on the GPU machine from the folder
# scripts/gpu/build.sh packed (docs/gpu.md, *Serving on the device*):
#
#   bash target/gpu-pack/serve_check.sh [--shape 7b] [--weights bf16] [--clients 1,4,16,64]
#                                       [--requests 2] [--device cuda]   # results in $OUT
#
# A random-weight GGUF of a real Qwen2.5 shape carrying the real Qwen2.5 tokenizer (packed:
# qwen25-tokenizer.gguf, copied from the default model's metadata) is written, the packed real
# passages (200 Wikipedia paragraphs of HotpotQA, one document each) are ingested eagerly by
# the device engine, `specrag serve --device cuda` starts, and serve_client.py runs closed-loop
# clients with the default method (guarded, and unguarded: `fidelity: fast`) and with
# full_recompute. Writes $OUT/serve.json (after
# every configuration), $OUT/ingest.log, $OUT/serve.log and $OUT/serve_check.log.
#
# `--device candle-cpu --shape small --clients 1,2 --requests 1` runs every step on a CPU (the
# pack, or this checkout with SPECRAG_BIN=target/release: the same script, slowly).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$PWD/serve-out}"
WORK="${SPECRAG_GPU_WORK:-${TMPDIR:-/tmp}/specrag-serve}"
SHAPE=7b WEIGHTS=bf16 CLIENTS=1,4,16,64 REQUESTS=2 DEVICE=cuda MAX_BATCH=64
while [ $# -gt 0 ]; do
    case "$1" in
        --shape) SHAPE="$2" ;;
        --weights) WEIGHTS="$2" ;;
        --clients) CLIENTS="$2" ;;
        --requests) REQUESTS="$2" ;;
        --device) DEVICE="$2" ;;
        --max-batch) MAX_BATCH="$2" ;;
        *) echo "unknown flag $1 (see the head of $0)" >&2; exit 2 ;;
    esac
    shift 2
done
mkdir -p "$OUT" "$WORK/bin"
LOG="$OUT/serve_check.log"
: >"$LOG"
say() { echo "[serve_check.sh $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

# The binaries: packed (xz), or a local build's (SPECRAG_BIN=target/release).
BIN="${SPECRAG_BIN:-}"
if [ -z "$BIN" ]; then
    BIN="$WORK/bin"
    for f in specrag random_model libcudart.so.13; do
        if [ -f "$HERE/$f.xz" ]; then xz -dc "$HERE/$f.xz" >"$BIN/$f"; elif [ -f "$HERE/$f" ]; then cp "$HERE/$f" "$BIN/$f"; fi
    done
    chmod +x "$BIN/specrag" "$BIN/random_model"
    RANDOM_MODEL="$BIN/random_model"
else
    RANDOM_MODEL="$BIN/examples/random_model"
fi
# shellcheck source=libs.sh
source "$HERE/libs.sh"
# Not in a pipe: the function exports LD_LIBRARY_PATH into this shell.
cuda_library_path "$BIN" >"$WORK/libs.txt"
tee -a "$LOG" <"$WORK/libs.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG" || true

DATA="$HERE"
[ -f "$DATA/passages.jsonl" ] || DATA="$WORK/data-src"
if [ ! -f "$DATA/passages.jsonl" ]; then
    python3 "$HERE/serve_client.py" prepare --out "$DATA" | tee -a "$LOG"
fi
TOKENIZER="$WORK/qwen25-tokenizer.gguf"
if [ -f "$HERE/qwen25-tokenizer.gguf.xz" ]; then
    xz -dc "$HERE/qwen25-tokenizer.gguf.xz" >"$TOKENIZER"
elif [ -f "$HERE/qwen25-tokenizer.gguf" ]; then
    TOKENIZER="$HERE/qwen25-tokenizer.gguf"
fi

MODEL="$WORK/qwen2-$SHAPE-random.gguf"
say "writing $MODEL (random weights; tokenizer: ${TOKENIZER})"
TOKENIZER_FLAG=()
[ -f "$TOKENIZER" ] && TOKENIZER_FLAG=(--tokenizer "$TOKENIZER")
"$RANDOM_MODEL" --shape "$SHAPE" "${TOKENIZER_FLAG[@]}" --out "$MODEL" 2>&1 | tee -a "$LOG"

export SPECRAG_TARGET="$MODEL" SPECRAG_DEVICE="$DEVICE" SPECRAG_DEVICE_WEIGHTS="$WEIGHTS"
rm -rf "$WORK/store"
say "ingesting $(wc -l <"$DATA/passages.jsonl") passages on $DEVICE"
started=$SECONDS
"$BIN/specrag" ingest --data "$WORK/store" --collection passages "$DATA/passages.jsonl" >"$OUT/ingest.log" 2>&1 \
    || { tail -20 "$OUT/ingest.log"; exit 1; }
say "ingested in $((SECONDS - started)) s: $(tail -1 "$OUT/ingest.log")"

PORT="${SPECRAG_PORT:-18181}"
"$BIN/specrag" serve --data "$WORK/store" --addr "127.0.0.1:$PORT" --max-batch "$MAX_BATCH" \
    --queue 1024 >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    if python3 -c "import http.client as h; c=h.HTTPConnection('127.0.0.1',$PORT,timeout=2); c.request('GET','/health'); exit(c.getresponse().status!=200)" 2>/dev/null; then
        break
    fi
    kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/serve.log"; exit 1; }
    sleep 1
done
say "serving on $PORT: $(python3 -c "import http.client as h, json; c=h.HTTPConnection('127.0.0.1',$PORT); c.request('GET','/health'); print(json.loads(c.getresponse().read())['target'])")"
python3 "$HERE/serve_client.py" run --port "$PORT" --questions "$DATA/questions.jsonl" \
    --out "$OUT/serve.json" --clients "$CLIENTS" --requests "$REQUESTS" 2>&1 | tee -a "$LOG"
say "done: $OUT/serve.json"
