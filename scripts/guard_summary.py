#!/usr/bin/env python3
"""What the fidelity guard did, summarized from study records where it ran for real.

Reads `specrag-eval --study` records (jsonl, or .jsonl.gz) whose cases hold a
`full_recompute` row and rows of other configurations, typically
`target_probe_shift@0.25:balanced` (the guard running as served). Per configuration, per
dataset and pooled: the share of requests escalated, identity with full recompute's answer
(Wilson 95%), identity up to a near tie of full recompute's own (the answer leaves full
recompute's only where full recompute's logit for its token was less than NEAR_TIE above the
other answer's: the bound the engine's fixtures and GPU parity checks hold kernels to; rows
record it as `split`), the median time to first token and the mean request time over full
recompute's, the escalated requests' median and worst time over full recompute's, and the
second looks the guard took (`guard.second_look`), how many kept their answer and what those
requests cost over full recompute's. Then
every answer that differs: where it splits, full recompute's gap there, whether the guard
escalated, its smallest top-2 gap and, after a second look, the gap that look chose the
doubted token by (`guard.second_look_gap`, where the records have it). Last, identity split by whether full recompute's own
answer is right, and each configuration's right answers against full recompute's on the same
cases (paired: cases only it gets right / only full recompute does, with a bootstrap 95%
interval of the difference in points). Right: the answer contains a gold answer (the study's
`correct`) or has a token F1 of at least RIGHT_F1 with one (the study's `f1`), so that a bare
"64" for the gold "64 passages" counts.

    python3 scripts/guard_summary.py RECORDS.jsonl[.gz] [MORE.jsonl[.gz] ...]
"""
import random
import statistics
import sys

from guard_signals import read_cases, wilson

NEAR_TIE = 0.15
RIGHT_F1 = 0.5


def near_tie(r):
    s = r.get("split")
    return r["identical"] or (s is not None and s["gap"] < NEAR_TIE)


def escalated(r):
    return bool((r.get("guard") or {}).get("escalated"))


def line(label, ds, pairs):
    n = len(pairs)
    ident = sum(r["identical"] for r, _ in pairs)
    near = sum(near_tie(r) for r, _ in pairs)
    esc = [(r, f) for r, f in pairs if escalated(r)]
    ttft = [r["ttft_ms"] / f["ttft_ms"] for r, f in pairs]
    total = [r["timings"]["total_ms"] / f["timings"]["total_ms"] for r, f in pairs]
    et = [r["timings"]["total_ms"] / f["timings"]["total_ms"] for r, f in esc]
    lo, hi = wilson(ident, n)
    nlo, nhi = wilson(near, n)
    worst = f"{statistics.median(et):.2f}, {max(et):.2f}" if et else "-"
    looks = [(r, f) for r, f in pairs if (r.get("guard") or {}).get("second_look")]
    kept = [r["timings"]["total_ms"] / f["timings"]["total_ms"] for r, f in looks if not escalated(r)]
    kept_cost = f"{statistics.median(kept):.2f}, {max(kept):.2f}" if kept else "-"
    print(
        f"| {label} | {ds} | {n} | {len(esc) / n:.0%} | {len(looks)} ({len(kept)}) "
        f"| {ident / n:.0%} [{100 * lo:.0f}, {100 * hi:.0f}] "
        f"| {near / n:.0%} [{100 * nlo:.0f}, {100 * nhi:.0f}] | {statistics.median(ttft):.2f} "
        f"| {statistics.mean(total):.3f} | {worst} | {kept_cost} |"
    )


def main():
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cases = read_cases(sys.argv[1:])
    labels = sorted({l for c in cases.values() for l in c if l != "full_recompute"})
    print(
        "| configuration | dataset | cases | escalated | second looks (kept) | identical "
        "| identical or a near-tie split | median TTFT ÷ full | mean request ÷ full "
        "| escalated ÷ full: median, worst | kept after a second look ÷ full: median, worst |"
    )
    print("|---|---|---:|---:|---:|---|---|---:|---:|---|---|")
    each_slice(cases, labels, line)
    print()
    for label in labels:
        for (ds, case), c in sorted(cases.items()):
            r = c.get(label)
            if r is None or r["identical"] or "full_recompute" not in c:
                continue
            s = r.get("split")
            where = f"token {s['at']}, full's gap {s['gap']:.3f}" if s else "not recorded"
            g = r.get("guard") or {}
            look = ""
            if g.get("second_look"):
                gap = g.get("second_look_gap")
                look = f"second look's gap {gap:.3f}; " if gap is not None else "second look; "
            print(
                f"{label} {case}: splits at {where}; escalated {escalated(r)}, "
                f"smallest gap {g.get('min_margin', min(r.get('margins') or [float('nan')])):.2f}; "
                f"{look}"
                f"full {c['full_recompute']['answer'][:60]!r} / this {r['answer'][:60]!r}"
            )
    correctness_table(cases, labels)


def right(r):
    return bool(r["correct"]) or r.get("f1", 0.0) >= RIGHT_F1


def paired_points(pairs, resamples=2000, seed=11):
    """Bootstrap 95% interval of (this correct - full correct) in points over `pairs`."""
    rng = random.Random(seed)
    d = [int(right(r)) - int(right(f)) for r, f in pairs]
    means = sorted(
        100 * sum(d[rng.randrange(len(d))] for _ in d) / len(d) for _ in range(resamples)
    )
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def by_correctness(label, ds, pairs):
    cells = []
    for part in ([p for p in pairs if right(p[1])], [p for p in pairs if not right(p[1])]):
        k = sum(r["identical"] for r, _ in part)
        lo, hi = wilson(k, len(part))
        cells.append(f"{k}/{len(part)} [{100 * lo:.0f}, {100 * hi:.0f}]" if part else "-")
    only_it = sum(right(r) and not right(f) for r, f in pairs)
    only_full = sum(right(f) and not right(r) for r, f in pairs)
    lo, hi = paired_points(pairs)
    print(
        f"| {label} | {ds} | {cells[0]} | {cells[1]} | {sum(right(f) for _, f in pairs)} "
        f"| {sum(right(r) for r, _ in pairs)} | {only_it} / {only_full} [{lo:+.1f}, {hi:+.1f}] |"
    )


def correctness_table(cases, labels):
    print()
    print(
        "| configuration | dataset | identical where full recompute is right (Wilson 95%) "
        "| identical where it is wrong | full recompute right | this right "
        "| only this / only full right [95% points] |"
    )
    print("|---|---|---|---|---:|---:|---|")
    each_slice(cases, labels, by_correctness)


def each_slice(cases, labels, row):
    """`row(label, dataset, pairs)` for each configuration, per dataset and pooled, `pairs`
    its (row, full recompute's row) of the cases that have both."""
    for label in labels:
        pairs = {
            k: (c[label], c["full_recompute"])
            for k, c in sorted(cases.items())
            if label in c and "full_recompute" in c
        }
        datasets = sorted({k[0] for k in pairs})
        for ds in datasets + (["pooled"] if len(datasets) > 1 else []):
            row(label, ds, [p for k, p in pairs.items() if ds in ("pooled", k[0])])


if __name__ == "__main__":
    main()
