#!/usr/bin/env bash
# Runs on the GPU machine, from the folder scripts/gpu/build.sh packed (docs/gpu.md):
#
#   bash target/gpu-pack/check.sh [gpu_check flags]     # results in $OUT (default ./gpu-out)
#
# Unpacks the binary, points the loader at the CUDA libraries the machine has (the driver's
# libcuda; cuBLAS, cuBLASLt, cuRAND and NVRTC from PyTorch's CUDA 13 wheels or a CUDA
# install; the packed libcudart), then runs `gpu_check --device cuda`: parity with the CPU
# engine and the device's reuse invariants on a random-weight Qwen2.5-1.5B shape, then
# speed at the 1.5B and 7B shapes, then the device's own PyTorch on the same shapes and prompt
# (torch_anchor.py) and specrag's times as ratios of its (ratios.py). Writes $OUT/gpu.json
# (after every part), $OUT/torch.json, $OUT/ratios.json and $OUT/gpu.log.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$PWD/gpu-out}"
WORK="${SPECRAG_GPU_WORK:-${TMPDIR:-/tmp}/specrag-gpu}"
mkdir -p "$OUT" "$WORK/bin"
LOG="$OUT/gpu.log"
: >"$LOG"
say() { echo "[check.sh $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

for f in gpu_check libcudart.so.13; do
    if [ -f "$HERE/$f.xz" ]; then
        xz -dc "$HERE/$f.xz" >"$WORK/bin/$f"
    else
        cp "$HERE/$f" "$WORK/bin/$f"
    fi
done
chmod +x "$WORK/bin/gpu_check"

# shellcheck source=libs.sh
source "$HERE/libs.sh"
# Not in a pipe: the function exports LD_LIBRARY_PATH into this shell.
cuda_library_path "$WORK/bin" >"$WORK/libs.txt"
tee -a "$LOG" <"$WORK/libs.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>&1 | tee -a "$LOG" || true
lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\))' | tee -a "$LOG" || true

say "gpu_check --out $OUT --device cuda $*"
set +e
"$WORK/bin/gpu_check" --out "$OUT" --device cuda --work "$WORK/models" "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
set -e
rm -rf "$WORK/models"
say "gpu_check exited with $rc; $OUT/gpu.json"

# The yardstick: the device's own PyTorch on the same shapes and prompt (SPECRAG_TORCH_ANCHOR=0
# skips it), then specrag's times as ratios of its.
if [ "${SPECRAG_TORCH_ANCHOR:-1}" != 0 ]; then
    anchor=()
    set -- "$@"
    while [ $# -gt 0 ]; do
        case "$1" in
            --shapes|--chunk|--chunks|--runs|--long) anchor+=("$1" "$2"); shift 2 ;;
            *) shift ;;
        esac
    done
    say "torch_anchor.py ${anchor[*]}"
    set +e
    python3 "$HERE/torch_anchor.py" --out "$OUT/torch.json" --device cuda "${anchor[@]}" 2>&1 | tee -a "$LOG"
    trc=${PIPESTATUS[0]}
    python3 "$HERE/ratios.py" "$OUT/gpu.json" "$OUT/torch.json" --out "$OUT/ratios.json" 2>&1 | tee -a "$LOG"
    set -e
    say "torch_anchor.py exited with $trc; $OUT/torch.json, $OUT/ratios.json"
fi
exit "$rc"
