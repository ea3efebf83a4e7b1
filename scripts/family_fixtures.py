#!/usr/bin/env python3
"""llama.cpp's outputs on the tiny model of each family, as the oracle of
target-engine/tests/families.rs.

The tiny random-weight GGUF files are written by the engine's own writer
(`cargo run --release -p target-engine --example write_families -- DIR`,
target_engine::testing::family_specs); llama.cpp then reads each file as any GGUF and gives, per
prompt: its token ids (special tokens parsed, no BOS), the five largest logits after the prompt
(one prefill) and up to 16 greedy tokens (stopping at an end-of-generation token). One JSON object per line:
{"model", "prompt", "prompt_ids", "top5_first": [[id, logit]...], "greedy_ids"}.

Needs llama-cpp-python built from its sdist (the llama.cpp it vendors):
  python3 -m venv ~/.cache/specrag/venv-llama
  ~/.cache/specrag/venv-llama/bin/pip install cmake ninja
  CMAKE_ARGS=-DGGML_NATIVE=ON ~/.cache/specrag/venv-llama/bin/pip install \\
      --no-binary :all: llama-cpp-python==0.3.36            # ~25 min on 2 cores
  ~/.cache/specrag/venv-llama/bin/python scripts/family_fixtures.py \\
      > target-engine/tests/fixtures/families.jsonl

With `--real NAME PATH` it writes the same lines for a real model file instead, on real-text
prompts (this repository's docs, a RAG prompt in Gemma's turns), BOS added as the file asks:
  scripts/family_fixtures.py --real gemma3-270m models/gemma-3-270m-q4_k_m.gguf \\
      > target-engine/tests/fixtures/gemma3-270m.jsonl
"""
import json
import os
import subprocess
import sys
import tempfile

import llama_cpp

PROMPTS = [
    "the theme in the tea",
    "<|im_start|>user\nan ant then a hat<|im_end|>\n<|im_start|>assistant\n",
    "Zürich, 1867: thirty-three \u00e9t\u00e9s in a row, 1234567 of them",
    "a" * 40 + " the " * 12,
    " ".join(["the thin ant ran in the sand and then the ant sat in the tent"] * 12),
    "the <unk> in the tea<unk>",
]
GREEDY = 16


def lines(name, path, prompts, add_bos):
    """One fixture line per prompt for the model file at `path`."""
    llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_threads=2,
                          n_batch=4096, logits_all=True, verbose=False,
                          type_k=0, type_v=0)  # f32 KV: the engines then differ only in their products
    vocab = llm._model.vocab
    for prompt in prompts:
        ids = llm.tokenize(prompt.encode(), add_bos=add_bos, special=True)
        llm.reset()
        llm.eval(ids)
        first = list(llm.scores[llm.n_tokens - 1])
        top5 = sorted(range(len(first)), key=lambda i: -first[i])[:5]
        greedy = []
        for _ in range(GREEDY):
            row = llm.scores[llm.n_tokens - 1]
            tok = max(range(len(row)), key=lambda i: row[i])
            greedy.append(tok)
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                break
            llm.eval([tok])
        print(json.dumps({
            "model": name,
            "prompt": prompt,
            "prompt_ids": ids,
            "top5_first": [[i, float(first[i])] for i in top5],
            "greedy_ids": greedy,
        }, ensure_ascii=False))


def real(name, path):
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    paras = [p for p in readme.split("\n\n") if len(p) > 200][:2]
    blend = open(os.path.join(root, "docs", "blend.md"), encoding="utf-8").read()[:2500]
    rag = ("<start_of_turn>user\nAnswer the question using the documents.\n\nDocument: "
           + blend + "\n\nQuestion: What does a blended prefill recompute?<end_of_turn>\n"
           "<start_of_turn>model\n")
    lines(name, path, paras + [rag, "The capital of France is"], add_bos=True)


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--real":
        return real(sys.argv[2], sys.argv[3])
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with tempfile.TemporaryDirectory() as tmp:
        written = subprocess.run(
            ["cargo", "run", "--release", "-q", "-p", "target-engine",
             "--example", "write_families", "--", tmp],
            cwd=root, check=True, capture_output=True, text=True,
        ).stdout.split()
        for path in written:
            name = os.path.basename(path)[: -len(".gguf")]
            lines(name, path, PROMPTS, add_bos=False)

if __name__ == "__main__":
    sys.exit(main())
