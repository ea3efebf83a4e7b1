#!/usr/bin/env python3
"""Which per-request signals predict that reuse changes the answer, from study records.

Reads `specrag-eval --study` records holding, per case, `full_recompute`, `target_probe@0.25`
(the default, unguarded) and, where present, `full_reuse` (ρ 0) and `target_probe@0.50`.
Rows written with the blend's signals (`signals`: the recomputed rows' K/V deviation, the
probe's uncovered attention, the first token's top choices) add the free signals.

For each signal: its AUC against "the default's answer differs from full recompute's" (with
a bootstrap 95% interval), per dataset and pooled; then, for the guard policies below, how
often each escalates, the identity with full recompute after escalating (Wilson 95%), and
what it costs against full recompute on the same cases (median time to first token, mean
request time), charging an escalation at the i-th token the reused prefill, i tokens of
reused decoding and full recompute's whole request.

    python3 scripts/guard_signals.py [--label L] TUNE.jsonl[.gz][,MORE...] [HELD_OUT...]

With a second file the combined policy's threshold is chosen on the first and reported on
both (held-out apart). `--label` names the default's rows (`target_probe@0.25` unless
given); files joined by commas are read as one, so `full_reuse` rows of one run can join the
default's rows of another over the same prompts.
"""
import collections
import gzip
import json
import math
import random
import statistics
import sys


def wilson(k, n, z=1.96):
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def opener(path):
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def read_cases(paths, by_file=False):
    """Every record of `paths` by case: (dataset, case) -> {label: row}, the key led by the
    file's path when `by_file` (otherwise a later file's row replaces an earlier one's)."""
    out = {}
    for path in paths:
        with opener(path) as f:
            for line in f:
                r = json.loads(line)
                key = (r["dataset"], r["case"])
                out.setdefault((path,) + key if by_file else key, {})[r["label"]] = r
    return out


def top_dist(sig):
    """The first token's top choices as {id: probability}."""
    return {i: math.exp(lp) for i, lp in sig["first_top"]}


def logit_gap(sig):
    """The first token's top-2 logit gap (the log-probability gap of the two likeliest)."""
    lps = sorted((lp for _, lp in sig["first_top"]), reverse=True)
    return lps[0] - lps[1] if len(lps) > 1 else math.inf


def pair_move(blend, r0):
    """How far the blend moved its own top-2 logit difference from ρ 0's (the probe's view):
    |(a - b) at ρ 0.25 - (a - b) at ρ 0|, a and b the blend's two likeliest first tokens (a
    token outside ρ 0's top choices counted at its least likely one)."""
    (a, la), (b, lb) = blend["first_top"][0], blend["first_top"][1]
    z = dict((i, lp) for i, lp in r0["first_top"])
    floor = min(z.values())
    return abs((la - lb) - (z.get(a, floor) - z.get(b, floor)))


def tv(p, q):
    """Total variation between two top-k distributions (mass outside both counted once)."""
    ids = set(p) | set(q)
    inside = sum(abs(p.get(i, 0.0) - q.get(i, 0.0)) for i in ids)
    outside = abs((1 - sum(p.values())) - (1 - sum(q.values())))
    return 0.5 * (inside + outside)


LABEL = "target_probe@0.25"


def cases(path):
    by = collections.defaultdict(dict)
    for part in path.split(","):
        with opener(part) as f:
            for line in f:
                r = json.loads(line)
                by[(r["dataset"], r["case"])].setdefault(r["label"], r)
    out = []
    for (ds, case), d in sorted(by.items()):
        if "full_recompute" not in d or LABEL not in d:
            continue
        full, tp = d["full_recompute"], d[LABEL]
        margins = tp.get("margins") or []
        row = {
            "dataset": ds,
            "case": case,
            "differs": tp["answer"].strip() != full["answer"].strip(),
            "min_gap": min(margins) if margins else math.inf,
            "first_gap": margins[0] if margins else math.inf,
            "gaps": margins,
            "full_ttft": full["timings"]["ttft_ms"],
            "full_total": full["timings"]["total_ms"],
            "tp_ttft": tp["timings"]["ttft_ms"],
            "tp_total": tp["timings"]["total_ms"],
        }
        if "target_probe@0.50" in d:
            row["differs_r05"] = d["target_probe@0.50"]["answer"].strip() != tp["answer"].strip()
        if "full_reuse" in d:
            row["differs_r0"] = d["full_reuse"]["answer"].strip() != tp["answer"].strip()
        split = tp.get("split") or {}
        row["confident"] = row["differs"] and split.get("gap", math.inf) >= 0.15
        s = tp.get("signals")
        if s and "copy" in s:
            # Where the answer's first word is found in the chunks, and how much of the KV
            # around it was recomputed; an answer copying nothing counts as fully fresh.
            c = s.get("copy")
            row["copy_found"] = c is not None
            row["copy_near_max"] = c["near_max"] if c else 1.0
            row["copy_near_min"] = c["near_min"] if c else 1.0
            row["copy_chunk_share"] = c["chunk_share"] if c else 1.0
            row["copy_chunks"] = c["chunks"] if c else 0
        if s:
            row["dev_k"], row["dev_v"], row["uncovered"] = s["deviation_k"], s["deviation_v"], s["uncovered"]
            p = top_dist(s)
            row["first_p"] = max(p.values())
            r0 = d.get("full_reuse", {}).get("signals")
            if r0:
                q = top_dist(r0)
                row["tv_r0"] = tv(q, p)
                row["top1_r0_differs"] = max(q, key=q.get) != max(p, key=p.get)
                row["gap_shift"] = abs(logit_gap(s) - logit_gap(r0))
                row["pair_move"] = pair_move(s, r0)
        out.append(row)
    return out


# Signals as (name, score, higher means riskier).
SCORES = [
    ("min gap over the answer (the guard's)", "min_gap", False),
    ("first token's gap", "first_gap", False),
    ("first token's probability", "first_p", False),
    ("K deviation of recomputed rows", "dev_k", True),
    ("V deviation of recomputed rows", "dev_v", True),
    ("probe attention left uncovered", "uncovered", True),
    ("first-token TV distance, ρ 0 vs ρ 0.25", "tv_r0", True),
    ("first token's top choice differs, ρ 0 vs ρ 0.25", "top1_r0_differs", True),
    ("first token's gap moved, ρ 0 to ρ 0.25", "gap_shift", True),
    ("blend's top-2 difference moved from ρ 0's", "pair_move", True),
    ("answer differs from ρ 0's", "differs_r0", True),
    ("answer differs from ρ 0.5's", "differs_r05", True),
    ("answer's first word found in a chunk", "copy_found", True),
    ("recomputed share near its best-recomputed occurrence", "copy_near_max", False),
    ("recomputed share near its least-recomputed occurrence", "copy_near_min", False),
    ("recomputed share of the chunk it is copied from", "copy_chunk_share", False),
    ("chunks holding the answer's first word", "copy_chunks", True),
]


def auc(rows, key, higher, target="differs"):
    pos = [r[key] for r in rows if r[target]]
    neg = [r[key] for r in rows if not r["differs"]]
    if not pos or not neg:
        return float("nan")
    sign = 1 if higher else -1
    s = 0.0
    for a in pos:
        for b in neg:
            x, y = sign * float(a), sign * float(b)
            s += 1.0 if x > y else 0.5 if x == y else 0.0
    return s / (len(pos) * len(neg))


def auc_ci(rows, key, higher, resamples=1000, seed=7, target="differs"):
    rng = random.Random(seed)
    vals = []
    for _ in range(resamples):
        sample = [rows[rng.randrange(len(rows))] for _ in rows]
        a = auc(sample, key, higher, target)
        if not math.isnan(a):
            vals.append(a)
    vals.sort()
    if not vals:
        return (float("nan"), float("nan"))
    return (vals[int(0.025 * len(vals))], vals[int(0.975 * len(vals)) - 1])


def signals_table(name, rows):
    n, differ = len(rows), sum(r["differs"] for r in rows)
    sure = sum(r["confident"] for r in rows)
    print(f"\n{name}: {n} cases, {differ} default answers differ from full recompute "
          f"({sure} confident splits, full recompute's gap >= 0.15 where recorded)")
    print("  AUC: differing against identical | confident splits against identical")
    for label, key, higher in SCORES:
        if any(key not in r for r in rows):
            continue
        a = auc(rows, key, higher)
        lo, hi = auc_ci(rows, key, higher)
        c = auc(rows, key, higher, "confident")
        clo, chi = auc_ci(rows, key, higher, target="confident")
        print(f"  AUC {a:5.2f} [{lo:4.2f}, {hi:4.2f}] | {c:5.2f} [{clo:4.2f}, {chi:4.2f}]  {label}")


def cost(r, escalate_at):
    """(ttft, total) of a case when the guard escalates before token `escalate_at` (None: never)."""
    if escalate_at is None:
        return r["tp_ttft"], r["tp_total"]
    steps = max(len(r["gaps"]), 1)
    per_token = max(r["tp_total"] - r["tp_ttft"], 0.0) / steps
    spent = r["tp_ttft"] + escalate_at * per_token
    ttft = r["tp_ttft"] if escalate_at > 0 else spent + r["full_ttft"]
    return ttft, spent + r["full_total"]


def policy_table(name, rows, policies):
    n = len(rows)
    print(f"\n{name}: {n} cases")
    print(f"  {'policy':48s} {'esc.':>5s} {'identical':>22s} {'TTFT÷full':>9s} {'req÷full':>8s} {'worst esc.÷full':>15s}")
    for label, decide in policies:
        ident, esc, ttfts, reqs, worst = 0, 0, [], [], 0.0
        for r in rows:
            at = decide(r)
            if at is not None:
                esc += 1
            ident += 1 if (at is not None or not r["differs"]) else 0
            t, total = cost(r, at)
            ttfts.append(t / r["full_ttft"])
            reqs.append(total / r["full_total"])
            if at is not None:
                worst = max(worst, total / r["full_total"])
        lo, hi = wilson(ident, n)
        print(f"  {label:48s} {esc / n:5.0%} {ident / n:6.1%} [{lo:5.1%}, {hi:5.1%}] "
              f"{statistics.median(ttfts):9.2f} {sum(reqs) / n:8.2f} {worst:15.2f}")


def first_doubt(margin):
    def decide(r):
        return next((i for i, g in enumerate(r["gaps"]) if g < margin), None)
    return decide


def at_first(pred):
    return lambda r: 0 if pred(r) else None


def either(a, b):
    def decide(r):
        x, y = a(r), b(r)
        return x if y is None else y if x is None else min(x, y)
    return decide


def policies(rows):
    out = [("never (fast)", lambda r: None)]
    for m in (0.25, 0.5, 1.0):
        out.append((f"gap < {m} on any token (balanced at {m})", first_doubt(m)))
    for t in (0.5, 0.75, 1.1):
        out.append((f"first token's gap < {t} only", at_first(lambda r, t=t: r["first_gap"] < t)))
    out.append(("gap < 0.5, or < 1.1 at the first token",
                either(first_doubt(0.5), at_first(lambda r: r["first_gap"] < 1.1))))
    if all("differs_r05" in r for r in rows):
        out.append(("ρ 0.5 answers differently (oracle of cost)", at_first(lambda r: r["differs_r05"])))
    if all("tv_r0" in r for r in rows):
        for t in (0.1, 0.2, 0.3):
            out.append((f"TV(ρ0, ρ0.25) > {t} at token 1", at_first(lambda r, t=t: r["tv_r0"] > t)))
            out.append((f"gap < 0.5 or TV > {t}", either(first_doubt(0.5), at_first(lambda r, t=t: r["tv_r0"] > t))))
    if all("uncovered" in r for r in rows):
        for t in (0.3, 0.4, 0.5):
            out.append((f"uncovered > {t} at token 1", at_first(lambda r, t=t: r["uncovered"] > t)))
    if all("copy_near_max" in r for r in rows):
        # Known once the answer's word is out (its first tokens): charged as at token 1.
        for t in (0.1, 0.25, 0.5):
            stale = lambda r, t=t: r["copy_found"] and r["copy_near_max"] < t
            out.append((f"copied word's KV fresh < {t} (token 1)", at_first(stale)))
            out.append((f"gap < 0.5 or copied word's KV fresh < {t}", either(first_doubt(0.5), at_first(stale))))
    if all("dev_k" in r for r in rows):
        ks = sorted(r["dev_k"] for r in rows)
        t = ks[int(0.75 * len(ks))]
        out.append((f"K deviation > {t:.3f} (top quarter) at token 1", at_first(lambda r, t=t: r["dev_k"] > t)))
    return out


def main():
    global LABEL
    args = sys.argv[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if len(args) > 1 and args[0] == "--label":
        LABEL, args = args[1], args[2:]
    if not args:
        sys.exit(__doc__)
    tune = cases(args[0])
    sets = [("tuning", tune)]
    if len(args) > 1:
        sets.append(("held out", cases(args[1])))
    for what, rows in sets:
        for ds in sorted({r["dataset"] for r in rows}):
            signals_table(f"{what}, {ds}", [r for r in rows if r["dataset"] == ds])
        signals_table(f"{what}, pooled", rows)
        policy_table(f"{what}, pooled", rows, policies(rows))


if __name__ == "__main__":
    main()
