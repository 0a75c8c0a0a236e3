"""The CPU's link between training processes: gloo all-reduce bandwidth and latency on this host.

``python -m homelab_dp.train.parallelism.gloo_bandwidth`` forks two processes that join a gloo process
group through a file store in a private temporary folder (no port is opened), time all-reduces
of a few sizes, and print one JSON line: ``{"bytes_per_s", "latency_s", "world_size",
"sizes": {bytes: seconds}, "seconds"}``. ``bytes_per_s`` is what each process sends a second
with the ring factor counted (2(N−1)/N × the tensor's bytes ÷ the all-reduce's time): the same
measure the time model divides its bytes by (`homelab_dp.planning.time_model.comm_parts`).

The plan runs it once per host and torch version in a child process and caches the answer
(`homelab_dp.planning.links.write_cached_gloo`), so the CLI never imports torch. Fork keeps it
fast (torch is imported once): about 2–3 s on a small host.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SIZES = (1 << 20, 8 << 20, 32 << 20)
"""Bytes of the all-reduced tensors: the largest sets the bandwidth (DDP's buckets are 25 MiB)."""
REPEATS = 3
LATENCY_REPEATS = 20
TIMEOUT_S = 60.0


def _worker(rank: int, world: int, store_path: str, out: Any) -> None:
    """One process: join, time the all-reduces, rank 0 sends the figures."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        one = torch.zeros(1)
        dist.all_reduce(one)
        t0 = time.perf_counter()
        for _ in range(LATENCY_REPEATS):
            dist.all_reduce(one)
        latency = (time.perf_counter() - t0) / LATENCY_REPEATS
        seconds: dict[int, float] = {}
        for size in SIZES:
            x = torch.ones(size // 4)
            dist.all_reduce(x)  # warm: gloo allocates its buffers on first use
            times = []
            for _ in range(REPEATS):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t0)
            seconds[size] = min(times)
        if rank == 0:
            out.put({"latency_s": latency, "sizes": seconds})
    finally:
        dist.destroy_process_group()


def measure(world: int = 2) -> dict[str, Any]:
    """Fork ``world`` processes, time gloo all-reduces between them, and return the figures."""
    t0 = time.perf_counter()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="homelab-dp-gloo-") as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_worker, args=(r, world, store, out)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            doc = out.get(timeout=TIMEOUT_S)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    ring = 2 * (world - 1) / world
    top = max(doc["sizes"])
    rate = ring * top / max(doc["sizes"][top], 1e-9)
    return {
        "bytes_per_s": rate,
        "latency_s": doc["latency_s"],
        "world_size": world,
        "sizes": {str(k): v for k, v in doc["sizes"].items()},
        "seconds": time.perf_counter() - t0,
        "torch": torch.__version__,
    }


def main() -> int:
    """Print the measurement as one JSON line."""
    print(json.dumps(measure()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
