#!/usr/bin/env python3
"""The data and the clients of scripts/gpu/serve_check.sh (docs/gpu.md, *Serving on the device*).

    python3 serve_client.py prepare --out DIR [--questions 20]
        Real passages and questions, here, where eval/data is: the first N HotpotQA questions of
        eval/data/hotpotqa.jsonl (LongBench's, MIT; eval/data/README.md) and each one's 10
        Wikipedia passages, one document per passage: DIR/passages.jsonl ({"id","title","text"},
        what `specrag ingest` reads) and DIR/questions.jsonl ({"id","question"}).

    python3 serve_client.py run --port P --questions FILE --out FILE.json
            [--clients 1,4,16,64] [--requests 2]
            [--methods target_probe_shift,target_probe_shift:fast,full_recompute]
            [--max-tokens 32] [--identity 4] [--collection passages]
        Closed-loop clients against a running `specrag serve`: for each method (`name` or
        `name:fidelity`: the default's guard on, and off with `:fast`) and each number
        of clients, every client streams /rag/query requests one after another (`--requests`
        each, questions in turn) and the time to the first streamed token is taken at the
        client. Per configuration: client TTFT p50/p95, the server's own TTFT p50
        (timings.ttft_ms), requests/s and tokens/s over the wall time, escalations, failures,
        and HTTP + scheduling time per request (client total less the server's total_ms).
        First, `--identity` questions are asked with the default method at ρ = 1 and with
        full_recompute: the same answer, token for token, is the reuse path's identity (random
        weights make the answers meaningless, not their identity). Writes FILE.json after every
        configuration, each method's requests/s and TTFT p50 as multiples of full_recompute's
        at the same number of clients, and /metrics' device memory at the end.

Python's standard library only: the GPU machine has no network.
"""
import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def prepare(args):
    os.makedirs(args.out, exist_ok=True)
    src = os.path.join(ROOT, "eval", "data", "hotpotqa.jsonl")
    cases = [json.loads(line) for line in open(src, encoding="utf-8")][: args.questions]
    n = 0
    with open(os.path.join(args.out, "passages.jsonl"), "w", encoding="utf-8") as docs, open(
        os.path.join(args.out, "questions.jsonl"), "w", encoding="utf-8"
    ) as qs:
        for c in cases:
            for k, block in enumerate(c["context"].split("Passage ")[1:]):
                lines = block.split("\n", 2)
                if len(lines) < 3 or not lines[2].strip():
                    continue
                title, text = lines[1].strip(), lines[2].strip()
                docs.write(json.dumps({"id": f"{c['_id']}-{k}", "title": title, "text": text}) + "\n")
                n += 1
            qs.write(json.dumps({"id": c["_id"], "question": c["input"]}) + "\n")
    print(f"{n} passages and {len(cases)} questions in {args.out}")


def ask(port, body, timeout=600):
    """One streamed /rag/query: (client TTFT s or None, client total s, the answer or None, error)."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/rag/query", json.dumps(dict(body, stream=True)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return None, time.monotonic() - t0, None, f"HTTP {resp.status}: {resp.read()[:300]!r}"
        ttft, event, answer, error = None, None, None, None
        for raw in resp:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                if event in ("token", "draft", "commit") and ttft is None:
                    ttft = time.monotonic() - t0
                elif event == "done":
                    answer = json.loads(line[5:])
                elif event == "error":
                    error = line[5:].strip()
        return ttft, time.monotonic() - t0, answer, error
    except Exception as e:  # a dropped connection is a failed request, counted
        return None, time.monotonic() - t0, None, repr(e)
    finally:
        conn.close()


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


def closed_loop(port, questions, method, clients, requests, args):
    records, lock = [], threading.Lock()

    def client(c):
        for r in range(requests):
            q = questions[(c * requests + r) % len(questions)]
            name, _, fidelity = method.partition(":")
            body = {"query": q["question"], "collection": args.collection, "method": name,
                    "max_tokens": args.max_tokens, "top_k": 5}
            if fidelity:
                body["fidelity"] = fidelity
            ttft, total, answer, error = ask(port, body)
            with lock:
                records.append((ttft, total, answer, error))

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    ok = [r for r in records if r[2] is not None and r[3] is None]
    ms = lambda x: None if x is None else round(x * 1e3, 1)
    ttfts = [r[0] for r in ok if r[0] is not None]
    tokens = sum(r[2]["tokens"] for r in ok)
    overhead = [r[1] * 1e3 - r[2]["timings"]["total_ms"] for r in ok]
    return {
        "method": method,
        "clients": clients,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r[3] for r in records if r[3]})[:3],
        "ttft_p50_ms": ms(pct(ttfts, 50)),
        "ttft_p95_ms": ms(pct(ttfts, 95)),
        "server_ttft_p50_ms": ms(pct([r[2]["timings"]["ttft_ms"] / 1e3 for r in ok], 50)),
        "requests_per_s": round(len(ok) / wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "escalated": sum(1 for r in ok if r[2]["reuse"]["guard"]["escalated"]),
        "http_and_scheduling_ms_p50": None if not overhead else round(pct(overhead, 50), 2),
        "wall_s": round(wall, 2),
    }


def identity(port, questions, n, args):
    out = []
    for q in questions[:n]:
        base = {"query": q["question"], "collection": args.collection, "max_tokens": args.max_tokens,
                "top_k": 5, "logprobs": 1}
        _, _, full, e1 = ask(port, dict(base, method="full_recompute"))
        _, _, one, e2 = ask(port, dict(base, method="target_probe_shift", recompute_ratio=1.0))
        if full is None or one is None:
            out.append({"id": q["id"], "error": e1 or e2})
            continue
        toks = lambda a: [t["token"] for t in a.get("logprobs") or []]
        out.append({"id": q["id"], "same": toks(full) == toks(one), "tokens": len(toks(full))})
    return out


def device_memory(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {line.split('kind="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("specrag_device_memory_bytes{")}


def run(args):
    questions = [json.loads(line) for line in open(args.questions, encoding="utf-8")]
    result = {"identity_at_rho_1": identity(args.port, questions, args.identity, args), "runs": []}

    def save():
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)

    same = [r.get("same") for r in result["identity_at_rho_1"]]
    print(f"identity at rho 1: {sum(1 for s in same if s)} of {len(same)} answers the same", flush=True)
    save()
    print(f"{'method':<24} {'clients':>7} {'ttft p50':>9} {'p95':>9} {'server':>8} {'req/s':>7} "
          f"{'tok/s':>8} {'esc':>4} {'fail':>4} {'http ms':>7}", flush=True)
    for clients in [int(c) for c in args.clients.split(",")]:
        for method in args.methods.split(","):
            r = closed_loop(args.port, questions, method, clients, args.requests, args)
            result["runs"].append(r)
            save()
            print(f"{method:<24} {clients:>7} {r['ttft_p50_ms']!s:>9} {r['ttft_p95_ms']!s:>9} "
                  f"{r['server_ttft_p50_ms']!s:>8} {r['requests_per_s']:>7} {r['tokens_per_s']:>8} "
                  f"{r['escalated']:>4} {r['failed']:>4} {r['http_and_scheduling_ms_p50']!s:>7}",
                  flush=True)
            for e in r["errors"]:
                print(f"  error: {e}", flush=True)
    result["ratios"] = ratios(result["runs"])
    for r in result["ratios"]:
        print(f"{r['method']} against full_recompute, {r['clients']} clients: requests/s "
              f"{r['requests_per_s_x']}x, client TTFT p50 {r['ttft_p50_x']}x", flush=True)
    result["device_memory_bytes"] = device_memory(args.port)
    save()


def ratios(runs):
    """Each method's requests/s and client TTFT p50 as multiples of full_recompute's at the
    same number of clients (the serving bar: >= 3x and <= 0.35x at 16 clients)."""
    full = {r["clients"]: r for r in runs if r["method"] == "full_recompute"}
    out = []
    for r in runs:
        f = full.get(r["clients"])
        if r["method"] == "full_recompute" or not f or not f["requests_per_s"] or not f["ttft_p50_ms"]:
            continue
        out.append({
            "method": r["method"],
            "clients": r["clients"],
            "requests_per_s_x": round(r["requests_per_s"] / f["requests_per_s"], 2),
            "ttft_p50_x": None if r["ttft_p50_ms"] is None else round(r["ttft_p50_ms"] / f["ttft_p50_ms"], 2),
        })
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", required=True)
    p.add_argument("--questions", type=int, default=20)
    r = sub.add_parser("run")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--questions", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--clients", default="1,4,16,64")
    r.add_argument("--requests", type=int, default=2)
    r.add_argument("--methods", default="target_probe_shift,target_probe_shift:fast,full_recompute")
    r.add_argument("--max-tokens", type=int, default=32)
    r.add_argument("--identity", type=int, default=4)
    r.add_argument("--collection", default="passages")
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
