#!/usr/bin/env python3
"""What `--guard-look-cost` would have done on recorded guarded requests (no model runs).

For every `:balanced` request of the given study records (the `:extend` rows of look-rows
records) that took a second look, the guard's estimate of an escalation after the look
(`gateway::fidelity::LookCost::after_look`) is rebuilt from the record: the time spent (KV
load, selection, blended prefill), the blend's rate per row, the prompt's rows, the rows a
full prefill keeps and the question's. The records carry the chunk tokens (full recompute's
`selected`) and the first chunk's, not the template prefix or the question: they are taken as
20 and 30 tokens (`--prefix`, `--question`). Where the estimate exceeds a bound the look is
skipped and the request escalates at once; its cost is then estimated as the reused part
spent plus full recompute's prefill of the rows after the kept ones and its decode.

`--gap-floors 0.02,0.05` replays another rule the same way: skip the look where the doubted
token's top-2 gap (the first under the guard's margin in the unguarded answer of the same
record, `target_probe_shift@0.25`; records without one, as look-rows', are left out) is under
the floor.

  python3 scripts/guard_look_cost.py eval/study/guard/defaults-musique-1-60.jsonl.gz ... \\
      [--bounds 1.05,1.10,1.15] [--gap-floors 0.02,0.05] [--verbose]

Prints, per bound: identity with full recompute, escalations, mean request ÷ full, and the
dearest escalation, before and after.
"""
import argparse
import gzip
import json


def rows_of(path):
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="+")
    ap.add_argument("--bounds", default="1.00,1.05,1.10,1.15")
    ap.add_argument("--prefix", type=int, default=20)
    ap.add_argument("--question", type=int, default=30)
    ap.add_argument("--gap-floors", default="", help="doubted-token gaps under which the look is skipped")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    cases = []
    for path in a.records:
        rows = rows_of(path)
        full = {(r["dataset"], r["case"]): r for r in rows if r["label"] == "full_recompute"}
        unguarded = {(r["dataset"], r["case"]): r for r in rows if ":" not in r["label"]
                     and r["label"] != "full_recompute"}
        for r in rows:
            lab = r["label"]
            if ":balanced" not in lab or ("look-rows" in path and not lab.endswith(":extend")):
                continue
            f = full[(r["dataset"], r["case"])]
            g, t, ft = r["guard"], r["timings"], f["timings"]
            chunk = len(f["selected"])
            first = sum(1 for s in f["selected"] if s["chunk"] == 0)
            q = a.question
            prompt, exact = chunk + a.prefix + q, first + a.prefix
            c = {"path": path, "case": r["case"], "ident": r["identical"], "esc": g["escalated"],
                 "cost": t["total_ms"] / ft["total_ms"], "look": g["second_look"], "est": None}
            if g["second_look"]:
                rate = t["prefill_ms"] / (len(r["selected"]) + q)
                spent = t["kv_load_ms"] + t["speculate_ms"] + t["align_ms"] + t["prefill_ms"]
                c["est"] = (spent + rate * (q + prompt - exact)) / (rate * prompt)
                c["direct"] = (spent + ft["prefill_ms"] * (prompt - exact) / prompt + ft["decode_ms"]) / ft["total_ms"]
                u = unguarded.get((r["dataset"], r["case"]))
                doubted = [m for m in (u or {}).get("margins") or [] if m < g["margin"]]
                c["gap"] = doubted[0] if doubted else None
            cases.append(c)
    n = len(cases)

    def summary(bound, floor=None):
        ident = esc = cost = 0.0
        worst = 0.0
        for c in cases:
            if floor is None:
                skip = c["est"] is not None and c["est"] > bound
            else:
                skip = c.get("gap") is not None and c["gap"] < floor
            i, e, k = (True, True, c["direct"]) if skip else (c["ident"], c["esc"], c["cost"])
            ident += i
            esc += e
            cost += k
            if e:
                worst = max(worst, k)
        return ident / n, esc / n, cost / n, worst

    if a.verbose:
        for c in cases:
            if c["look"]:
                print(f"{c['case']}: escalated {c['esc']}, identical {c['ident']}, cost {c['cost']:.2f}, "
                      f"estimate after the look {c['est']:.2f}, at once ~{c['direct']:.2f}")
    base = summary(float("inf"))
    print(f"{n} guarded requests, {sum(c['look'] for c in cases)} second looks")
    print("| bound | identical | escalated | mean request ÷ full | dearest escalation |")
    print("|---|---:|---:|---:|---:|")
    print(f"| none (every look) | {base[0]:.1%} | {base[1]:.1%} | {base[2]:.3f} | {base[3]:.2f} |")
    for b in [float(x) for x in a.bounds.split(",")]:
        s = summary(b)
        print(f"| {b:.2f} | {s[0]:.1%} | {s[1]:.1%} | {s[2]:.3f} | {s[3]:.2f} |")
    floors = [float(x) for x in a.gap_floors.split(",") if x]
    if floors:
        gapped = [c for c in cases if c.get("gap") is not None]
        print(f"\n{len(gapped)} looks with the doubted token's gap recorded")
        print("| look skipped under gap | identical | escalated | mean request ÷ full | dearest escalation |")
        print("|---|---:|---:|---:|---:|")
        for fl in floors:
            s = summary(None, fl)
            skipped = sum(1 for c in gapped if c["gap"] < fl)
            kept = sum(1 for c in gapped if c["gap"] < fl and not c["esc"])
            print(f"| {fl:.2f} ({skipped} skipped, {kept} the look kept) | {s[0]:.1%} | {s[1]:.1%} | "
                  f"{s[2]:.3f} | {s[3]:.2f} |")


if __name__ == "__main__":
    main()
