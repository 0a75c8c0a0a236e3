"""Run events (``events.jsonl``) and the per-step statistics gathered from every rank.

Rank 0 appends one JSON object a line, each with ``"type"`` and ``"time"`` (unix seconds), and
flushes every line because the controller tails the file. Types:

- ``start``: run_id, world_size, method, distribution, device, dtype, total_steps, start_step,
  resumed_from, params, trainable_params, micro_batch, grad_accum, effective_batch, seq_len,
  tokens_per_step (effective batch × seq_len), samples (blocks in the data set), pids (one per
  rank), peak_memory_kind, and ``estimate`` (the plan's per_device_bytes) when the plan has one.
- ``step`` (every ``train.log_every`` steps and on the last): step, total_steps, epoch, loss (the
  token-weighted mean over the effective batch, over all ranks), lr, grad_norm, tokens_per_s,
  samples_per_s, micro_batch, grad_accum, world_size, effective_batch, step_time_s,
  rank_step_times_s, peak_memory_bytes (one per rank), peak_memory_kind, tokens (cumulative,
  non-padding input tokens), samples (cumulative).
- ``micro`` (only when grad_accum > 1): step (the optimizer step in progress, 1-based),
  micro_step (1..grad_accum done), grad_accum — gradient-accumulation progress, no sync.
- ``checkpoint``: step, path, seconds.
- ``end``: reason (completed | stopped), loss, steps, seconds, final_path (null when stopped).
- ``error``: message, rank, kind (exception class). Any rank may write it (a single O_APPEND
  write, so lines never interleave).
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class EventLog:
    """Appends events to ``events.jsonl``; a no-op on ranks other than 0 unless ``force``."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def emit(self, event_type: str, /, force: bool = False, **fields: Any) -> dict[str, Any]:
        """Write one event line (flushed at once) and return it; ``force`` writes on any rank."""
        event = {"type": event_type, "time": time.time(), **fields}
        if self.enabled or force:
            line = (json.dumps(event, default=_jsonable) + "\n").encode("utf-8")
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)  # one write per line: atomic with O_APPEND
            finally:
                os.close(fd)
        return event


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
