#!/usr/bin/env python3
"""Cascades of reuse approximations under the fidelity guard, simulated from study records.

Reads `specrag-eval --study` records whose cases each hold `full_recompute`, `full_reuse`
(ρ 0), `target_probe@0.25` and `target_probe@0.50` rows with every answer token's top-2 logit
gap (`margins`), e.g. guard-rho-oracle.jsonl.gz and guard-signals-held-out.jsonl.gz
(in git: `git show 8a44089:eval/study/NAME`). A cascade answers from its first stage when that
stage's smallest gap over the answer is at least the stage's margin, and otherwise moves on
at the first token (paying that stage's time to first token) to the next stage, and after
the last to full recompute, whose answer it then is. Printed per cascade: identity with full
recompute (Wilson 95%), how many requests reached full recompute, the mean request time and
median time to first token over full recompute's, and the worst request that reached it.

    python3 scripts/guard_cascade.py RECORDS.jsonl[.gz] [MORE.jsonl[.gz] ...]
"""
import statistics
import sys

from guard_signals import read_cases, wilson

STAGES = ("full_reuse", "target_probe@0.25", "target_probe@0.50")
CASCADES = [
    ((STAGES[0],), (m,)) for m in (0.25, 0.5, 0.75, 1.0)
] + [((STAGES[1],), (m,)) for m in (0.25, 0.5)] + [
    ((STAGES[0], STAGES[1]), (m1, m2)) for m1 in (0.5, 1.0, 2.0) for m2 in (0.25, 0.5)
] + [((STAGES[0], STAGES[2]), (m1, m2)) for m1 in (1.0, 2.0) for m2 in (0.5, 1.0)]


def load(paths):
    """Cases (file, dataset, case) -> {label: row} holding every stage and full recompute."""
    out = read_cases(paths, by_file=True)
    need = ("full_recompute",) + STAGES
    return [c for c in out.values() if all(k in c and (k == need[0] or c[k].get("margins")) for k in need)]


def simulate(cases, stages, margins):
    identical = to_full = 0
    totals, ttfts, worst = [], [], 0.0
    for c in cases:
        full = c["full_recompute"]
        full_total, full_ttft = full["timings"]["total_ms"], full["ttft_ms"]
        spent = 0.0
        for label, m in zip(stages, margins):
            r = c[label]
            if min(r["margins"]) >= m:
                identical += r["identical"]
                totals.append((spent + r["timings"]["total_ms"]) / full_total)
                ttfts.append((spent + r["ttft_ms"]) / full_ttft)
                break
            spent += r["ttft_ms"]
        else:
            identical += 1
            to_full += 1
            totals.append((spent + full_total) / full_total)
            ttfts.append((spent + full_ttft) / full_ttft)
            worst = max(worst, totals[-1])
    return identical, to_full, statistics.mean(totals), statistics.median(ttfts), worst


def main():
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cases = load(sys.argv[1:])
    if not cases:
        sys.exit("no case holds full_recompute and every stage with margins")
    n = len(cases)
    print(f"{n} cases\n")
    print("| cascade (margins) | identical | reached full recompute | mean request ÷ full | median TTFT ÷ full | worst that reached it |")
    print("|---|---:|---:|---:|---:|---:|")
    for stages, margins in CASCADES:
        k, full, mean, ttft, worst = simulate(cases, stages, margins)
        lo, hi = wilson(k, n)
        name = " → ".join(f"{s} ({m})" for s, m in zip(stages, margins))
        print(f"| {name} | {k}/{n} ({100*k/n:.0f}% [{100*lo:.0f}, {100*hi:.0f}]) | {100*full/n:.0f}% | {mean:.2f} | {ttft:.2f} | {worst:.2f} |")


if __name__ == "__main__":
    main()
