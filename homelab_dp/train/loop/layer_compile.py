"""Compiled decoder layers (``train.compile``): a speed switch that changes no result beyond
rounding (TF32, the other such switch, is `train.loop.tf32`).

``train.compile`` compiles each decoder layer with ``torch.compile`` (``Module.compile``, in
place, so parameter names, FSDP2's per-layer units and activation checkpointing are
unchanged). One layer class compiles once and is reused by every layer. The gain is fused
elementwise work (norms, rotary embeddings, SiLU·up, residual adds): typically 10–25% more
tokens/s on a consumer card and less activation memory; the cost is a compile of seconds to a
few minutes in the first steps. ``auto`` turns it on only where it is well trodden (CUDA, full
and LoRA fine-tunes, Triton installed) and lets a layer that cannot compile run eagerly;
``true`` compiles everywhere and fails loudly.
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
