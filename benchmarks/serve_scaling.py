"""Replica parallelism measured: the same concurrent load on `serve` with 1 and 2 replicas.

    python benchmarks/serve_scaling.py [--model FOLDER] [--replicas 1 2] [--clients 16]
        [--requests 64] [--tokens 32] [--hidden 384] [--layers 6]

Starts the real `homelab-dp serve MODEL --gpus cpu:N` (N CPU replica processes, the cores
shared between them) for each N, waits for their ready lines, sends each a warm-up round, then
``--rounds`` times, alternating between the servers, has ``--clients`` concurrent clients send
``--requests`` completions of ``--tokens`` tokens at temperature 0 through the OpenAI API
(only one server is loaded at a time; the idle one uses no CPU), and prints requests/s,
generated tokens/s (from the answers' usage), p50/p95 latency of each N's median round, and
the ratio of the last N to the first.
Each replica decodes up to ``--max-batch`` sequences together (the replica's default, 8 on
the CPU): with 16 clients, 2 replicas also have twice the batch slots of 1; ``--max-batch 16``
gives one replica the same slots, so the ratio is the processes' alone.

Without ``--model`` it serves a seeded random LLaMA-style model (``--hidden``, ``--layers``,
the demo tokenizer) made in a temporary folder: big enough that a token costs real compute,
and random, so no answer stops early at an end-of-text token (every request does the same work).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "assets" / "models" / "tiny-llama"
PROMPTS = ["Hello", "The capital of", "The river", "About", "There are", "If you take", "In"]


def make_model(folder: Path, hidden: int, layers: int) -> Path:
    """A seeded random model with the demo tokenizer (torch is imported only here)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: random LLaMA, hidden {hidden}, {layers} layers, {params / 1e6:.1f}M params")
    return folder


def start(
    model: Path, replicas: int, log: Path, max_batch: int | None
) -> tuple[subprocess.Popen[bytes], int]:
    """`homelab-dp serve` on N CPU replicas, once it printed its ready line; and its port."""
    cmd = [sys.executable, "-m", "homelab_dp.cli", "serve", str(model)]
    cmd += ["--gpus", f"cpu:{replicas}", "--port", "0"]
    cmd += ["--max-batch", str(max_batch)] if max_batch else []
    out = log.with_suffix(".out")
    with open(out, "wb") as o, open(log, "wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, cwd=ROOT)
    while not out.read_text().strip():
        if proc.poll() is not None:
            raise SystemExit(log.read_text()[-3000:])
        time.sleep(0.2)
    line = out.read_text().strip()
    print(line)
    return proc, int(re.search(r":(\d+)/v1 ", line).group(1))


def complete(port: int, body: dict) -> tuple[float, int]:
    """(seconds, completion tokens) of one request through the OpenAI API."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    begin = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        doc = json.loads(resp.read())
    return time.perf_counter() - begin, doc["usage"]["completion_tokens"]


def drive(port: int, clients: int, requests: int, tokens: int) -> dict[str, float]:
    """``clients`` concurrent clients sending ``requests`` requests in all, one after another
    each; the figures of the whole load."""
    bodies = [
        {"prompt": PROMPTS[i % len(PROMPTS)] + f" {i}", "max_tokens": tokens, "temperature": 0}
        for i in range(requests)
    ]
    lock = threading.Lock()
    results: list[tuple[float, int]] = []

    def client() -> None:
        while True:
            with lock:
                if not bodies:
                    return
                body = bodies.pop()
            done = complete(port, body)
            with lock:
                results.append(done)

    begin = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    wall = time.perf_counter() - begin
    latencies = sorted(s for s, _ in results)
    return {
        "req_s": len(results) / wall,
        "tok_s": sum(t for _, t in results) / wall,
        "p50": statistics.median(latencies),
        "p95": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
        "tokens": sum(t for _, t in results),
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model folder (default: a random one)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--max-batch", type=int, help="per replica (default: the replica's, 8)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per N (median)")
    args = parser.parse_args()
    print(f"host: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; "
          f"load: {args.clients} clients, {args.requests} requests of {args.tokens} tokens, temperature 0; "
          f"max batch {args.max_batch or 'default'} per replica")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(Path(tmp) / "model", args.hidden, args.layers)
        servers = {}
        try:
            for n in args.replicas:
                servers[n] = start(model, n, Path(tmp) / f"serve-{n}.log", args.max_batch)
            for _, port in servers.values():
                drive(port, args.clients, args.clients, args.tokens)  # warm-up round
            # Rounds alternate between the servers, so a change in the machine's other load
            # falls on both; each N's figures are its median round (by requests/s).
            runs: dict[int, list[dict[str, float]]] = {n: [] for n in args.replicas}
            for _ in range(args.rounds):
                for n, (_, port) in servers.items():
                    runs[n].append(drive(port, args.clients, args.requests, args.tokens))
        finally:
            for proc, _ in servers.values():
                proc.send_signal(signal.SIGTERM)
            for proc, _ in servers.values():
                proc.wait(60)
    rows = {n: sorted(r, key=lambda x: x["req_s"])[len(r) // 2] for n, r in runs.items()}
    print(f"\n{'replicas':>8} {'req/s':>7} {'tok/s':>8} {'p50 s':>7} {'p95 s':>7} {'tokens':>7}")
    for n, r in rows.items():
        print(f"{n:>8} {r['req_s']:>7.2f} {r['tok_s']:>8.1f} {r['p50']:>7.2f} {r['p95']:>7.2f} "
              f"{r['tokens']:>7}")  # fmt: skip
    first, last = rows[args.replicas[0]], rows[args.replicas[-1]]
    print(f"\n{args.replicas[-1]} vs {args.replicas[0]} replicas: "
          f"requests/s x{last['req_s'] / first['req_s']:.2f}, "
          f"tokens/s x{last['tok_s'] / first['tok_s']:.2f}, "
          f"p50 latency x{last['p50'] / first['p50']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
