#!/usr/bin/env python3
"""specrag vs llama.cpp's own llama-bench, prefill and decode, interleaved in one run.

For each round and model: `specrag-bench prefill --json --reps 1 --target-only`, then
`llama-bench -p LENGTHS -n 32` (prefill) and `llama-bench -p 0 -n 32 -d 512` (32 decoded tokens
after 512 of context, as specrag's decode figure). Prints, per model, the median throughput of
each engine and the median of the rounds' paired ratios (this machine kind is noisy: only
ratios taken side by side mean much).

    python3 scripts/compare_llama_bench.py --llama-bench PATH/llama-bench [--rounds 3] \
        [--lengths 512,1024,2048] MODEL.gguf...

llama-bench builds from the llama.cpp vendored in the llama-cpp-python sdist (cmake
`-DGGML_NATIVE=ON`, target `llama-bench`); target/release/specrag-bench must be built (`cargo build --release -p eval`).
"""
import argparse
import json
import os
import statistics
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def lines(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def one_round(args, model, env):
    """specrag's and llama.cpp's prefill tok/s per length and decode ms/token, one round."""
    lengths = [int(x) for x in args.lengths.split(",")]
    spec = lines([os.path.join(HERE, "..", "target", "release", "specrag-bench"), "prefill",
                  "--json", "--lengths", args.lengths, "--reps", "1", "--target-only",
                  "--target", model])[0]
    s = {p["tokens"]: p["tok_s"] for p in spec["prefill"]}
    s["decode"] = spec["decode_ms_per_token"]
    bench = [args.llama_bench, "-m", model, "-t", str(args.threads), "-r", "1", "-o", "jsonl"]
    pre = lines(bench + ["-p", args.lengths, "-n", "0"], env)
    dec = lines(bench + ["-p", "0", "-n", "32", "-d", "512"], env)
    l = {d["n_prompt"]: d["avg_ts"] for d in pre if d["n_prompt"] in lengths}
    l["decode"] = 1000.0 / dec[0]["avg_ts"]
    return s, l


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.dirname(os.path.abspath(args.llama_bench))
    runs = {m: [] for m in args.models}
    for _ in range(args.rounds):
        for m in args.models:
            runs[m].append(one_round(args, m, env))
    for m, rs in runs.items():
        print(os.path.basename(m))
        for key in [int(x) for x in args.lengths.split(",")] + ["decode"]:
            s = statistics.median(r[0][key] for r in rs)
            l = statistics.median(r[1][key] for r in rs)
            ratios = [r[0][key] / r[1][key] for r in rs]
            unit = "ms/token" if key == "decode" else "tok/s"
            what = "decode after 512" if key == "decode" else f"prefill {key}"
            print(f"  {what}: specrag {s:.1f} {unit}, llama.cpp {l:.1f}: ratio "
                  f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
