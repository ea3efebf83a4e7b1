#!/usr/bin/env python3
"""llama.cpp side of `specrag-bench prefill`, for ratios measured in one run on one machine.

Needs llama-cpp-python (`pip install llama-cpp-python`, which builds llama.cpp from source).
Uses the same prompt text as specrag's benchmark, tokenized by llama.cpp (specrag's tokenizer
matches it id for id), cycled to each length; prints the same JSON shape as
`specrag-bench prefill --json`, one line per model.

    python3 scripts/bench_llamacpp.py models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf ...
"""
import argparse
import json
import statistics
import time

from llama_cpp import Llama

# Keep identical to TEXT in gateway/src/bench.rs.
TEXT = ("The printing press, developed around 1440 by Johannes Gutenberg, "
        "combined movable metal type, oil-based inks and a screw press adapted from wine making. "
        "Within decades presses operated in more than two hundred European cities, and the cost "
        "of books fell sharply, which spread literacy, standardized spelling and accelerated the "
        "exchange of scientific results between scholars who had never met. ")


def ids_of(llm, n):
    base = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    return [base[i % len(base)] for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    for path in a.models:
        llm = Llama(model_path=path, n_ctx=max(lengths) + 64, n_batch=max(lengths), n_threads=a.threads,
                    n_threads_batch=a.threads, verbose=False, logits_all=False)
        # Warm-up (weight repacking, page-in), as specrag warms up at load.
        llm.reset(); llm.eval(ids_of(llm, 16))
        points = []
        for n in lengths:
            ids = ids_of(llm, n)
            times = []
            for _ in range(max(1, a.reps)):
                llm.reset()
                t = time.perf_counter(); llm.eval(ids); times.append((time.perf_counter() - t) * 1e3)
            ms = statistics.median(times)
            points.append({"tokens": n, "ms": ms, "tok_s": n / ms * 1e3})
        llm.reset(); llm.eval(ids_of(llm, 512))
        steps = []
        for _ in range(max(1, a.decode_steps)):
            nxt = int(max(range(llm.n_vocab()), key=lambda i: llm.scores[llm.n_tokens - 1][i]))
            t = time.perf_counter(); llm.eval([nxt]); steps.append((time.perf_counter() - t) * 1e3)
        print(json.dumps({"model": path, "engine": "llama.cpp", "prefill": points,
                          "decode_ms_per_token": statistics.median(steps)}), flush=True)


if __name__ == "__main__":
    main()
