#!/usr/bin/env python3
# How long a query waits while POST /documents ingests (issue 15): serves the default models
# (target/release/specrag, built with `cargo build --release`), ingests README.md and
# ARCHITECTURE.md as 512-token chunks over NDJSON, and times a query idle and three during it.
# Usage: python3 scripts/measure-ingest-yield.py [DATA_DIR]
import json, subprocess, sys, time, urllib.request, threading, os
import pathlib
root = str(pathlib.Path(__file__).resolve().parent.parent)
data = sys.argv[1] if len(sys.argv) > 1 else "/tmp/specrag-yield-data"
subprocess.run(["rm", "-rf", data])
srv = subprocess.Popen([f"{root}/target/release/specrag", "serve", "--addr", "127.0.0.1:18093", "--data", data,
                        "--max-request-tokens", "1000000"], cwd=root, stderr=subprocess.PIPE, text=True)
for line in srv.stderr:
    if "listening" in line: break
base = "http://127.0.0.1:18093"
def post(path, body, accept="application/json"):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "accept": accept})
    return urllib.request.urlopen(req, timeout=3600)
docs = []
for name in ["README.md", "ARCHITECTURE.md"]:
    docs.append({"id": name, "text": open(f"{root}/{name}").read()})
post("/documents", {"collection": "q", "documents": [{"id": "small", "text": "specrag stores a KV cache for each chunk so queries reuse it."}]}).read()
q = {"query": "What does specrag store for each chunk?", "collection": "q", "max_tokens": 8, "method": "full_reuse"}
t = time.time(); post("/rag/query", q).read(); idle = time.time() - t
print(f"idle query: {idle:.2f} s", flush=True)
events = []
def ingest():
    t0 = time.time()
    r = post("/documents", {"collection": "m", "chunk_tokens": 512, "documents": docs}, "application/x-ndjson")
    for line in r:
        v = json.loads(line)
        events.append((time.time() - t0, v["event"]))
    events.append((time.time() - t0, "end"))
th = threading.Thread(target=ingest); th.start()
time.sleep(20)
lat = []
for i in range(3):
    t = time.time(); post("/rag/query", q).read(); lat.append(time.time() - t)
    print(f"query during ingestion: {lat[-1]:.2f} s (ingest events so far: {len(events)})", flush=True)
    time.sleep(5)
th.join()
s = [e for e in events if e[1] == "summary"]
print("ingestion:", events[-1][0], "s;", events[-2] if len(events) > 1 else None)
srv.terminate()
