"""The worker's event writer (``events.jsonl``) and the per-step statistics of every rank.

Rank 0 appends one JSON object a line — a typed event of `homelab_dp.core.events` (start, micro,
step, straggler, warning, checkpoint, memory, end), its names and fields listed there — and
flushes every line because the controller tails the file. Any rank may write ``error``.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from homelab_dp.core.events import Event


class EventLog:
    """Appends events to ``events.jsonl``; a no-op on ranks other than 0 unless ``force``."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def write(self, event: Event, force: bool = False) -> dict[str, Any]:
        """Write one event line (flushed at once) and return its object; ``force`` writes on any
        rank (an error: a single O_APPEND write, so lines of several ranks never interleave)."""
        doc = event.to_json()
        if self.enabled or force:
            line = (json.dumps(doc, default=_jsonable) + "\n").encode("utf-8")
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)  # one write per line: atomic with O_APPEND
            finally:
                os.close(fd)
        return doc


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def peak_memory_kind(device: torch.device) -> str:
    """What ``peak_memory_bytes`` measures on this device."""
    return "cuda_max_allocated" if device.type == "cuda" else "process_rss_peak"


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: ``max_memory_allocated``. CPU: the process's peak resident set size.

    Peak live tensor bytes on the CPU would need a dispatch-mode tracker on every op, which costs
    far more than the 5% throughput budget; the RSS peak is free (one getrusage call).
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def all_gather_flat(out: torch.Tensor, mine: torch.Tensor) -> None:
    """Every rank's ``mine`` concatenated into ``out`` (torch 2.13 renamed the collective)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine)


class RankStats:
    """The one all-gather per logged step: loss sum, step time and peak memory of every rank."""

    FIELDS = 3

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.world = dist.get_world_size()

    def gather(self, loss_sum: torch.Tensor, step_time_s: float) -> list[list[float]]:
        """Rows ``[loss_sum, step_time_s, peak_memory_bytes]``, one per rank (every rank gets all)."""
        mine = torch.zeros(self.FIELDS, dtype=torch.float64, device=self.device)
        mine[0] = loss_sum.detach().to(torch.float64)
        mine[1] = step_time_s
        mine[2] = float(peak_memory_bytes(self.device))
        out = torch.empty(self.world * self.FIELDS, dtype=torch.float64, device=self.device)
        all_gather_flat(out, mine)
        return out.view(self.world, self.FIELDS).tolist()
