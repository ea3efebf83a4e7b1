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

Each line also keeps both answers' top-2 gaps, tokens and runners-up at every token, the
chunk and recomputed token counts, full recompute's times and what the guard reported;
`--records FILE...` prints the summary of earlier runs again, with how well the reused side's
own gaps rank the confident splits it kept (AUC). `--ratio R` asks the default method at
recompute ratio R, `--unguarded-only` with `fidelity: fast` only, and `--full-from FILE` takes
full recompute's answers from an earlier run's records instead of asking again (same server
settings; identity only, no time ratios): a sweep over ratios costs the reused requests alone.
`--records FILE... --replay-horizon H...` replays the guard's phrasing horizon on each
unguarded answer (any token among the first H doubted, later only tokens with a digit or a
capital letter, and also, where the records keep runners-up, tokens whose runner-up has one;
`--look-margin` the margins; `--specrag PATH` tokenizes answers recorded
without their tokens). `--collection NAME` asks over a
collection already served instead (questions without
`context`, e.g. eval/data/repo_docs.jsonl over this repository's docs; `--instruction ''`).

Only the Python standard library is used. Nothing is read outside the paths given.
"""
import argparse
import json
import math
import os
import re
import statistics
import sys
import urllib.error
import urllib.request

from guard_signals import auc, auc_ci, opener, wilson

INSTRUCTION = "Answer the question directly based on the given passages, within 5 words."
NEAR_TIE = 0.15


def share(k, n):
    lo, hi = wilson(k, n)
    pct = 100 * k / n if n else 0.0
    return f"{k}/{n} = {pct:.1f}% [{100 * max(lo, 0.0):.0f}, {100 * min(hi, 1.0):.0f}]"


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
        block = block.rstrip()
        if block.strip():
            title, _, text = block.partition("\n")
            out.append((title.strip(), text.strip() or title.strip()))
    return out


def document(j, title, text, title_apart):
    """A passage as a document: its title as its first line (or as metadata only), none when untitled."""
    if not title:
        return {"id": f"p{j + 1}", "text": text}
    return {"id": f"p{j + 1}", "title": title, "text": text if title_apart else f"{title}\n{text}"}


# What each record keeps of `reuse.guard` (docs/fidelity-guard.md, *The knob*).
GUARD_KEPT = ("min_margin", "margin", "uncertain", "loop_detected", "second_look_gap", "second_look_skipped",
              "second_look_answered", "second_looks", "second_look_tokens", "second_look_ms",
              "withdrawn_tokens", "kept_tokens", "full_prefill_ms")


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


def gaps(response):
    """The top-2 logprob gap at each returned token (None past the end of the alternatives)."""
    out = []
    for t in response.get("logprobs") or []:
        top = t["top_logprobs"]
        out.append(round(top[0]["logprob"] - top[1]["logprob"], 4) if len(top) > 1 else None)
    return out


def report(results, label):
    """The summary: identity, near ties, confident splits, escalations, costs, and how the
    reused side's own top-2 gaps rank the confident splits it kept (AUC, lower gap = doubt)."""
    n = len(results)
    same = sum(r["identical"] for r in results)
    near = sum(r["class"] == "near_tie" for r in results)
    conf = sum(r["class"] == "confident" for r in results)
    esc = [r for r in results if r["escalated"]]
    print(f"questions: {n} ({label})")
    print(f"identical to full recompute: {share(same, n)}")
    print(f"identical or near tie (< {NEAR_TIE} logit): {share(same + near, n)}")
    print(f"confident splits: {share(conf, n)}")
    worst = max((r["total_ratio"] or 0 for r in esc), default=0)
    print(f"escalated: {share(len(esc), n)}; worst escalation {worst:.2f}x")
    looks = [r for r in results if r.get("second_look")]
    if looks:
        answered = sum(bool(r.get("guard", {}).get("second_look_answered")) for r in looks)
        print(f"second looks: {len(looks)} of {n}; answered by the look (parted from the first decode): {answered}")
    timed = [r for r in results if r.get("total_ratio") is not None]
    if timed:
        print(
            f"mean request {statistics.mean(r['total_ratio'] for r in timed):.3f}x, "
            f"median TTFT {statistics.median(r['ttft_ratio'] for r in timed):.3f}x full recompute's"
            + ("" if len(timed) == n else f" ({len(timed)} paired)")
        )
    fast = [r for r in results if "unguarded_class" in r]
    if fast:
        k = sum(r["unguarded_class"] == "identical" for r in fast)
        tie = sum(r["unguarded_class"] == "near_tie" for r in fast)
        print(f"unguarded (fidelity: fast): identical {share(k, len(fast))}, or near tie {share(k + tie, len(fast))}")
    for r in results:
        if r["class"] == "confident":
            reused = f", reused side's {least_gap(r):.2f}" if r.get("default_gaps") else ""
            print(
                f"  confident: {r['id']}: {r['full']!r} | {r['default']!r} "
                f"(token {r['split_at']}, gap {r['full_gap']}{reused}{', escalated' if r['escalated'] else ''})"
            )
    kept = [
        {**r, "differs": r["class"] == "confident", "first": first_gap(r), "least": least_gap(r)}
        for r in results
        if not r["escalated"] and r["class"] != "near_tie" and r.get("default_gaps")
    ]
    if kept and any(r["differs"] for r in kept):
        for name, key in (("first token", "first"), ("smallest, any token", "least")):
            lo, hi = auc_ci(kept, key, higher=False)
            print(
                f"reused side's top-2 gap at the {name} ranks the confident splits it kept: "
                f"AUC {auc(kept, key, higher=False):.2f} [{lo:.2f}, {hi:.2f}] "
                f"({sum(r['differs'] for r in kept)} of {len(kept)} unescalated answers)"
            )


def unguarded_fields(full, fast):
    """The unguarded answer (`fidelity: fast`) beside full recompute's: its class and gaps."""
    split = split_class(full, fast)
    return {
        "unguarded": fast["answer"],
        "unguarded_class": "identical" if split is None else split[2],
        "unguarded_split_at": None if split is None else split[0],
        "unguarded_full_gap": None if split is None or split[1] == math.inf else round(split[1], 4),
        "unguarded_gaps": gaps(fast),
        "unguarded_tokens": [t["token"] for t in fast.get("logprobs") or []],
        "unguarded_runners_up": runners_up(fast),
        "unguarded_ttft_ratio": fast["timings"]["ttft_ms"] / max(full["timings"]["ttft_ms"], 1e-9),
    }


def runners_up(response):
    """The second likeliest token at each returned token (None where none was returned): with
    the chosen tokens, what a near tie was between."""
    out = []
    for t in response.get("logprobs") or []:
        top = t["top_logprobs"]
        out.append(top[1].get("token") if len(top) > 1 else None)
    return out


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


def first_gap(r):
    g = r["default_gaps"]
    return g[0] if g and g[0] is not None else math.inf


def least_gap(r):
    return min((g for g in r["default_gaps"] if g is not None), default=math.inf)


def earlier_fulls(path):
    """Full recompute's responses per question id, rebuilt from records that kept its tokens
    (`full_tokens`): its answer, each token with its top-2 gap, and its time."""
    out = {}
    with opener(path) as f:
        for line in f:
            r = json.loads(line) if line.strip() else None
            if r and r.get("full_tokens") is not None:
                runners = r.get("full_runners_up") or [None] * len(r["full_tokens"])
                out[r["id"]] = {
                    "answer": r["full"],
                    "logprobs": [
                        {
                            "token": t,
                            "top_logprobs": [{"logprob": 0.0, "token": t}]
                            + ([] if g is None else [{"logprob": -g, "token": u}]),
                        }
                        for t, g, u in zip(r["full_tokens"], r["full_gaps"], runners)
                    ],
                    "timings": {"total_ms": r["full_ms"], "ttft_ms": r.get("full_ttft_ms")},
                }
    return out


def measure(a, row, full=None):
    """One question asked as a client asks it: its record (see the module's doc). `full`, an
    earlier full recompute of it, is used instead of asking again; then no time ratio is paired."""
    coll = a.collection or collection_of(row["_id"])
    if not a.collection:
        docs = [document(j, t, x, a.title_apart) for j, (t, x) in enumerate(passages(row["context"]))]
        post(f"{a.url}/documents", {"collection": coll, "documents": docs, "kv": a.kv}, a.timeout)
    ask = {
        "query": f"{row['input'].strip()} {a.instruction}".strip(),
        "collection": coll,
        "top_k": a.top_k,
        "max_tokens": a.max_tokens,
        "logprobs": 2,
    }
    mine = {**ask, **({"recompute_ratio": a.ratio} if a.ratio is not None else {})}
    if a.method:
        mine["method"] = a.method
    paired = full is None
    if paired:
        full = post(f"{a.url}/rag/query", {**ask, "method": "full_recompute"}, a.timeout)
    fast = post(f"{a.url}/rag/query", {**mine, "fidelity": "fast"}, a.timeout) if a.unguarded else None
    reused = fast if a.unguarded_only else post(f"{a.url}/rag/query", mine, a.timeout)
    split = split_class(full, reused)
    guard = reused["reuse"]["guard"]
    # Full recompute's times from earlier records are paired only with --full-times.
    timed = paired or a.full_times
    ratio = lambda key: reused["timings"][key] / max(full["timings"][key] or 0, 1e-9) if timed else None
    return {
        "id": row["_id"],
        "full": full["answer"],
        "default": reused["answer"],
        "method": reused["method"],
        "recompute_ratio": a.ratio,
        "fidelity": "fast" if a.unguarded_only else "default",
        "identical": split is None,
        "split_at": None if split is None else split[0],
        "full_gap": None if split is None or split[1] == math.inf else round(split[1], 4),
        "class": "identical" if split is None else split[2],
        "escalated": guard.get("escalated", False),
        "second_look": guard.get("second_look", False),
        "guard": {k: guard[k] for k in GUARD_KEPT if k in guard},
        "default_gaps": gaps(reused),
        "full_gaps": gaps(full),
        "full_tokens": [t["token"] for t in full.get("logprobs") or []],
        "full_runners_up": runners_up(full),
        "default_tokens": [t["token"] for t in reused.get("logprobs") or []],
        "default_runners_up": runners_up(reused),
        "chunk_tokens": reused["reuse"]["chunk_tokens"],
        "recomputed_tokens": reused["reuse"]["recomputed_tokens"],
        "default_ms": reused["timings"]["total_ms"],
        "default_ttft_ms": reused["timings"]["ttft_ms"],
        "full_ms": full["timings"]["total_ms"],
        "full_ttft_ms": full["timings"]["ttft_ms"],
        "total_ratio": ratio("total_ms"),
        "ttft_ratio": ratio("ttft_ms"),
        **(unguarded_fields(full, fast) if fast and not a.unguarded_only else {}),
    }


def unguarded_answers(r, tokenize):
    """An unguarded answer of a record: (its top-2 gaps, its tokens where known, its class,
    where it split, each token's rival where known), from the `--unguarded` fields or from a
    `--unguarded-only` record's own; None for neither. Tokens: as recorded; else full
    recompute's where the answer is identical; else `tokenize(answer)` where given (None:
    unknown). Rivals (the runner-up of each token's row): as recorded, else None."""
    if "unguarded_class" in r:
        gaps, cls, at, text, toks = (r["unguarded_gaps"], r["unguarded_class"], r.get("unguarded_split_at"),
                                     r["unguarded"], r.get("unguarded_tokens"))
        rivals = r.get("unguarded_runners_up")
    elif r.get("fidelity") == "fast":
        gaps, cls, at, text, toks = r["default_gaps"], r["class"], r.get("split_at"), r["default"], r.get("default_tokens")
        rivals = r.get("default_runners_up")
    else:
        return None
    if toks is None and cls == "identical":
        toks = r.get("full_tokens")
    if toks is None and tokenize:
        toks = tokenize(text)
    return gaps, toks, cls, at, rivals


def specrag_tokenizer(exe):
    """`specrag tokenize TEXT` as a function: the token strings of TEXT."""
    import subprocess

    def tokenize(text):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the models are
        out = subprocess.run([exe, "tokenize", "--", text], capture_output=True, text=True, check=True,
                             cwd=root).stdout
        return [json.loads(m.group(1)) for m in re.finditer(r'^\s*\d+\s+\[\d+, \d+\)\s+(".*")$', out, re.M)]

    return tokenize


def holds_substance(token):
    """As the guard's `holds_substance`: a digit or an uppercase letter in the token."""
    return any(c.isnumeric() or c.isupper() for c in token or "")


def replay_horizon(paths, margins, horizons, tokenize=None):
    """The guard's phrasing horizon replayed from unguarded answers (no model runs): a request
    escalates where a token has a top-2 gap under the margin and is among its first H or holds
    a digit or a capital letter, and an escalated answer counts as full recompute's (no look:
    the looks' rescues are not replayed). A token not known counts as holding one (a doubt
    more, never an answer less). Per file, each (margin, H): answers identical or split at a
    near tie, and escalations; then where the confident splits stand in the answer."""
    for path in paths:
        with opener(path) as f:
            rows = [u for u in (unguarded_answers(json.loads(line), tokenize) for line in f if line.strip()) if u]
        rivaled = sum(rv is not None for *_, rv in rows)
        if not rows:
            print(f"{path}: no unguarded answers")
            continue
        n = len(rows)
        at = sorted(split for _, _, c, split, _ in rows if c == "confident")
        print(f"{path}: {n} unguarded answers ({rivaled} with rivals), confident splits at tokens {at}")

        def watched(i, toks, rivals, h, by_rival):
            if i < h or toks is None or i >= len(toks) or holds_substance(toks[i]):
                return True
            return by_rival and rivals is not None and i < len(rivals) and holds_substance(rivals[i])

        for margin in margins:
            for h in horizons:
                for by_rival in (False, True):
                    doubted = [
                        any(g is not None and g < margin and watched(i, toks, rv, h, by_rival) for i, g in enumerate(gs))
                        for gs, toks, _, _, rv in rows
                    ]
                    ok = sum(d or c != "confident" for d, (_, _, c, _, _) in zip(doubted, rows))
                    print(
                        f"  margin {margin} phrasing horizon {h}, {'a token or its rival' if by_rival else 'the token'}"
                        f" watched: identical or near tie {share(ok, n)}; escalated {share(sum(doubted), n)}"
                    )


def replay_look(low_path, high_path, margins, keeps):
    """A look that answers, replayed from two unguarded runs over the same questions (no
    model runs): a question whose answer at the lower ratio (`low_path`) has a token chosen by
    a top-2 gap under the margin is answered as at the higher ratio (`high_path`), unless a
    token there is chosen by less than `keep`, where it escalates (full recompute's answer)."""

    def load(path):
        with opener(path) as f:
            return {r["id"]: r for r in (json.loads(line) for line in f if line.strip())}

    low, high = load(low_path), load(high_path)
    ids = [i for i in low if i in high]
    least = lambda r: min((g for g in r["default_gaps"] if g is not None), default=math.inf)  # noqa: E731
    print(f"{len(ids)} questions: {low_path} looking at {high_path}")
    for margin in margins:
        for keep in keeps:
            same = near = looks = esc = 0
            for i in ids:
                r = low[i]
                if least(r) < margin:
                    looks += 1
                    r = high[i]
                    if least(r) < keep:
                        esc += 1
                        same += 1
                        continue
                same += r["identical"]
                near += r["class"] == "near_tie"
            n = len(ids)
            print(
                f"margin {margin} keep {keep}: identical {share(same, n)}, or near tie "
                f"{share(same + near, n)}; looks {looks}, escalated {share(esc, n)}"
            )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--data", help="LongBench-format JSONL")
    ap.add_argument(
        "--records", nargs="+", help="print the summary of records an earlier run wrote (--out), asking nothing"
    )
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
    ap.add_argument(
        "--unguarded",
        action="store_true",
        help="also ask the default method unguarded (`fidelity: fast`) and class its split too",
    )
    ap.add_argument(
        "--unguarded-only",
        action="store_true",
        help="ask the default method unguarded (`fidelity: fast`) only, as its record's answer",
    )
    ap.add_argument("--ratio", type=float, help="`recompute_ratio` of the default method's requests")
    ap.add_argument(
        "--method",
        help="ask this method in the default method's place (its record's `method` says which)",
    )
    ap.add_argument(
        "--full-from",
        help="records of an earlier run (kept `full_tokens`): full recompute's answers taken from "
        "there, not asked again (identity only; no time ratios)",
    )
    ap.add_argument(
        "--full-times",
        action="store_true",
        help="with --full-from, pair the time ratios with the earlier run's full recompute times "
        "(the same machine otherwise idle: a comparison across runs, noisier than one run's)",
    )
    ap.add_argument("--ids", nargs="+", help="only the questions of the slice with these `_id`s")
    ap.add_argument(
        "--collection",
        help="ask over this collection as it stands, ingesting nothing (the questions need no "
        "`context`): eval/data/repo_docs.jsonl over this repository's docs, ingested with "
        "`specrag ingest README.md ARCHITECTURE.md docs/ --collection docs`",
    )
    ap.add_argument("--out", help="one JSON line per question")
    ap.add_argument(
        "--kv",
        choices=["eager", "lazy"],
        default="eager",
        help="how the passages are ingested (`lazy`: a chunk's KV is computed at its first "
        "retrieval, the same rows, for half the ingestion with top 5 of 10; a first run's "
        "request times then hold that precompute, so time a second run)",
    )
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument(
        "--replay-look",
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="replay a look that answers from two unguarded runs' records (--unguarded-only at two "
        "ratios), at each --look-margin and --look-keep, asking nothing",
    )
    ap.add_argument(
        "--replay-horizon",
        type=int,
        nargs="+",
        metavar="H",
        help="with --records: replay the guard doubting any token among each unguarded answer's "
        "first H and, after them, only tokens with a digit or a capital letter, at each "
        "--look-margin, asking nothing",
    )
    ap.add_argument(
        "--specrag",
        help="with --replay-horizon: the specrag binary, to tokenize answers whose records lack "
        "their tokens (`specrag tokenize`)",
    )
    ap.add_argument("--look-margin", type=float, nargs="+", default=[0.3, 0.5, 0.75])
    ap.add_argument("--look-keep", type=float, nargs="+", default=[0.0, 0.05, 0.1])
    a = ap.parse_args()
    if a.replay_look:
        replay_look(*a.replay_look, a.look_margin, a.look_keep)
        return
    a.unguarded = a.unguarded or a.unguarded_only
    if a.replay_horizon:
        if not a.records:
            ap.error("--replay-horizon replays --records")
        replay_horizon(a.records, a.look_margin, a.replay_horizon, a.specrag and specrag_tokenizer(a.specrag))
        return
    if a.records:
        for path in a.records:
            with opener(path) as f:
                report([json.loads(line) for line in f if line.strip()], path)
        return
    if not a.data:
        sys.exit("--data (a LongBench-format JSONL) or --records is required")
    with open(a.data) as f:
        rows = [json.loads(line) for line in f if line.strip()][a.offset : a.offset + a.limit]
    rows = [r for r in rows if not a.ids or r["_id"] in a.ids]
    if not rows:
        sys.exit("no question in that slice")
    fulls = earlier_fulls(a.full_from) if a.full_from else {}
    out = open(a.out, "w") if a.out else None
    results = []
    for i, row in enumerate(rows):
        r = measure(a, row, fulls.get(row["_id"]))
        results.append(r)
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()
        print(
            f"[{i + 1}/{len(rows)}] {r['class']:9} esc={int(r['escalated'])} "
            f"total {fmt(r['total_ratio'])} ttft {fmt(r['ttft_ratio'])}  {r['full'][:40]!r} | {r['default'][:40]!r}",
            file=sys.stderr,
            flush=True,
        )
    report(results, f"{a.data}, {a.offset}..{a.offset + len(results)}")


if __name__ == "__main__":
    main()
