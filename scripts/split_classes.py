#!/usr/bin/env python3
"""Identity, near-tie splits and confident splits of the served default against full
recompute, measured as a client measures them: over HTTP, from two responses with logprobs.

    python3 scripts/split_classes.py --url http://127.0.0.1:8080 \
        --data eval/data/2wikimqa.jsonl --offset 0 --limit 40 --out splits.jsonl

For each question of a LongBench-format JSONL (`input`, `context` of "Passage N:\\n<title>\\n
<text>" blocks, `_id`): its passages are ingested, one document each with its title as the
first line (as LongBench gives them; `--title-apart` sends the title as metadata only), into
a collection of its own (`POST /documents`); the question, with the instruction appended, is asked with
`method: full_recompute` and with the server's default method (`POST /rag/query`, top 5
retrieved, 16 tokens, `logprobs: 2`). Two answers that differ split at their first differing
token; the split is a near tie when full recompute's own gap between its first two
alternatives there is under 0.15 logit (the decided fidelity target, shared/DESIGN.md), and
confident otherwise. Prints identity, identity-or-near-tie and the confident splits with
Wilson 95% intervals, the escalations, the mean request and median TTFT ratios, and writes
one line per question to --out.

Only the Python standard library is used. Nothing is read outside the paths given.
"""
import argparse
import json
import math
import re
import statistics
import sys
import urllib.error
import urllib.request

from guard_signals import wilson

INSTRUCTION = "Answer the question directly based on the given passages, within 5 words."
NEAR_TIE = 0.15


def share(k, n):
    lo, hi = wilson(k, n)
    pct = 100 * k / n if n else 0.0
    return f"{k}/{n} = {pct:.1f}% [{100 * lo:.0f}, {100 * hi:.0f}]"


def post(url, body, timeout):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        sys.exit(f"{url}: {e.code} {e.read().decode(errors='replace')[:400]}")


def passages(context):
    """The passages of a LongBench context: (title, text) per "Passage N:" block."""
    out = []
    for block in re.split(r"(?m)^Passage \d+:\n", context):
        block = block.strip()
        if block:
            title, _, text = block.partition("\n")
            out.append((title.strip(), text.strip() or title.strip()))
    return out


def collection_of(qid):
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", qid)[:120]
    return f"split-{name}"


def split_class(full, reused):
    """None when the answers are identical; else (index, full's top-2 gap there, class)."""
    if full["answer"] == reused["answer"]:
        return None
    a, b = full.get("logprobs") or [], reused.get("logprobs") or []
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x["token"] != y["token"]), min(len(a), len(b)))
    if at >= len(a):
        # Full recompute's answer is a prefix of the other: it ended where the other went on.
        return (at, math.inf, "confident")
    top = a[at]["top_logprobs"]
    gap = top[0]["logprob"] - top[1]["logprob"] if len(top) > 1 else math.inf
    return (at, gap, "near_tie" if gap < NEAR_TIE else "confident")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--data", required=True, help="LongBench-format JSONL")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--instruction", default=INSTRUCTION)
    ap.add_argument(
        "--title-apart",
        action="store_true",
        help="send each passage's title only as the document's title, not as its first line",
    )
    ap.add_argument("--out", help="one JSON line per question")
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    with open(a.data) as f:
        rows = [json.loads(line) for line in f if line.strip()][a.offset : a.offset + a.limit]
    if not rows:
        sys.exit("no question in that slice")
    out = open(a.out, "w") if a.out else None
    results = []
    for i, row in enumerate(rows):
        coll = collection_of(row["_id"])
        docs = [
            {"id": f"p{j + 1}", "title": t, "text": x if a.title_apart else f"{t}\n{x}"}
            for j, (t, x) in enumerate(passages(row["context"]))
        ]
        post(f"{a.url}/documents", {"collection": coll, "documents": docs}, a.timeout)
        ask = {
            "query": f"{row['input'].strip()} {a.instruction}",
            "collection": coll,
            "top_k": a.top_k,
            "max_tokens": a.max_tokens,
            "logprobs": 2,
        }
        full = post(f"{a.url}/rag/query", {**ask, "method": "full_recompute"}, a.timeout)
        reused = post(f"{a.url}/rag/query", ask, a.timeout)
        split = split_class(full, reused)
        guard = reused["reuse"]["guard"]
        r = {
            "id": row["_id"],
            "full": full["answer"],
            "default": reused["answer"],
            "method": reused["method"],
            "identical": split is None,
            "split_at": None if split is None else split[0],
            "full_gap": None if split is None or split[1] == math.inf else round(split[1], 4),
            "class": "identical" if split is None else split[2],
            "escalated": guard.get("escalated", False),
            "second_look": guard.get("second_look", False),
            "total_ratio": reused["timings"]["total_ms"] / max(full["timings"]["total_ms"], 1e-9),
            "ttft_ratio": reused["timings"]["ttft_ms"] / max(full["timings"]["ttft_ms"], 1e-9),
        }
        results.append(r)
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()
        print(
            f"[{i + 1}/{len(rows)}] {r['class']:9} esc={int(r['escalated'])} "
            f"total {r['total_ratio']:.2f} ttft {r['ttft_ratio']:.2f}  {r['full'][:40]!r} | {r['default'][:40]!r}",
            file=sys.stderr,
            flush=True,
        )
    n = len(results)
    same = sum(r["identical"] for r in results)
    near = sum(r["class"] == "near_tie" for r in results)
    conf = sum(r["class"] == "confident" for r in results)
    esc = [r for r in results if r["escalated"]]
    print(f"questions: {n} ({a.data}, {a.offset}..{a.offset + n})")
    print(f"identical to full recompute: {share(same, n)}")
    print(f"identical or near tie (< {NEAR_TIE} logit): {share(same + near, n)}")
    print(f"confident splits: {share(conf, n)}")
    print(f"escalated: {share(len(esc), n)}; worst escalation {max((r['total_ratio'] for r in esc), default=0):.2f}x")
    print(
        f"mean request {statistics.mean(r['total_ratio'] for r in results):.3f}x, "
        f"median TTFT {statistics.median(r['ttft_ratio'] for r in results):.3f}x full recompute's"
    )
    for r in results:
        if r["class"] == "confident":
            print(f"  confident: {r['id']}: {r['full']!r} | {r['default']!r} (token {r['split_at']}, gap {r['full_gap']})")


if __name__ == "__main__":
    main()
