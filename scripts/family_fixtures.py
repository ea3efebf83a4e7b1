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
]
GREEDY = 16


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with tempfile.TemporaryDirectory() as tmp:
        written = subprocess.run(
            ["cargo", "run", "--release", "-q", "-p", "target-engine",
             "--example", "write_families", "--", tmp],
            cwd=root, check=True, capture_output=True, text=True,
        ).stdout.split()
        for path in written:
            name = os.path.basename(path)[: -len(".gguf")]
            llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=2,
                                  n_batch=2048, logits_all=True, verbose=False)
            vocab = llm._model.vocab
            for prompt in PROMPTS:
                ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
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
            del llm


if __name__ == "__main__":
    sys.exit(main())
