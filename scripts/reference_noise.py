#!/usr/bin/env python3
"""How often full recompute disagrees with itself under another numerics, beside the guard.

    python3 scripts/reference_noise.py REFERENCE.jsonl[.gz] OTHER.jsonl[.gz]

REFERENCE holds study rows with `full_recompute` (and, where it has them, the guarded default
`target_probe_shift@0.25:balanced`); OTHER holds `full_recompute` rows of the same questions
run under another numerics (`SPECRAG_ATTENTION=bf16`, f16 KV rows against f32). Prints the
share of identical answers (Wilson 95%), each differing pair with the smallest top-2 gap over
either answer, and the guarded default's identity against each reference.
"""
import math
import sys

from guard_signals import read_cases, wilson


def load(path, label):
    """(dataset, case) -> the row labelled `label` in `path`."""
    return {k: rows[label] for k, rows in read_cases([path]).items() if label in rows}


def share(k, n):
    lo, hi = wilson(k, n)
    return f"{k}/{n} = {100 * k / n:.1f}% [{100 * lo:.0f}, {100 * hi:.0f}]"


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    ref = load(sys.argv[1], "full_recompute")
    alt = load(sys.argv[2], "full_recompute")
    guard = load(sys.argv[1], "target_probe_shift@0.25:balanced")
    keys = sorted(set(ref) & set(alt))
    if not keys:
        sys.exit("no question has full recompute in both files")
    same = sum(ref[k]["answer"] == alt[k]["answer"] for k in keys)
    print(f"full recompute against itself: {share(same, len(keys))}")
    for k in keys:
        a, b = ref[k]["answer"], alt[k]["answer"]
        if a != b:
            gaps = (min(ref[k].get("margins") or [math.inf]), min(alt[k].get("margins") or [math.inf]))
            print(f"  {k[1][:24]}: {a[:50]!r} | {b[:50]!r} (smallest gap {gaps[0]:.3f} / {gaps[1]:.3f})")
    guarded = [k for k in keys if k in guard]
    if guarded:
        for name, rows in (("first", ref), ("second", alt)):
            s = sum(guard[k]["answer"] == rows[k]["answer"] for k in guarded)
            print(f"guarded default against the {name} file's full recompute: {share(s, len(guarded))}")


if __name__ == "__main__":
    main()
