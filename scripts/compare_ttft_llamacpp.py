#!/usr/bin/env python3
"""The evaluation's TTFT against llama.cpp's full prefill of the same prompts, interleaved.

Each round runs the fidelity study's timing run (`specrag-eval --study`, profile cases, the
small pairing), which writes every case's prompt token ids to `<round>/prompts.jsonl`, then
has llama.cpp (llama-cpp-python, 2 threads) prefill exactly those ids and pick the first token.
Rounds alternate specrag and llama.cpp so both see the same machine; per case the median over
rounds is kept, and the script prints, for each configuration, the median and the largest
ratio of its TTFT to llama.cpp's full prefill of the same prompt (and to specrag's own full
recompute). The summary also goes to `<out>/ttft-llamacpp.json`.

    python3 scripts/compare_ttft_llamacpp.py --out DIR [--rounds 2] [--cases 20]
        [--configs target_probe@0.15,target_probe@0.25] [--eval target/release/specrag-eval]
        [--model models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf]

Needs llama-cpp-python in the Python that runs it and `cargo build --release -p eval`.
An existing round directory is resumed (`--resume`), so an interrupted comparison goes on.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def specrag_round(a, out):
    cmd = [a.eval, "--study", "--out", out, "--study-cases", str(a.cases), "--sweep-cases", str(a.cases),
           "--study-datasets", "profiles", "--study-configs", a.configs]
    if os.path.exists(os.path.join(out, "study.jsonl")):
        cmd.append("--resume")
    print("running", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    rows = [r for r in read_jsonl(os.path.join(out, "study.jsonl"))
            if r["pairing"] == "small" and r["dataset"] == "profiles"]
    prompts = {p["case"]: p["ids"] for p in read_jsonl(os.path.join(out, "prompts.jsonl"))
               if p["pairing"] == "small" and p["dataset"] == "profiles"}
    return rows, prompts


def llamacpp_round(llm, prompts):
    ttft = {}
    for case, ids in sorted(prompts.items()):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        logits = llm.scores[llm.n_tokens - 1]
        max(range(len(logits)), key=logits.__getitem__)
        ttft[case] = (time.perf_counter() - t) * 1e3
        print(f"llama.cpp {case}: {len(ids)} tokens, {ttft[case]:.0f} ms", file=sys.stderr, flush=True)
    return ttft


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the rounds and the summary")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--configs", default="target_probe@0.15,target_probe@0.25",
                    help="study configurations timed besides full recompute")
    ap.add_argument("--eval", default=os.path.join(ROOT, "target", "release", "specrag-eval"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
                    help="the small pairing's target GGUF (what specrag-eval uses)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from llama_cpp import Llama

    os.makedirs(a.out, exist_ok=True)
    ours, theirs, lengths = {}, {}, {}
    llm = None
    for r in range(a.rounds):
        rows, prompts = specrag_round(a, os.path.join(a.out, f"round-{r + 1}"))
        for row in rows:
            ours.setdefault((row["label"], row["case"]), []).append(row["ttft_ms"])
        if llm is None:
            n_ctx = max(len(ids) for ids in prompts.values()) + 64
            llm = Llama(model_path=a.model, n_ctx=n_ctx, n_batch=n_ctx, n_threads=a.threads,
                        n_threads_batch=a.threads, verbose=False, logits_all=False)
            llm.reset()
            llm.eval(next(iter(prompts.values()))[:16])  # warm-up: weight repacking, page-in
        for case, ms in llamacpp_round(llm, prompts).items():
            theirs.setdefault(case, []).append(ms)
            lengths[case] = len(prompts[case])

    cases = sorted(theirs)
    llama = {c: statistics.median(theirs[c]) for c in cases}
    labels = sorted({label for label, _ in ours}, key=lambda l: (l != "full_recompute", l))
    full = {c: statistics.median(ours[("full_recompute", c)]) for c in cases if ("full_recompute", c) in ours}
    summary = {"rounds": a.rounds, "cases": len(cases), "model": os.path.basename(a.model),
               "prompt_tokens_median": statistics.median(lengths.values()),
               "llamacpp_ttft_ms_median": statistics.median(llama.values()), "configs": {}}
    print(f"\n{len(cases)} profile cases, {a.rounds} interleaved rounds, medians per case; "
          f"prompts {min(lengths.values())}-{max(lengths.values())} tokens")
    print(f"llama.cpp full prefill + first token: median {summary['llamacpp_ttft_ms_median']:.0f} ms")
    print(f"{'configuration':<22} {'TTFT ms':>8} {'÷ llama.cpp':>12} {'max':>6} {'÷ full':>7}")
    for label in labels:
        mine = {c: statistics.median(ours[(label, c)]) for c in cases if (label, c) in ours}
        vs_llama = [mine[c] / llama[c] for c in mine]
        vs_full = [mine[c] / full[c] for c in mine if c in full]
        s = {"ttft_ms_median": statistics.median(mine.values()),
             "vs_llamacpp_median": statistics.median(vs_llama), "vs_llamacpp_max": max(vs_llama),
             "vs_full_recompute_median": statistics.median(vs_full) if vs_full else None}
        summary["configs"][label] = s
        print(f"{label:<22} {s['ttft_ms_median']:>8.0f} {s['vs_llamacpp_median']:>12.3f} "
              f"{s['vs_llamacpp_max']:>6.3f} {s['vs_full_recompute_median'] or float('nan'):>7.3f}")
    summary["per_case"] = {c: {"prompt_tokens": lengths[c], "llamacpp_ms": theirs[c],
                               "specrag_ms": {l: ours[(l, c)] for l in labels if (l, c) in ours}}
                           for c in cases}
    with open(os.path.join(a.out, "ttft-llamacpp.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
