#!/usr/bin/env python3
"""Measures KV reuse of passages a client sends itself, as a LangChain-style app would: a
system message, five retrieved passages and a question, sent twice, the second time reordered
with one passage replaced. `--form pasted` (the default) pastes the passages into the system
message joined by blank lines, as LangChain's "stuff" chain does; `--form documents` sends them
in the `specrag.documents` extension. Prints each request's TTFT and where its chunks' KV came
from. Needs a running `specrag serve` (default models) with an empty or unrelated data directory:

    cargo specrag serve --data /tmp/passages --addr 127.0.0.1:8090 &
    python3 scripts/passages_reuse.py --url http://127.0.0.1:8090 [--rounds 3] [--form pasted]

Passages are paragraphs of this repository's docs (docs/*.md), so nothing is read from outside it.
"""
import argparse
import json
import pathlib
import random
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent


def paragraphs(min_chars=600, max_chars=1500):
    out = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for p in path.read_text(encoding="utf-8").split("\n\n"):
            p = p.strip()
            if min_chars <= len(p) <= max_chars and not p.startswith(("|", "```")):
                out.append(p)
    return out


def ask(url, docs, question, collection, form):
    system = "Answer from the passages, briefly."
    extension = {"collection": collection}
    if form == "pasted":
        system = "\n\n".join([system] + [d["text"] for d in docs])
    else:
        extension["documents"] = docs
    body = {
        "model": "specrag",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 16,
        "specrag": extension,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["specrag"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8090")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--form", choices=["pasted", "documents"], default="pasted")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    pool = paragraphs()
    question = "How does specrag decide which tokens to recompute?"
    print(
        "round | request | passages | from memory | from disk | computed | escalated (kept) | TTFT ms | ratio"
    )
    for r in range(a.rounds):
        picked = rng.sample(pool, 6)
        first = [{"id": f"p{i}", "text": t} for i, t in enumerate(picked[:5])]
        second = list(reversed(first[1:])) + [{"id": "p5", "text": picked[5]}]
        collection = f"passages-{a.seed}-{r}"
        one = ask(a.url, first, question, collection, a.form)
        two = ask(a.url, second, question, collection, a.form)
        for name, s in (("first", one), ("second", two)):
            u = s["reuse"]
            ratio = s["timings"]["ttft_ms"] / one["timings"]["ttft_ms"]
            print(
                f"{r} | {name} | {len(s['chunks'])} | {u['chunks_from_memory']} | "
                f"{u['chunks_from_disk']} | {u['chunks_recomputed']} | {u['guard']['escalated']} ({u['guard']['kept_tokens']}) | "
                f"{s['timings']['ttft_ms']:.0f} | {ratio:.2f}"
            )


if __name__ == "__main__":
    main()
