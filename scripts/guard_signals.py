#!/usr/bin/env python3
"""Which per-request signals predict that reuse changes the answer, from study records.

Reads a `specrag-eval --study` records file holding, per case, `full_recompute`,
`target_probe@0.25` (the default, unguarded) and, where present, `full_reuse` and
`target_probe@0.50`. For each signal a guard could compute (the smallest top-2 logit gap of the
default's answer, the default's answer against the answer at another ρ), prints how often it
would fire, how many of the answers that differ from full recompute it catches, its false
alarms, and the identity with full recompute after escalating where it fires (Wilson 95%),
per dataset and over all.

    python3 scripts/guard_signals.py eval/study/guard-rho-oracle.jsonl.gz
"""
import collections
import gzip
import json
import math
import sys


def wilson(k, n, z=1.96):
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def cases(path):
    by = collections.defaultdict(dict)
    with gzip.open(path, "rt") as f:
        for line in f:
            r = json.loads(line)
            by[(r["dataset"], r["case"])][r["label"]] = r
    out = []
    for (ds, _), d in sorted(by.items()):
        if "full_recompute" not in d or "target_probe@0.25" not in d:
            continue
        full = d["full_recompute"]["answer"].strip()
        tp = d["target_probe@0.25"]
        row = {
            "dataset": ds,
            "differs": tp["answer"].strip() != full,
            "min_gap": min(tp["margins"]) if tp.get("margins") else math.inf,
        }
        for other in ("full_reuse", "target_probe@0.50"):
            if other in d:
                row[other] = d[other]["answer"].strip() != tp["answer"].strip()
        out.append(row)
    return out


SIGNALS = [
    ("min gap < 0.5 (the default guard)", lambda r: r["min_gap"] < 0.5),
    ("min gap < 0.25", lambda r: r["min_gap"] < 0.25),
    ("answer differs from full_reuse's (ρ 0)", lambda r: r.get("full_reuse")),
    ("answer differs from ρ 0.5's", lambda r: r.get("target_probe@0.50")),
    ("min gap < 0.5 or differs from ρ 0.5's",
     lambda r: r["min_gap"] < 0.5 or r.get("target_probe@0.50")),
]


def report(name, rows):
    n, differ = len(rows), sum(r["differs"] for r in rows)
    print(f"{name}: {n} cases, {differ} answers differ from full recompute unguarded")
    for label, fires in SIGNALS:
        if any(fires(r) is None for r in rows):
            continue
        fired = [r for r in rows if fires(r)]
        caught = sum(r["differs"] for r in fired)
        left = differ - caught
        lo, hi = wilson(n - left, n)
        print(f"  {label:42s} fires {len(fired):3d} ({len(fired) / n:4.0%}), catches "
              f"{caught}/{differ}, false alarms {len(fired) - caught:3d}, identity after "
              f"{(n - left) / n:5.1%} [{lo:.1%}, {hi:.1%}]")


def main():
    rows = cases(sys.argv[1])
    for ds in sorted({r["dataset"] for r in rows}):
        report(ds, [r for r in rows if r["dataset"] == ds])
    report("all", rows)


if __name__ == "__main__":
    main()
