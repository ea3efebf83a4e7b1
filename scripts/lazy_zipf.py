#!/usr/bin/env python3
"""Replays a Zipf-skewed stream of questions against a server whose corpus was ingested with
`--kv lazy`, and reports how often a retrieved chunk's KV was already stored (the disk budget's
hit rate) next to the best any policy could do (every chunk's first retrieval must compute it).

Questions are this repository's own: the evaluation's repo_docs questions and one question per
heading of the demo corpus (README.md, ARCHITECTURE.md, docs/*.md), so nothing is read from
outside the repository. Question ranks are shuffled with the seed, then drawn with probability
proportional to 1 / rank^s.

    mkdir -p C && cp README.md ARCHITECTURE.md docs/*.md C/    # the demo corpus, as `specrag demo`
    specrag --pairing small ingest C --data D --collection demo --kv lazy
    specrag --pairing small serve --data D --kv-disk-budget 221MB --memory-mb 16 \
        --addr 127.0.0.1:8091 &
    python3 scripts/lazy_zipf.py --url http://127.0.0.1:8091 --queries 500 --s 1.0 --data D

(221MB is a quarter of the 0.5B target's KV of that corpus; docs/usage.md has the result.)

With `--data`, the bytes under D/kv are reported at the end (they must stay near the budget).
"""
import argparse
import json
import pathlib
import random
import re
import statistics
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent


def questions():
    out = []
    for line in (ROOT / "eval/data/repo_docs.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(json.loads(line)["input"])
    docs = [ROOT / "README.md", ROOT / "ARCHITECTURE.md"] + sorted((ROOT / "docs").glob("*.md"))
    for path in docs:
        for m in re.finditer(r"^#{2,4} (.+)$", path.read_text(encoding="utf-8"), re.M):
            heading = m.group(1).strip().strip("*`")
            out.append(f"What does the documentation say about {heading}?")
    return list(dict.fromkeys(out))


def ask(url, question, collection):
    body = {"query": question, "collection": collection, "max_tokens": 1}
    req = urllib.request.Request(
        url + "/rag/query",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def disk_bytes(data):
    kv = pathlib.Path(data) / "kv"
    return sum(p.stat().st_size for p in kv.rglob("*") if p.is_file())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8091")
    ap.add_argument("--collection", default="demo")
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--s", type=float, default=1.0, help="Zipf exponent")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--data", help="the server's data directory, to report kv/ bytes")
    ap.add_argument("--log", help="write one JSON line per query here")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    pool = questions()
    rng.shuffle(pool)
    weights = [1.0 / (r + 1) ** a.s for r in range(len(pool))]
    stream = rng.choices(pool, weights=weights, k=a.queries)
    seen, reads, hits, errors, ttft = set(), 0, 0, 0, []
    log = open(a.log, "w", encoding="utf-8") if a.log else None
    started = time.time()
    for i, q in enumerate(stream):
        try:
            ans = ask(a.url, q, a.collection)
        except (urllib.error.URLError, OSError) as e:
            errors += 1
            print(f"query {i}: error {e}")
            continue
        u = ans["reuse"]
        got = u["chunks_from_memory"] + u["chunks_from_disk"] + u.get("chunks_from_remote", 0)
        reads += len(ans["chunks"])
        hits += got
        seen.update(c["id"] for c in ans["chunks"])
        ttft.append(ans["timings"]["ttft_ms"])
        if log:
            ids = [c["id"] for c in ans["chunks"]]
            log.write(json.dumps({"q": q, "chunks": ids, "reuse": u, "ttft_ms": ttft[-1]}) + "\n")
        if (i + 1) % 50 == 0:
            print(
                f"{i + 1}/{a.queries} queries, hit rate {hits / max(reads, 1):.3f}, "
                f"{time.time() - started:.0f} s",
                flush=True,
            )
    print(f"questions in the pool: {len(pool)}, drawn: {a.queries} (Zipf s={a.s}, seed {a.seed})")
    print(f"errors: {errors}")
    print(f"chunk reads: {reads}, distinct chunks: {len(seen)}")
    print(f"hit rate: {hits / max(reads, 1):.3f} (stored KV: memory, disk or remote)")
    print(f"best possible (first reads only miss): {1 - len(seen) / max(reads, 1):.3f}")
    if ttft:
        print(f"TTFT ms: median {statistics.median(ttft):.0f}, max {max(ttft):.0f}")
    if a.data:
        print(f"bytes under {a.data}/kv: {disk_bytes(a.data)}")


if __name__ == "__main__":
    main()
