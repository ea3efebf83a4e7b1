#!/usr/bin/env python3
"""specrag's device times as ratios of the same run's PyTorch (torch_anchor.py).

    python3 ratios.py GPU_JSON TORCH_JSON [--out RATIOS_JSON]

Prints one table per shape and weights form: specrag's full prefill, target_probe,
target_probe_shift (the default method) against PyTorch's full prefill of the same prompt,
target_probe_shift against target_probe, decode of one request and of 16 together against
PyTorch's eager decode, and the long prefill. Below 1 is faster than PyTorch.
"""

import argparse
import json
import sys


def ratio(a, b):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0:
        return a / b
    return None


def rows(gpu, torch):
    """(shape, weights, what, specrag, pytorch, ratio) for every figure both sides have."""
    out = []
    for shape, forms in (gpu.get("speed") or {}).items():
        t = (torch.get("shapes") or {}).get(shape)
        if not isinstance(forms, dict) or not t:
            continue
        full = t.get("full_prefill_ms")
        for weights, s in forms.items():
            if not isinstance(s, dict) or "error" in s:
                continue
            add = lambda what, mine, theirs: out.append(
                (shape, weights, what, mine, theirs, ratio(mine, theirs))
            )
            add("full prefill (ms)", s.get("full_prefill_ms"), full)
            add("target_probe TTFT (ms)", s.get("target_probe_ms"), full)
            add("target_probe_shift TTFT (ms)", s.get("target_probe_shift_ms"), full)
            hot = s.get("chunk_kv_on_device") or {}
            add("target_probe, KV on device (ms)", hot.get("target_probe_ms"), full)
            add("target_probe_shift, KV on device (ms)", hot.get("target_probe_shift_ms"), full)
            pinned = s.get("chunk_kv_pinned") or {}
            add("target_probe, KV in pinned host memory (ms)", pinned.get("target_probe_ms"), full)
            add(
                "target_probe_shift, KV in pinned host memory (ms)",
                pinned.get("target_probe_shift_ms"),
                full,
            )
            add(
                "target_probe_shift / target_probe",
                s.get("target_probe_shift_ms"),
                s.get("target_probe_ms"),
            )
            tps = s.get("decode_tokens_per_s")
            add("decode, 1 request (ms/token)", 1e3 / tps if tps else None, t.get("decode_ms_per_step"))
            batch = t.get("batched_decode") or {}
            mine = ((s.get("batched_decode") or {}).get(str(batch.get("requests"))) or {})
            add(
                f"decode, {batch.get('requests')} together (ms/step)",
                mine.get("ms_per_step"),
                batch.get("ms_per_step"),
            )
    long_gpu, long_torch = gpu.get("long_context") or {}, torch.get("long_context") or {}
    if long_gpu.get("tokens") == long_torch.get("tokens") and "prefill_s" in long_gpu:
        mine = long_gpu["prefill_s"] * 1e3
        theirs = long_torch.get("prefill_ms")
        out.append(
            (
                long_gpu.get("shape"),
                long_gpu.get("weights", "-"),
                f"{long_gpu['tokens']}-token prefill (ms)",
                mine,
                theirs,
                ratio(mine, theirs),
            )
        )
    return out


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gpu", help="gpu_check's gpu.json")
    p.add_argument("torch", help="torch_anchor.py's JSON")
    p.add_argument("--out", help="also write the ratios here (JSON)")
    a = p.parse_args(argv)
    with open(a.gpu) as f:
        gpu = json.load(f)
    with open(a.torch) as f:
        torch = json.load(f)
    table = rows(gpu, torch)
    if not table:
        print("no figure is in both files (a part failed or was skipped)")
    else:
        print(f"{'shape':<6} {'weights':<10} {'figure':<36} {'specrag':>10} {'pytorch':>10} {'ratio':>7}")
        for shape, weights, what, mine, theirs, r in table:
            print(f"{shape:<6} {weights:<10} {what:<36} {fmt(mine):>10} {fmt(theirs):>10} {fmt(r):>7}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                [dict(zip(("shape", "weights", "figure", "specrag", "pytorch", "ratio"), r)) for r in table],
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
