#!/usr/bin/env python3
"""The yardstick of every device run: the device's own PyTorch doing the work gpu_check times.

Random-weight Qwen2 models of the shapes gpu_check writes (Hugging Face's Qwen2.5 configs),
bf16 weights, SDPA attention, eager, built directly on the device; the same prompt layout
(a 16-token prefix, --chunks x --chunk tokens, a 32-token question):

- full prefill of the prompt (``logits_to_keep=1``: only the last row's logits), median of
  --runs after a warm-up;
- eager decode steps after it, one request and --batch requests together (each with its own
  cache of the prompt's length);
- a --long-token prefill at the first shape (0 skips it).

Writes --out (JSON) and logs to stderr. check.sh runs it beside gpu_check and prints
specrag's times as ratios of these (scripts/gpu/ratios.py). Random weights make the outputs
meaningless, not the times.

    python3 torch_anchor.py --out DIR/torch.json [--device cuda] [--shapes 1.5b,7b]
        [--chunk 512] [--chunks 4] [--runs 3] [--decode-steps 32] [--batch 16] [--long 32768]
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings

# (layers, width, heads, kv heads, ffn, vocabulary) as gpu_check's `TinySpec::qwen2_shape`.
SHAPES = {
    "small": (4, 256, 4, 2, 768, 4096),
    "0.5b": (24, 896, 14, 2, 4864, 151_936),
    "1.5b": (28, 1536, 12, 2, 8960, 151_936),
    "7b": (28, 3584, 28, 4, 18944, 152_064),
}
PREFIX, QUESTION = 16, 32


def log(msg):
    print(f"[torch_anchor {time.time() - STARTED:7.1f}s] {msg}", file=sys.stderr, flush=True)


STARTED = time.time()


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--shapes", default="1.5b,7b", help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--chunk", type=int, default=512, help="tokens per chunk")
    p.add_argument("--chunks", type=int, default=4, help="chunks in the prompt")
    p.add_argument("--runs", type=int, default=3, help="timed runs per figure (median)")
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--batch", type=int, default=16, help="requests decoded together")
    p.add_argument("--long", type=int, default=32768, help="long prefill at the first shape; 0 skips")
    a = p.parse_args(argv)
    shapes = [s for s in a.shapes.split(",") if s and s != "none"]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        p.error(f"--shapes: unknown {bad}; known: {', '.join(SHAPES)}")
    if min(a.chunk, a.chunks, a.runs, a.decode_steps, a.batch) < 1 or a.long < 0:
        p.error("--chunk, --chunks, --runs, --decode-steps and --batch must be at least 1, --long 0 or more")
    a.shapes = shapes
    return a


def model_of(shape, device, torch, transformers):
    layers, width, heads, kv_heads, ffn, vocab = SHAPES[shape]
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=65536,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
    return model.eval()


class Clock:
    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.startswith("cuda")

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def ms(self, f):
        self.sync()
        t = time.perf_counter()
        out = f()
        self.sync()
        return (time.perf_counter() - t) * 1e3, out


def prefill_ms(model, ids, runs, clock):
    model(ids, logits_to_keep=1, use_cache=True)  # warm-up
    times = [clock.ms(lambda: model(ids, logits_to_keep=1, use_cache=True))[0] for _ in range(runs)]
    return statistics.median(times)


def decode_ms(model, ids, steps, clock, torch):
    """Median ms of one eager decode step for ids' rows decoded together after their prompt."""
    out = model(ids, logits_to_keep=1, use_cache=True)
    cache = out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps + 1):
        ms, out = clock.ms(lambda: model(nxt, past_key_values=cache, use_cache=True))
        times.append(ms)
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
    return statistics.median(times[1:])


def memory_mib(torch, device):
    if not device.startswith("cuda"):
        return None
    return torch.cuda.max_memory_allocated() / (1 << 20)


def main(argv):
    a = parse(argv)
    # transformers 5 renames `past_key_values`; the old name keeps 4.x working too.
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import transformers

    transformers.logging.set_verbosity_error()

    clock = Clock(torch, a.device)
    report = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": a.device,
        "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None,
        "attention": "sdpa",
        "dtype": "bfloat16",
        "prompt_tokens": PREFIX + a.chunks * a.chunk + QUESTION,
        "shapes": {},
    }

    def write():
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)

    write()
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for shape in a.shapes:
            t = time.time()
            model = model_of(shape, a.device, torch, transformers)
            vocab = SHAPES[shape][5]
            log(f"{shape}: built in {time.time() - t:.1f}s")
            n = report["prompt_tokens"]
            ids = torch.randint(0, vocab, (1, n), generator=gen).to(a.device)
            full = prefill_ms(model, ids, a.runs, clock)
            one = decode_ms(model, ids, a.decode_steps, clock, torch)
            many_ids = torch.randint(0, vocab, (a.batch, a.chunk), generator=gen).to(a.device)
            many = decode_ms(model, many_ids, a.decode_steps, clock, torch)
            report["shapes"][shape] = {
                "full_prefill_ms": full,
                "decode_ms_per_step": one,
                "batched_decode": {
                    "requests": a.batch,
                    "prompt_tokens": a.chunk,
                    "ms_per_step": many,
                    "tokens_per_s": a.batch * 1e3 / many,
                },
                "memory_mib": memory_mib(torch, a.device),
            }
            log(
                f"{shape}: full prefill of {n} tokens {full:.1f} ms; eager decode {one:.2f} ms/step, "
                f"{a.batch} together {many:.2f} ms/step"
            )
            write()
            if shape == a.shapes[0] and a.long > 0:
                ids = torch.randint(0, vocab, (1, a.long), generator=gen).to(a.device)
                long_ms = prefill_ms(model, ids, max(1, a.runs - 1), clock)
                report["long_context"] = {"shape": shape, "tokens": a.long, "prefill_ms": long_ms}
                log(f"{shape}: {a.long}-token prefill {long_ms:.1f} ms")
                write()
            del model
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
    report["seconds"] = time.time() - STARTED
    write()


if __name__ == "__main__":
    main(sys.argv[1:])
