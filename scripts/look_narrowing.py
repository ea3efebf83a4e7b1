#!/usr/bin/env python3
"""Replay the fidelity guard's look-narrowing bound (`--guard-look-narrowing`) on records.

A second look that chose the doubted token again by at least the confirm gap was kept. With
the bound, it is kept only where its top-2 gap is at most BOUND below the first decode's gap
for that token (`reuse.guard.min_margin`: the first decode stops at its first doubt). This
script lists, per record file, the looks the records kept that the bound would have
escalated, with what the kept answer was (identical to full recompute's, or how it split).
An escalated answer is full recompute's token for token, so those answers become identical;
each costs an escalation (a full prefill after the look's rows).

Only requests the guard finished without escalating are counted: one that escalated later
anyway (a second doubt, a loop) answers as full recompute whatever the bound.

    python3 scripts/look_narrowing.py [--bound 0.01] eval/study/guard/*.jsonl.gz

Reads `specrag-eval --study` rows (label ending `:balanced`) and `scripts/split_classes.py`
records (the guarded run's `guard`, `escalated`, `class`).
"""

import argparse
import gzip
import json


def guard_of(row):
    """The guard report of a record row, and whether the request escalated."""
    if "guard" in row and "escalated" in row:  # split_classes.py
        return row["guard"], row["escalated"]
    g = row.get("guard") or (row.get("reuse") or {}).get("guard")
    if not g:
        return None, None
    return g, g.get("escalated")


def kept_class(row):
    """What the kept answer was against full recompute's."""
    if "class" in row:
        return row["class"]
    return "identical" if row.get("identical") else "differs"


def replay(path, bound):
    """(guarded requests, kept looks, [(first gap, look gap, class)] the bound escalates)."""
    opener = gzip.open if path.endswith(".gz") else open
    guarded = looks = 0
    escalated = []
    with opener(path, "rt") as f:
        for line in f:
            row = json.loads(line)
            label = row.get("label", "")
            if label and not label.endswith(":balanced"):
                continue
            g, esc = guard_of(row)
            if not g or g.get("margin") is None:
                continue
            guarded += 1
            first, look = g.get("min_margin"), g.get("second_look_gap")
            if esc or first is None or look is None:
                continue
            looks += 1
            if look < first - bound:
                escalated.append((first, look, kept_class(row)))
    return guarded, looks, escalated


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bound", type=float, default=0.01, help="the narrowing bound")
    ap.add_argument("records", nargs="+")
    a = ap.parse_args()
    print(f"| records | guarded | kept looks | escalated at {a.bound} | their kept answers |")
    print("|---|---:|---:|---:|---|")
    total = [0, 0, 0, 0]
    for path in a.records:
        guarded, looks, esc = replay(path, a.bound)
        if not guarded:
            continue
        splits = [c for _, _, c in esc if c != "identical"]
        total = [total[0] + guarded, total[1] + looks, total[2] + len(esc), total[3] + len(splits)]
        what = ", ".join(f"{f:.3f} -> {l:.3f} {c}" for f, l, c in esc) or "-"
        print(f"| {path.split('/')[-1]} | {guarded} | {looks} | {len(esc)} | {what} |")
    print(
        f"| all | {total[0]} | {total[1]} | {total[2]} | {total[3]} of them not full "
        "recompute's |"
    )


if __name__ == "__main__":
    main()
