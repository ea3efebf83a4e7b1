#!/usr/bin/env python3
"""`specrag serve` (its defaults: the default method at ρ 0.25 with the fidelity guard) against
llama.cpp's `llama-server` on the same RAG prompts, the same machine, one after the other.

Setup: the repository's docs (README, ARCHITECTURE, docs/*.md) are indexed with `--kv lazy`
into a fresh data directory; each question (the first N of eval/data/repo_docs.jsonl) is asked
once with `max_tokens` 1 so its chunks' KV is computed and stored (as after an ingestion), and
the chunks it retrieved are kept. llama-server then gets exactly specrag's prompt as token ids
(ChatML: the system text, `Document: ` + each chunk, `Question: ` + the question, the assistant
header; tokenized by llama-server's /tokenize, chunk and question text without parsing special tokens) with
`cache_prompt: false`, so every request is a full prefill, as specrag's full recompute.

For each configuration (answer length x concurrent clients), specrag's server is restarted
(its exact-context cache would otherwise hold prompts escalated before) beside a fresh
llama-server. With one client the two engines take turns, one request each, the first
alternating, so each question's pair runs under the same machine load (a shared 2-core VM
slows down and speeds up by 1.5-2x over minutes); with several, each engine runs all the
questions in turn, the order alternating between configurations. Each client streams, and
the time to the first streamed text that stands is taken at the client (queueing included;
text the fidelity guard withdraws later does not count, the text that replaced it does). Prints, per configuration and engine, the median and
95th-percentile client TTFT, requests per minute over the configuration's wall time, and for
specrag how many requests the guard escalated, and how many failed (an `error` event, a 503 or
504, a dropped connection: counted, logged with the server's reason, left out of the TTFT
percentiles); one JSON line per request goes to OUT/requests.jsonl.

    python3 scripts/compare_llama_server.py \
        --llama-server PATH/llama-server --out DIR [--questions 8] [--answers 32,256] \
        [--clients 1,4] [--threads 2] [--engines specrag,llama-server] [--max-batch 4] \
        [--prefill-piece 0,256] [--serve-args '' '--ratio 0.35']

`--max-batch 1,4` runs specrag once per value (`specrag serve --max-batch N`, engines named
`specrag/bN`): batching against one request at a time in the same run; `--prefill-piece
0,256` likewise (`specrag/pN`): an escalation's full prefill in one turn or in pieces;
`--serve-args '' '--ratio 0.35'` any `specrag serve` settings (`specrag/<arguments>`,
`specrag/defaults` for ''); `--baseline PATH` another build's defaults (`specrag/baseline`),
say the parent commit's binary, so a change is measured against what it changes. With
`--engines specrag` no llama-server is needed (`--llama-server` may be left out; the
questions are warmed without llama.cpp's token ids).

llama-server gets as many slots as the configuration has clients (`-np`), 4096 tokens of
context each. The warmed questions and their prompts are kept in OUT/questions.json, so a
second run over the same OUT (other configurations, one engine) starts at once.

Needs `cargo build --release -p gateway --bin specrag`, the default models in `models/` and
llama-server (Python's standard library is enough otherwise), built from the vendored sources of
the `llama-cpp-python` sdist: in `vendor/llama.cpp`, `cmake -B build -DGGML_NATIVE=ON
-DLLAMA_BUILD_SERVER=ON && cmake --build build --target llama-server -j2` (~10-25 min on 2 cores).
On a CPU with AMX add `-DCMAKE_C_FLAGS="-mno-amx-int8 -mno-amx-tile"` and the same
`-DCMAKE_CXX_FLAGS`: that build's AMX matmul segfaulted in llama-server's warmup on a 2-core
Xeon with AMX (0.3.36, Q4_K_M), and specrag has no AMX kernels to compare it with.
"""
import argparse
import glob
import http.client
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
SYSTEM = "Answer the question using the documents."
TARGET = os.path.join(ROOT, "models", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_http(port, path, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"no server on port {port}{path} after {timeout} s")


def post_json(port, path, body, timeout=3600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"{path}: {r.status} {data[:300]!r}")
    return json.loads(data)


def sse(port, path, body, timeout=3600):
    """(seconds to the first text that stands, the events as (name, data), seconds in all) of a
    streamed request. Text stands from the moment the text the client holds (drafts aside) is a
    non-empty beginning of the final answer and stays one: a first token the fidelity guard
    later withdraws (`replace`) does not count, the text that replaced it does."""
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                               "Accept": "text/event-stream"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{path}: {r.status} {r.read()[:300]!r}")
    events, name, held, states = [], "message", "", []
    for raw in r:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                break
            d = json.loads(data)
            if name in ("token", "commit"):
                held += d.get("text", "")
            elif name == "replace":
                held = d.get("text", "")
            elif name == "message":
                held += d.get("content", "")
            states.append((time.perf_counter() - t0, held))
            events.append((name, d))
            if name in ("done", "error") or (name == "message" and d.get("stop")):
                break
            name = "message"
    done = next((d for n, d in events if n == "done"), None)
    return standing(states, done["answer"] if done else held), events, time.perf_counter() - t0


def standing(states, answer):
    """The first of `states` ((seconds, text held)) from which every text held is a non-empty
    beginning of `answer`; None where there is none."""
    first = None
    for t, held in states:
        if held and answer.startswith(held):
            first = t if first is None else first
        else:
            first = None
    return first


class Server:
    """A server process started on a port and stopped between configurations."""
    proc = None

    def launch(self, cmd, log_path, env=None):
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_http(self.port, "/health")

    def stop(self):
        if self.proc:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                # llama-server has been seen to outlive SIGTERM after a run with several
                # slots; the next configuration needs the port and the cores.
                log(f"{type(self).__name__} outlived SIGTERM by 60 s: killed")
                self.proc.kill()
                self.proc.wait()
            self.proc = None


class Specrag(Server):
    def __init__(self, exe, data, port, threads, max_batch=None, piece=None, extra=()):
        self.exe, self.data, self.port, self.threads, self.proc = exe, data, port, threads, None
        self.max_batch, self.piece, self.extra = max_batch, piece, list(extra)

    def start(self):
        batch = [] if self.max_batch is None else ["--max-batch", str(self.max_batch)]
        batch += [] if self.piece is None else ["--prefill-piece", str(self.piece)]
        batch += self.extra
        self.launch([self.exe, "serve", "--data", self.data, "--addr", f"127.0.0.1:{self.port}"] + batch,
                    os.path.join(self.data, "..", "specrag-serve.log"),
                    dict(os.environ, RAYON_NUM_THREADS=str(self.threads)))

    def batching(self):
        """(decode passes, decode steps) from /metrics: steps / passes is the mean batch."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        value = lambda name: next((float(l.split()[-1]) for l in text.splitlines()
                                   if l.startswith(name + " ")), 0.0)
        return value("specrag_decode_passes_total"), value("specrag_decode_steps_total")

    def ask(self, q, max_tokens):
        first, events, total = sse(self.port, "/rag/query", {"query": q["question"], "max_tokens": max_tokens,
                                                            "stream": True})
        done = next((d for n, d in events if n == "done"), None)
        if done is None:
            # A request the server stopped (its deadline, an internal error) is a failed request
            # in the results, not a worker that dies.
            err = next((d for n, d in events if n == "error"), {})
            return {"ttft_s": None, "total_s": total, "tokens": 0, "escalated": False,
                    "answer": None, "failed": err.get("title") or err.get("detail") or "no done event"}
        return {"ttft_s": first, "total_s": total, "tokens": done["tokens"],
                "escalated": done["reuse"]["guard"]["escalated"], "answer": done["answer"],
                "second_look": done["reuse"]["guard"].get("second_look", False),
                "second_looks": done["reuse"]["guard"].get("second_looks", 0),
                "min_margin": done["reuse"]["guard"].get("min_margin"),
                "server_ttft_ms": done["timings"]["ttft_ms"]}


class LlamaServer(Server):
    def __init__(self, exe, port, threads, parallel):
        self.exe, self.port, self.threads, self.parallel, self.proc = exe, port, threads, parallel, None

    def start(self, logdir):
        self.launch([self.exe, "-m", TARGET, "-t", str(self.threads), "-tb", str(self.threads),
                     "-np", str(self.parallel), "-c", str(4096 * self.parallel),
                     "--port", str(self.port), "--host", "127.0.0.1"],
                    os.path.join(logdir, "llama-server.log"))

    def ask(self, q, max_tokens):
        first, events, total = sse(self.port, "/completion", {"prompt": q["ids"], "n_predict": max_tokens,
                                                             "stream": True, "cache_prompt": False,
                                                             "temperature": 0, "top_k": 1})
        last = events[-1][1] if events else {}
        return {"ttft_s": first, "total_s": total, "tokens": last.get("tokens_predicted"),
                "prompt_tokens": last.get("tokens_evaluated"),
                "answer": "".join(d.get("content", "") for _, d in events)}


def run_config(engine, questions, max_tokens, clients):
    """Every question once, `clients` at a time; (per-request rows, wall seconds)."""
    todo = queue.Queue()
    for q in questions:
        todo.put(q)
    rows, lock = [], threading.Lock()

    def worker():
        while True:
            try:
                q = todo.get_nowait()
            except queue.Empty:
                return
            try:
                row = engine.ask(q, max_tokens)
            except (OSError, RuntimeError) as e:
                # A refused or dropped request (a 503, a 504, a reset): counted as failed.
                row = {"ttft_s": None, "total_s": None, "tokens": 0, "escalated": False,
                       "answer": None, "failed": str(e)[:300]}
            row["id"] = q["id"]
            with lock:
                rows.append(row)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows, time.perf_counter() - t0


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def tokenize(port, text, special):
    """llama.cpp's token ids of `text` (llama-server's /tokenize), special tokens parsed or not."""
    r = post_json(port, "/tokenize", {"content": text, "add_special": False, "parse_special": special})
    return r["tokens"]


def prompt_ids(port, chunks, question):
    ids = tokenize(port, f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n", True)
    for c in chunks:
        ids += tokenize(port, f"Document: {c.strip()}\n\n", False)
    ids += tokenize(port, f"Question: {question.strip()}", False)
    ids += tokenize(port, "<|im_end|>\n<|im_start|>assistant\n", True)
    return ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server")
    ap.add_argument("--out", required=True)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--answers", default="32,256")
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8191)
    ap.add_argument("--engines", default="specrag,llama-server")
    ap.add_argument("--max-batch", default="", help="specrag serve --max-batch values, comma-separated")
    ap.add_argument(
        "--prefill-piece", default="", help="specrag serve --prefill-piece values, comma-separated"
    )
    ap.add_argument(
        "--serve-args",
        nargs="+",
        default=[],
        help="one specrag variant per value, each the `specrag serve` arguments it adds "
        "(quoted; '' for none), named specrag/<arguments>",
    )
    ap.add_argument(
        "--baseline",
        help="another build of `specrag` (say, the parent commit's, copied aside) run with its "
        "defaults beside this tree's, as specrag/baseline: a change against what it changes "
        "in one run",
    )
    ap.add_argument(
        "--reverse",
        action="store_true",
        help="with several clients, the engines in the reverse order (alternate it between runs "
        "of rounds, so no engine always goes first)",
    )
    a = ap.parse_args()
    with_llama = "llama-server" in a.engines.split(",")
    if with_llama and not a.llama_server:
        ap.error("--llama-server is needed unless --engines is specrag")
    os.makedirs(a.out, exist_ok=True)
    exe = os.path.join(ROOT, "target", "release", "specrag")
    data = os.path.join(os.path.abspath(a.out), "data")
    if not os.path.exists(data):
        docs = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "ARCHITECTURE.md")]
        docs += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
        subprocess.run([exe, "ingest", "--data", data, "--kv", "lazy"] + docs, cwd=ROOT, check=True)
    with open(os.path.join(ROOT, "eval", "data", "repo_docs.jsonl"), encoding="utf-8") as f:
        qs = [json.loads(l) for l in f][: a.questions]
    spec = Specrag(exe, data, a.port, a.threads)
    saved = os.path.join(a.out, "questions.json")
    if os.path.exists(saved):
        with open(saved) as f:
            questions = json.load(f)[: a.questions]
    else:
        vocab = LlamaServer(a.llama_server, a.port + 1, a.threads, 1) if with_llama else None
        if vocab:
            vocab.start(a.out)
        spec.start()
        questions = []
        for q in qs:
            log(f"warming {q['_id']}: its chunks' KV")
            r = post_json(a.port, "/rag/query", {"query": q["input"], "max_tokens": 1, "fidelity": "fast"})
            # `chunks` lists them in the order specrag's prompt reads them.
            chunks = [c["text"] for c in r["chunks"]]
            questions.append({"id": q["_id"], "question": q["input"],
                              "ids": prompt_ids(vocab.port, chunks, q["input"]) if vocab else None})
        spec.stop()
        if vocab:
            vocab.stop()
        with open(saved, "w") as f:
            json.dump(questions, f)
    out = open(os.path.join(a.out, "requests.jsonl"), "a")
    summary = []
    engines = a.engines.split(",")
    batches = [int(x) for x in a.max_batch.split(",") if x]
    pieces = [int(x) for x in a.prefill_piece.split(",") if x]
    if sum(len(v) > 1 for v in (batches, pieces, a.serve_args)) > 1:
        ap.error("vary one of --max-batch, --prefill-piece and --serve-args")
    specs = [("specrag", spec)]
    if len(batches) > 1:
        specs = [(f"specrag/b{b}", Specrag(exe, data, a.port, a.threads, b)) for b in batches]
    elif len(pieces) > 1:
        specs = [(f"specrag/p{p}", Specrag(exe, data, a.port, a.threads, None, p)) for p in pieces]
    elif a.serve_args:
        specs = [
            (f"specrag/{x.strip() or 'defaults'}", Specrag(exe, data, a.port, a.threads, extra=x.split()))
            for x in a.serve_args
        ]
    if a.baseline:
        specs = [("specrag/defaults", spec)] if specs == [("specrag", spec)] else specs
        specs.append(("specrag/baseline", Specrag(os.path.abspath(a.baseline), data, a.port, a.threads)))
    for _, s_ in specs:
        s_.max_batch = s_.max_batch if len(batches) != 1 else batches[0]
        s_.piece = s_.piece if len(pieces) != 1 else pieces[0]
    for ci, (max_tokens, clients) in enumerate((m, c) for m in [int(x) for x in a.answers.split(",")]
                                                for c in [int(x) for x in a.clients.split(",")]):
        llama = LlamaServer(a.llama_server, a.port + 1, a.threads, clients)
        pair = [(n, e) for n, e in specs if "specrag" in engines]
        pair += [("llama-server", llama)] if with_llama else []
        log(f"{len(questions)} questions, {max_tokens}-token answers, {clients} clients")
        batching = {}
        if clients == 1 and len(pair) == 2 and len(specs) == 1:
            # One request of each engine in turn, the first alternating: paired under the same load.
            for name, engine in pair:
                engine.start(*([] if isinstance(engine, Specrag) else [a.out]))
            rows = {n: [] for n, _ in pair}
            for i, q in enumerate(questions):
                for name, engine in (pair if (i + ci) % 2 == 0 else pair[::-1]):
                    r = engine.ask(q, max_tokens)
                    r["id"] = q["id"]
                    rows[name].append(r)
            walls = {n: sum(r["total_s"] or 0 for r in rs) for n, rs in rows.items()}
            for _, engine in pair:
                engine.stop()
        else:
            # Each engine alone on the machine (the specrag variants share a port), the order
            # alternating between configurations.
            rows, walls = {}, {}
            batching = {}
            for name, engine in (pair if (ci + a.reverse) % 2 == 0 else pair[::-1]):
                engine.start(*([] if isinstance(engine, Specrag) else [a.out]))
                rows[name], walls[name] = run_config(engine, questions, max_tokens, clients)
                if isinstance(engine, Specrag):
                    batching[name] = engine.batching()
                engine.stop()
        for name, _ in pair:
            for r in rows[name]:
                out.write(json.dumps(dict(r, engine=name, max_tokens=max_tokens, clients=clients)) + "\n")
            out.flush()
            ttfts = [r["ttft_s"] for r in rows[name] if r["ttft_s"] is not None]
            failed = [r for r in rows[name] if r.get("failed")]
            for r in failed:
                log(f"{name}: {r['id']} failed: {r['failed']}")
            if not ttfts:
                ttfts = [float("nan")]
            s_ = {"engine": name, "max_tokens": max_tokens, "clients": clients, "requests": len(rows[name]),
                  "failed": len(failed),
                  "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": pct(ttfts, 95),
                  "requests_per_min": 60 * len(rows[name]) / walls[name], "wall_s": walls[name]}
            if name.startswith("specrag"):
                s_["escalated"] = sum(1 for r in rows[name] if r["escalated"])
                if name in batching:
                    s_["decode_passes"], s_["decode_steps"] = batching[name]
            else:
                s_["prompt_tokens_median"] = statistics.median(r["prompt_tokens"] or 0 for r in rows[name])
            print(json.dumps(s_), flush=True)
            summary.append(s_)
    with open(os.path.join(a.out, "summary.jsonl"), "a") as f:
        for s_ in summary:
            f.write(json.dumps(s_) + "\n")
    for mt in sorted({s["max_tokens"] for s in summary}):
        for cl in sorted({s["clients"] for s in summary}):
            variants = [s for s in summary if s["engine"].startswith("specrag/")
                        and s["max_tokens"] == mt and s["clients"] == cl]
            for v in variants[1:]:
                b = variants[0]
                print(f"{mt:>4} tokens, {cl} clients: {v['engine']} against {b['engine']}: TTFT p50 "
                      f"{v['ttft_p50_s']:.1f} s vs {b['ttft_p50_s']:.1f} s ({v['ttft_p50_s'] / b['ttft_p50_s']:.2f}x), "
                      f"p95 {v['ttft_p95_s']:.1f} vs {b['ttft_p95_s']:.1f} s, requests/min "
                      f"{v['requests_per_min']:.2f} vs {b['requests_per_min']:.2f} "
                      f"({v['requests_per_min'] / b['requests_per_min']:.2f}x), mean decode batch "
                      f"{v.get('decode_steps', 0) / max(v.get('decode_passes', 0), 1):.2f} vs "
                      f"{b.get('decode_steps', 0) / max(b.get('decode_passes', 0), 1):.2f}")
            here = [s for s in summary if s["max_tokens"] == mt and s["clients"] == cl]
            ll = next((s for s in here if s["engine"] == "llama-server"), None)
            for sp in (s for s in here if s["engine"].startswith("specrag") and ll):
                print(f"{mt:>4} tokens, {cl} clients: {sp['engine']}: TTFT p50 {sp['ttft_p50_s']:.1f} s vs "
                      f"{ll['ttft_p50_s']:.1f} s ({sp['ttft_p50_s'] / ll['ttft_p50_s']:.2f}x), p95 "
                      f"{sp['ttft_p95_s']:.1f} vs {ll['ttft_p95_s']:.1f} s ({sp['ttft_p95_s'] / ll['ttft_p95_s']:.2f}x), "
                      f"requests/min {sp['requests_per_min']:.2f} vs {ll['requests_per_min']:.2f} "
                      f"({sp['requests_per_min'] / ll['requests_per_min']:.2f}x), "
                      f"escalated {sp['escalated']}/{sp['requests']}, failed {sp['failed']} and "
                      f"{ll['failed']}")

if __name__ == "__main__":
    main()
