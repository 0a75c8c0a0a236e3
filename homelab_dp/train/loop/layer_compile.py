"""Speed switches that change no result beyond rounding: compiled decoder layers and TF32.

- ``train.compile`` compiles each decoder layer with ``torch.compile`` (``Module.compile``, in
  place, so parameter names, FSDP2's per-layer units and activation checkpointing are
  unchanged). One layer class compiles once and is reused by every layer. The gain is fused
  elementwise work (norms, rotary embeddings, SiLU·up, residual adds): typically 10–25% more
  tokens/s on a consumer card and less activation memory; the cost is a compile of seconds to a
  few minutes in the first steps. ``auto`` turns it on only where it is well trodden (CUDA, full
  and LoRA fine-tunes, Triton installed) and lets a layer that cannot compile run eagerly;
  ``true`` compiles everywhere and fails loudly.
- TF32: on compute capability 8.0 and later, fp32 matmuls (what autocast leaves in fp32) run on
  the tensor cores with a 10-bit mantissa, several times faster. Only bf16/fp16 runs turn it on:
  their matmuls already run in 16-bit, and a run that asked for fp32 keeps full fp32.

Moving a micro-batch from host memory to the device.

On CUDA a copy from pageable host memory is synchronous: the host waits for it, and the driver
stages it through a pinned buffer of its own. Pinned (page-locked) memory lets the copy run
asynchronously on the current stream, ordered before the kernels that read it, so the host goes
on queueing the forward pass. The pinned staging tensor comes from torch's caching host
allocator, which records the copy's stream and reuses the block only once the copy is done, so
it may be dropped as soon as the copy is queued. On the CPU there is nothing to move.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

log = logging.getLogger("homelab_dp.worker")


def compile_wanted(setting: Any, device_type: str, method: str) -> bool:
    """Whether ``train.compile`` (auto | true | false) compiles on this device for this method."""
    if setting is True or setting is False:
        return setting
    triton = importlib.util.find_spec("triton") is not None
    return device_type == "cuda" and method in ("full", "lora") and triton


def compile_layers(layers: list[torch.nn.Module], *, strict: bool) -> int:
    """Compile each decoder layer in place; returns how many. ``strict`` False lets a layer
    that fails to compile run eagerly (``torch._dynamo.config.suppress_errors``)."""
    import torch._dynamo

    if not strict:
        torch._dynamo.config.suppress_errors = True
    # Every layer is the same code with other weights: one graph, not a recompile per layer.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers:
        layer.compile()
    return len(layers)


def enable_tf32(device: torch.device, dtype_name: str) -> bool:
    """TF32 matmuls on Ampere (8.0) and later for a bf16/fp16 run; returns whether enabled."""
    if device.type != "cuda" or dtype_name not in ("bf16", "fp16"):
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    return True


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: from the host to CUDA pinned and without blocking; ``t`` itself when
    it is there already (the CPU: the worker's data never leaves the host)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)  # ``.to`` returns ``t`` itself when nothing changes
