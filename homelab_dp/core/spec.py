"""The resolved run spec: the one JSON document the worker reads (`runs/<id>/spec.json`).

The front ends resolve everything the worker must not decide by itself — method, distribution,
activation checkpointing, dtype, device, world size, the learning rate after scaling — and the
worker reads only this file; it takes no pile of flags.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from homelab_dp.core.preset import Preset

SPEC_VERSION = 1


@dataclass(frozen=True)
class Resolved:
    """Decisions fixed before launch."""

    method: Literal["full", "lora", "qlora"]
    distribution: Literal["ddp", "zero1", "fsdp-grad-op", "fsdp-full"]
    activation_checkpointing: bool
    device: Literal["cpu", "cuda"]
    world_size: int
    """Processes over all nodes."""
    dtype: Literal["fp32", "bf16", "fp16"]
    """Compute dtype: fp32 everywhere on CPU; bf16/fp16 autocast over fp32 master weights on CUDA."""
    micro_batch: int
    grad_accum: int
    lr: float
    """Peak learning rate after any effective-batch scaling."""

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.world_size * self.grad_accum


def make_spec(
    preset: Preset,
    resolved: Resolved,
    run_id: str,
    plan: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The spec.json document. ``preset`` must already have absolute model and data paths."""
    return {
        "version": SPEC_VERSION,
        "run_id": run_id,
        "preset": preset.to_dict(),
        "preset_source": preset.source,
        "resolved": asdict(resolved),
        "plan": plan or {},
    }


def resolved_from_spec(spec: dict[str, Any]) -> Resolved:
    """Read the Resolved block back from a spec document."""
    return Resolved(**spec["resolved"])
