#!/usr/bin/env python3
"""specrag vs llama.cpp prefill/decode, interleaved in one run so both see the same machine.

Alternates `specrag-bench prefill --json` and `bench_llamacpp.py` for each model, ROUNDS times,
and prints medians and ratios (specrag / llama.cpp). This machine kind has noisy neighbours
(timings swing up to 2x between minutes), so only ratios from one interleaved run mean much.

    python3 scripts/compare_llamacpp.py [--rounds 3] [--lengths 256,512,1024,2048] MODEL.gguf...
Needs llama-cpp-python in the Python that runs it, and target/release/specrag-bench built (`cargo build --release -p eval`).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")][0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--specrag-bench", default=os.path.join(HERE, "..", "target", "release", "specrag-bench"))
    a = ap.parse_args()
    for model in a.models:
        ours, theirs = [], []
        for r in range(a.rounds):
            print(f"{os.path.basename(model)}: round {r + 1}/{a.rounds}", file=sys.stderr)
            ours.append(run([a.specrag_bench, "prefill", "--json", "--target-only", "--target", model,
                             "--reps", "1", "--decode-steps", str(a.decode_steps), "--lengths", a.lengths]))
            theirs.append(run([sys.executable, os.path.join(HERE, "bench_llamacpp.py"), model, "--reps", "1",
                               "--decode-steps", str(a.decode_steps), "--lengths", a.lengths]))
        print(f"\n{os.path.basename(model)} ({a.rounds} interleaved rounds, medians; "
              f"specrag's attention: {ours[0].get('attention', 'f32')})")
        print(f"{'':>16} {'specrag':>10} {'llama.cpp':>10} {'ratio':>7}")
        for i, n in enumerate(int(x) for x in a.lengths.split(",")):
            o = statistics.median(r["prefill"][i]["tok_s"] for r in ours)
            t = statistics.median(r["prefill"][i]["tok_s"] for r in theirs)
            rr = statistics.median(x["prefill"][i]["tok_s"] / y["prefill"][i]["tok_s"] for x, y in zip(ours, theirs))
            print(f"prefill {n:>5} tok/s {o:>10.1f} {t:>10.1f} {rr:>6.2f}x")
        o = statistics.median(r["decode_ms_per_token"] for r in ours)
        t = statistics.median(r["decode_ms_per_token"] for r in theirs)
        rr = statistics.median(x["decode_ms_per_token"] / y["decode_ms_per_token"] for x, y in zip(ours, theirs))
        print(f"decode ms/token      {o:>10.1f} {t:>10.1f} {rr:>6.2f}x")


if __name__ == "__main__":
    main()
