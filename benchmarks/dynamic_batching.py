"""Dynamic batching in one replica: the same concurrent load with --max-batch 1 and 8.

    python benchmarks/dynamic_batching.py [--model assets/models/tiny-llama] [--requests 8]
        [--tokens 32] [--rounds 3] [--threads 2] [--batches 1 8]

Starts one real replica process on the CPU per batch size (`python -m homelab_dp.serving.replica.transformers_replica`),
sends ``--requests`` concurrent ``/generate`` requests of ``--tokens`` tokens (sampled with
seeds 0..n-1 at temperature 0.8, so every run has the same work), ``--rounds`` times after a
warm-up round, and prints requests/s, generated tokens/s (counted from the answers' usage)
and the mean latency per batch size, then the ratio of the largest to the smallest.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Hello",
    "The capital of",
    "The river",
    "About",
    "There are",
    "If you take",
    "Mount",
    "In",
]


def start(model: str, state: Path, max_batch: int, threads: int, token: str) -> dict:
    """A replica with this batch size; its replica-0.json once it is ready."""
    log = open(state / "replica-0.log", "w")  # noqa: SIM115 - the child owns it
    cmd = [
        sys.executable,
        "-m",
        "homelab_dp.serving.replica.transformers_replica",
        "--model",
        model,
        "--device",
        "cpu",
    ]
    cmd += ["--id", "0", "--state-dir", str(state), "--max-batch", str(max_batch)]
    cmd += ["--threads", str(threads)]
    env = {**os.environ, "HOMELAB_DP_REPLICA_TOKEN": token, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    ready = state / "replica-0.json"
    while not ready.exists():
        if proc.poll() is not None:
            raise SystemExit((state / "replica-0.log").read_text()[-2000:])
        time.sleep(0.1)
    return {**json.loads(ready.read_text()), "proc": proc}


def generate(port: int, token: str, body: dict) -> tuple[float, int]:
    """(seconds, completion tokens) of one streamed request."""
    begin = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/generate", json.dumps(body), {"Authorization": f"Bearer {token}"})
    lines = conn.getresponse().read().decode().splitlines()
    conn.close()
    return time.perf_counter() - begin, json.loads(lines[-1])["usage"]["completion_tokens"]


def load(port: int, token: str, n: int, tokens: int) -> tuple[float, int, float]:
    """(wall seconds, tokens generated, mean latency) of n concurrent requests."""
    bodies = [
        {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0.8, "seed": i}
        for i in range(n)
    ]
    begin = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        done = list(pool.map(lambda b: generate(port, token, b), bodies))
    wall = time.perf_counter() - begin
    return wall, sum(t for _, t in done), sum(s for s, _ in done) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "assets" / "models" / "tiny-llama"))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    token = secrets.token_hex(16)
    rows = []
    for max_batch in args.batches:
        with tempfile.TemporaryDirectory() as tmp:
            replica = start(args.model, Path(tmp), max_batch, args.threads, token)
            try:
                load(replica["port"], token, args.requests, args.tokens)  # warm-up round
                runs = [
                    load(replica["port"], token, args.requests, args.tokens)
                    for _ in range(args.rounds)
                ]
            finally:
                replica["proc"].terminate()
                replica["proc"].wait()
        wall = sum(w for w, _, _ in runs)
        generated = sum(t for _, t, _ in runs)
        latency = sum(lat for _, _, lat in runs) / len(runs)
        rows.append((max_batch, args.requests * len(runs) / wall, generated / wall, latency))
    print(
        f"{args.requests} concurrent requests x {args.tokens} tokens, {args.rounds} rounds, "
        f"{Path(args.model).name} on {args.threads} CPU thread(s)"
    )
    print(f"{'max_batch':>9} {'requests/s':>11} {'tokens/s':>9} {'latency s':>10}")
    for max_batch, rps, tps, latency in rows:
        print(f"{max_batch:>9} {rps:>11.2f} {tps:>9.1f} {latency:>10.3f}")
    if len(rows) > 1:
        print(
            f"ratio (max_batch {rows[-1][0]} / {rows[0][0]}): {rows[-1][2] / rows[0][2]:.2f}x tokens/s"
        )


if __name__ == "__main__":
    main()
