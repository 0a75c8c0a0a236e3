"""Moving a micro-batch from host memory to the device.

On CUDA a copy from pageable host memory is synchronous: the host waits for it, and the driver
stages it through a pinned buffer of its own. Pinned (page-locked) memory lets the copy run
asynchronously on the current stream, ordered before the kernels that read it, so the host goes
on queueing the forward pass. The pinned staging tensor comes from torch's caching host
allocator, which records the copy's stream and reuses the block only once the copy is done, so
it may be dropped as soon as the copy is queued. On the CPU there is nothing to move.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: from the host to CUDA pinned and without blocking; ``t`` itself when
    it is there already (the CPU: the worker's data never leaves the host)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)  # ``.to`` returns ``t`` itself when nothing changes
