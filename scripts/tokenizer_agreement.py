#!/usr/bin/env python3
"""specrag's tokenizer and Hugging Face's `tokenizers` crate against llama.cpp, on real text.

Texts: every paragraph of README.md, ARCHITECTURE.md and docs/*.md, and the passages of the
first N questions of eval/data/hotpotqa.jsonl (Wikipedia: names in many scripts, dates,
numbers). For each GGUF file, llama.cpp (llama-cpp-python with `vocab_only`) tokenizes every
text without BOS and without parsing special tokens, timed one text at a time; then the
`tokenizers_compare` example encodes the same texts with specrag's tokenizer and with the
`tokenizers` crate built from the same vocabulary, and reports agreement with llama.cpp's ids
and tokens per second (one thread). One JSON line per engine and model on stdout.

    python3 scripts/tokenizer_agreement.py [--passages 100] [--reps 3] MODEL.gguf...

Needs llama-cpp-python (`~/.cache/specrag/venv-llama`, made as scripts/family_fixtures.py says)
and builds the example with `cargo build --release -p target-engine --features hf-tokenizers
--example tokenizers_compare`.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

from llama_cpp import Llama

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def paragraphs(path):
    with open(path, encoding="utf-8") as f:
        return [p.strip("\n") for p in f.read().split("\n\n") if p.strip()]


def texts(passages):
    docs = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "ARCHITECTURE.md")]
    docs += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    out = [p for d in docs for p in paragraphs(d)]
    with open(os.path.join(ROOT, "eval", "data", "hotpotqa.jsonl"), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= passages:
                break
            ctx = json.loads(line)["context"]
            out += [p.strip() for p in ctx.split("Passage ") if p.strip()]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--passages", type=int, default=100, help="hotpotqa questions whose passages are added")
    ap.add_argument("--reps", type=int, default=3, help="timed passes (the best is kept)")
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "target-engine", "--features", "hf-tokenizers",
                    "--example", "tokenizers_compare"], cwd=ROOT, check=True)
    exe = os.path.join(ROOT, "target", "release", "examples", "tokenizers_compare")
    corpus = texts(a.passages)
    for model in a.models:
        llm = Llama(model_path=model, vocab_only=True, verbose=False)
        ids = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in corpus]
        best = float("inf")
        for _ in range(a.reps):
            t0 = time.perf_counter()
            for t in corpus:
                llm.tokenize(t.encode(), add_bos=False, special=False)
            best = min(best, time.perf_counter() - t0)
        n = sum(len(x) for x in ids)
        print(json.dumps({"engine": "llama.cpp (llama-cpp-python)", "model": model, "texts": len(corpus),
                          "tokens": n, "seconds": best, "tokens_per_s": n / best}), flush=True)
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8") as f:
            for t, x in zip(corpus, ids):
                f.write(json.dumps({"text": t, "ids": x}, ensure_ascii=False) + "\n")
            name = f.name
        try:
            with open(name, encoding="utf-8") as f:
                subprocess.run([exe, model, "--reps", str(a.reps)], stdin=f, check=True, stdout=sys.stdout)
        finally:
            os.unlink(name)


if __name__ == "__main__":
    main()
