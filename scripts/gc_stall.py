#!/usr/bin/env python3
"""Time to first token of a stored-KV query alone and while one-document ingestions loop.

Garbage collection must stay off the queries' road: an ingestion or a deletion removes only
the KV of the chunks it replaced, and the full pass over every chunk record and KV file runs
on a thread of its own. This measures it from outside, as a client sees it (the time from
sending a streamed `/rag/query` to its first token, queueing included):

1. a big index: the multi-hop passages of eval/data (LongBench HotpotQA, 2WikiMultihopQA and
   MuSiQue, each passage a document), ingested with `kv: lazy` (text only) into `big`;
2. a small collection `docs` of this repository's docs paragraphs, ingested eagerly, and one
   query over it so its chunks' KV is stored;
3. `--queries` streamed queries over `docs`, alone, then while another client posts one new
   lazy document after another (`--loop` collection), each its own request.

Prints both medians and their ratio. Needs a running `specrag serve` (default models) over an
empty data directory:

    cargo specrag serve --data /tmp/gc-stall --addr 127.0.0.1:8092 &
    python3 scripts/gc_stall.py --url http://127.0.0.1:8092
"""
import argparse
import json
import pathlib
import statistics
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent


def post(url, path, body, timeout=3600):
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def passages(limit):
    out = []
    for name in ["hotpotqa", "2wikimqa", "musique"]:
        for line in (ROOT / "eval" / "data" / f"{name}.jsonl").read_text().splitlines():
            case = json.loads(line)
            for i, p in enumerate(case["context"].split("Passage ")):
                text = p.split("\n", 1)[-1].strip()
                if len(text) > 80:
                    out.append({"id": f"{case['_id']}-{i}", "text": text})
                    if len(out) >= limit:
                        return out
    return out


def doc_paragraphs(n):
    out = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for p in path.read_text(encoding="utf-8").split("\n\n"):
            p = p.strip()
            if 400 <= len(p) <= 1500 and not p.startswith(("|", "```")):
                out.append({"id": f"{path.stem}-{len(out)}", "text": p})
    return out[:n]


def ttft(url, question):
    """Seconds from sending a streamed query to its first token event."""
    body = {"query": question, "collection": "docs", "top_k": 4, "max_tokens": 4, "stream": True}
    req = urllib.request.Request(
        url + "/rag/query",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("event: token") or line.startswith("event: draft"):
                first = time.perf_counter() - t0
                r.read()
                return first
    raise RuntimeError("no token event")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8092")
    ap.add_argument("--index-docs", type=int, default=20000)
    ap.add_argument("--queries", type=int, default=7)
    ap.add_argument("--loop", default="loop")
    a = ap.parse_args()

    big = passages(a.index_docs)
    t0 = time.perf_counter()
    # 200 passages a request stay under --max-request-tokens (65,536 by default).
    for i in range(0, len(big), 200):
        post(a.url, "/documents", {"collection": "big", "kv": "lazy", "documents": big[i : i + 200]})
    print(f"indexed {len(big)} passages lazily into `big` in {time.perf_counter() - t0:.1f} s", flush=True)
    post(a.url, "/documents", {"collection": "docs", "documents": doc_paragraphs(12)})
    question = "How are chunks stored and reused?"
    ttft(a.url, question)  # stores any KV still missing
    alone = [ttft(a.url, question) for _ in range(a.queries)]
    print("alone: " + " ".join(f"{x * 1e3:.0f}" for x in alone) + " ms", flush=True)

    stop = threading.Event()
    ingested = [0]

    def loop():
        n = 0
        while not stop.is_set():
            n += 1
            doc = {"id": f"loop-{n}", "text": f"Loop document {n}: " + big[n % len(big)]["text"]}
            post(a.url, "/documents", {"collection": a.loop, "kv": "lazy", "documents": [doc]})
            ingested[0] = n

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    time.sleep(1.0)
    during = [ttft(a.url, question) for _ in range(a.queries)]
    stop.set()
    t.join()
    print("during: " + " ".join(f"{x * 1e3:.0f}" for x in during) + " ms", flush=True)
    ma, md = statistics.median(alone), statistics.median(during)
    print(
        f"median TTFT alone {ma * 1e3:.0f} ms, while {ingested[0]} one-document ingestions looped "
        f"{md * 1e3:.0f} ms: {md / ma:.2f}x"
    )


if __name__ == "__main__":
    main()
