#!/usr/bin/env python3
"""Speculative decoding on real RAG prompts: decode time per generated token without drafting
and with each drafter (`spec_draft`: model = the speculator, lookup = prompt lookup, both), on
the same prompts in one run (rotating which goes first), and whether the answers are identical. Needs a running `specrag serve` (default models, an empty
or unrelated data directory):

    target/release/specrag serve --data /tmp/spec-bench --addr 127.0.0.1:8091 &
    python3 scripts/spec_decode_bench.py --url http://127.0.0.1:8091 [--cases 20]

Prompts: the first --cases questions (after --skip) of eval/data/hotpotqa.jsonl (HotpotQA dev, distractor
setting, in LongBench's shape; see eval/data/README.md), each over its first --passages passages sent as
`documents`, asking for a long answer. Each prompt is first asked once (1 token) so its chunks'
KV, the target's and the speculator's, is stored: what is measured is decoding, not ingestion.
Answers use `fidelity: fast` so that no request is moved to a full prefill mid-answer (which
would mix a prefill into the decode time); the guard sees the same gaps either way.

With --llama-draft URL and --llama-plain URL (two `llama-server`s on the same GGUF files, 2
threads each, the first started with `-md <speculator> --draft-max 3 --draft-p-min 0.75`, the
second without a draft model), each case also asks both for the same prompt (the text
specrag's template builds from the same passages and question, up to --max-tokens greedy
tokens), in rotating order with specrag's two answers, and prints tokens/s of all four:

    llama-server -m models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        -md models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf -t 2 -td 2 --port 8092 ...

With --cold, what a first request pays instead: for prompts after the first --cases (so their
speculator KV is not stored yet), the target's chunk KV is stored first, then one answer with
drafting (the speculator's chunk KV computed on the way), one without, and one with drafting
again (now stored); printed as request time (total_ms).
"""
import argparse
import json
import pathlib
import re
import statistics
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cases(n, passages, skip=0):
    out = []
    with open(ROOT / "eval" / "data" / "hotpotqa.jsonl", encoding="utf-8") as f:
        for j, line in enumerate(f):
            if j < skip:
                continue
            row = json.loads(line)
            parts = [p.strip() for p in re.split(r"Passage \d+:\n", row["context"]) if p.strip()]
            docs = [{"id": f"p{i}", "text": t} for i, t in enumerate(parts[:passages])]
            out.append((row["input"], docs))
            if len(out) == n:
                break
    return out


def ask(url, question, docs, max_tokens, spec, draft=None):
    body = {
        "query": "Answer in detail, in several paragraphs, citing the passages: " + question,
        "documents": docs,
        "collection": "spec-bench",
        "max_tokens": max_tokens,
        "fidelity": "fast",
        "spec_decode": spec,
    }
    if draft:
        body["spec_draft"] = draft
    req = urllib.request.Request(
        url + "/rag/query",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=1200) as r:
        return json.load(r)


def rag_prompt(question, docs):
    """The prompt text specrag's RagTemplate assembles (target-engine/src/reuse/assembly.rs)."""
    text = "<|im_start|>system\nAnswer the question using the documents.<|im_end|>\n<|im_start|>user\n"
    for d in docs:
        text += f"Document: {d['text'].strip()}\n\n"
    q = "Answer in detail, in several paragraphs, citing the passages: " + question
    return text + f"Question: {q.strip()}<|im_end|>\n<|im_start|>assistant\n"


def llama(url, prompt, max_tokens):
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False,
            "seed": 0}
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=1200) as r:
        return json.load(r)


def llama_compare(a):
    print("case | specrag off tok/s | specrag on tok/s | llama plain tok/s | llama draft tok/s | specrag on = off")
    sums = {k: [0.0, 0] for k in ("off", "on", "plain", "draft")}
    identical = 0
    for i, (q, docs) in enumerate(cases(a.cases, a.passages, a.skip)):
        ask(a.url, q, docs, 1, False)
        ask(a.url, q, docs, 2, True)
        prompt = rag_prompt(q, docs)
        jobs = [
            ("off", lambda: ask(a.url, q, docs, a.max_tokens, False)),
            ("on", lambda: ask(a.url, q, docs, a.max_tokens, True)),
            ("plain", lambda: llama(a.llama_plain, prompt, a.max_tokens)),
            ("draft", lambda: llama(a.llama_draft, prompt, a.max_tokens)),
        ]
        k = i % len(jobs)
        got = {name: run() for name, run in jobs[k:] + jobs[:k]}
        row = {}
        for name in ("off", "on"):
            ms, n = got[name]["timings"]["decode_ms"], got[name]["tokens"] - 1
            sums[name][0] += ms
            sums[name][1] += n
            row[name] = 1000 * n / ms
        for name in ("plain", "draft"):
            t = got[name]["timings"]
            sums[name][0] += t["predicted_ms"]
            sums[name][1] += t["predicted_n"]
            row[name] = 1000 * t["predicted_n"] / t["predicted_ms"]
        same = got["on"]["answer"] == got["off"]["answer"]
        identical += same
        print(f"{i} | {row['off']:.1f} | {row['on']:.1f} | {row['plain']:.1f} | {row['draft']:.1f} | {same}", flush=True)
    print()
    for name, (ms, n) in sums.items():
        print(f"{name}: {n} tokens, {1000 * n / ms:.1f} tokens/s pooled")
    print(f"specrag answers identical with and without drafting: {identical}")


def per_token(a):
    return a["timings"]["decode_ms"] / max(a["tokens"] - 1, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8091")
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--skip", type=int, default=0,
                    help="start after this many questions (held-out prompts for a choice "
                         "tuned on the first ones)")
    ap.add_argument("--passages", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated: off (always measured), model, lookup, both")
    ap.add_argument("--cold", type=int, default=0, help="prompts for the cold-drafter run")
    ap.add_argument("--llama-draft", help="URL of a llama-server with a draft model")
    ap.add_argument("--llama-plain", help="URL of a llama-server without one")
    a = ap.parse_args()
    if a.llama_draft and a.llama_plain:
        llama_compare(a)
        return
    if a.cold:
        cold(a)
        return
    drafts(a)


MODES = ["off", "model", "lookup", "both"]


def drafts(a):
    """Each prompt answered without drafting and with each drafter, in rotating order."""
    modes = ["off"] + [m for m in a.modes.split(",") if m in MODES and m != "off"]
    print("case | prompt tokens | tokens | ms/token off | " + " | ".join(
        f"{m} ratio (accepted/drafted)" for m in modes[1:]) + " | identical")
    sums = {m: {"ms": 0.0, "tok": 0, "drafted": 0, "accepted": 0, "lookup": 0, "same": 0,
                "ratios": []} for m in modes}
    for i, (q, docs) in enumerate(cases(a.cases, a.passages, a.skip)):
        ask(a.url, q, docs, 1, False)
        ask(a.url, q, docs, 2, True, "model")
        k = i % len(modes)
        order = modes[k:] + modes[:k]
        got = {m: ask(a.url, q, docs, a.max_tokens, m != "off", None if m == "off" else m)
               for m in order}
        off = got["off"]
        cells = []
        for m in modes:
            g, sd = got[m], got[m].get("spec_decode") or {}
            s = sums[m]
            s["ms"] += g["timings"]["decode_ms"]
            s["tok"] += g["tokens"] - 1
            s["drafted"] += sd.get("drafted", 0)
            s["accepted"] += sd.get("accepted", 0)
            s["lookup"] += sd.get("lookup_accepted", 0)
            s["same"] += g["answer"] == off["answer"]
            r = per_token(g) / per_token(off)
            s["ratios"].append(r)
            if m != "off":
                cells.append(f"{r:.2f} ({sd.get('accepted', 0)}/{sd.get('drafted', 0)})")
        same = all(got[m]["answer"] == off["answer"] for m in modes)
        print(f"{i} | {off['prompt_tokens']} | {off['tokens']} | {per_token(off):.1f} | "
              + " | ".join(cells) + f" | {same}", flush=True)
    print()
    base = sums["off"]["ms"] / max(sums["off"]["tok"], 1)
    print("mode | decode ms/token pooled | ratio to off | per-case median | acceptance | "
          "accepted by lookup | identical to off")
    for m in modes:
        s = sums[m]
        per = s["ms"] / max(s["tok"], 1)
        acc = s["accepted"] / max(s["drafted"], 1)
        print(f"{m} | {per:.1f} | {per / base:.2f} | {statistics.median(s['ratios']):.2f} | "
              f"{s['accepted']}/{s['drafted']} = {acc:.2f} | {s['lookup']} | "
              f"{s['same']}/{len(s['ratios'])}")


def cold(a):
    print("case | tokens | total ms off | total ms on, cold drafter KV | on, stored | identical")
    for i, (q, docs) in enumerate(cases(a.cases + a.cold, a.passages, a.skip)[a.cases:]):
        ask(a.url, q, docs, 1, False)
        first = ask(a.url, q, docs, a.max_tokens, True)
        off = ask(a.url, q, docs, a.max_tokens, False)
        again = ask(a.url, q, docs, a.max_tokens, True)
        same = first["answer"] == off["answer"] == again["answer"]
        t = lambda x: x["timings"]["total_ms"]
        print(f"{a.cases + i} | {off['tokens']} | {t(off):.0f} | {t(first):.0f} | {t(again):.0f} | {same}", flush=True)


if __name__ == "__main__":
    main()
