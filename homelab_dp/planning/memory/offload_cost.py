"""What offloading costs: the PCIe link, its seconds per step and the expected slowdown (pure).

The memory model (`homelab_dp.planning.memory.device_memory.budget`) says how many bytes a device pins in host RAM
and moves over PCIe per optimizer step; this turns them into time:

- the link is the slowest planned card's PCIe link from the probe (`PlanDevice.pcie_gen`,
  ``pcie_width``: per lane about 0.985 GB/s gen 3, 1.969 gen 4, 3.938 gen 5), at
  `PCIE_EFFICIENCY`; a card whose link is not known (a what-if ``--gpus 2x24GiB``) is assumed
  on PCIe 4.0 x16, and the cost says it is assumed;
- the step's compute time is its model FLOPs (`homelab_dp.planning.flops`) at `ASSUMED_MFU` of the
  slowest card's dense 16-bit peak; where a card's peak is not known only the transfer time is
  given (``slowdown`` None);
- the slowdown is (compute + transfer) / compute: no overlap of copies and compute is assumed,
  so it is an upper bound (FSDP2 prefetches the next unit while the current one computes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from homelab_dp.byte_units import format_bytes
from homelab_dp.planning.flops import causal_span, flops_per_token, peak_flops
from homelab_dp.planning.memory.device_memory import Budget
from homelab_dp.planning.memory.train_shape import TrainShape, lora_targets_of
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.planning.plan_hardware import PlanHardware
from homelab_dp.probe.hardware import pcie_bytes_per_s

PCIE_EFFICIENCY = 0.8
"""Assumed share of a PCIe link's line rate that pinned host copies reach."""
ASSUMED_LINK = (4, 16)
"""The link of a card whose link is not known: PCIe 4.0 x16."""
ASSUMED_MFU = 0.35
"""Assumed model FLOPs utilisation of a step, to estimate its compute time."""

OFFLOAD_WORDS = {
    "optimizer": "the optimizer state in host RAM (the step on the CPU)",
    "params": "the sharded weights, gradients and optimizer state in host RAM "
    "(FSDP2 CPU offload; the step on the CPU)",
}
"""Plain words for `train.offload`'s values that move something."""


@dataclass(frozen=True)
class Link:
    """The PCIe link offloaded copies cross."""

    gen: int
    width: int
    assumed: bool

    @property
    def words(self) -> str:
        return f"PCIe {self.gen}.0 x{self.width}"

    @property
    def bytes_per_s(self) -> float:
        return pcie_bytes_per_s(self.gen, self.width, PCIE_EFFICIENCY)


def plan_link(hw: PlanHardware) -> Link:
    """The slowest planned card's link; a card without a known link counts as `ASSUMED_LINK`."""
    links = [
        ((d.pcie_gen, d.pcie_width), False) if d.pcie_gen and d.pcie_width else (ASSUMED_LINK, True)
        for d in hw.devices
    ]
    (gen, width), _ = min(links, key=lambda x: pcie_bytes_per_s(*x[0]))
    return Link(gen, width, any(assumed for _, assumed in links))


@dataclass(frozen=True)
class OffloadCost:
    """The ``offload_cost`` block of `plan --json` (one device, one optimizer step)."""

    host_bytes_per_device: int
    """Pinned host RAM this device's rank holds for what is offloaded."""
    pcie_bytes_per_step: int
    pcie_seconds_per_step: float
    slowdown: float | None
    """(compute + transfer) / compute; None where the card's compute peak is not known."""
    link: str
    """The link in words ("PCIe 4.0 x16"), or why nothing crosses one (the CPU)."""
    assumed: bool
    """Whether the link is assumed (not known from the probe)."""
    compute_seconds_per_step: float | None = None
    """The step's estimated compute time (`ASSUMED_MFU` of the card's peak), when known."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def step_compute_seconds(spec: ModelSpec, shape: TrainShape, hw: PlanHardware) -> float | None:
    """One optimizer step's compute time on the slowest card at `ASSUMED_MFU`; None where a
    card's dense 16-bit peak is not known (a what-if card, a name the table lacks)."""
    peaks = [peak_flops(d.name) for d in hw.devices]
    if not peaks or any(p is None for p in peaks):
        return None
    per_token = flops_per_token(
        spec,
        method=shape.method,
        activation_checkpointing=shape.activation_checkpointing,
        attention_span=causal_span(shape.seq_len),
        lora_r=shape.lora_r,
        lora_targets=lora_targets_of(shape),
    )
    tokens = shape.micro_batch * shape.seq_len * shape.grad_accum
    return per_token * tokens / (min(p for p in peaks if p) * ASSUMED_MFU)


def offload_cost(
    spec: ModelSpec, shape: TrainShape, b: Budget, hw: PlanHardware
) -> OffloadCost | None:
    """What ``shape``'s offload costs per device and step; None when nothing is offloaded.

    On the CPU offload moves nothing (the device memory is host RAM): a zero cost.
    """
    if shape.offload == "none" and not shape.offload_activations:
        return None
    if hw.kind != "cuda":
        return OffloadCost(0, 0, 0.0, 1.0, "none (on the CPU the device memory is host RAM)", False)
    link = plan_link(hw)
    seconds = b.pcie_bytes_per_step / link.bytes_per_s
    compute = step_compute_seconds(spec, shape, hw)
    slowdown = (compute + seconds) / compute if compute else None
    return OffloadCost(b.offload_host_bytes, b.pcie_bytes_per_step, seconds, slowdown,
                       link.words, link.assumed, compute)  # fmt: skip


def seconds(x: float) -> str:
    """A few seconds for people: 36, 1.4, 0.05."""
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def offload_words(offload: str, activations: bool) -> str:
    """What is offloaded, in words ("" for nothing)."""
    parts = [OFFLOAD_WORDS[offload]] if offload in OFFLOAD_WORDS else []
    if activations:
        parts.append("the activations saved for backward in host RAM")
    return " and ".join(parts)


def cost_words(cost: OffloadCost) -> str:
    """ "20.1 GiB of pinned host RAM per device, 36.0 GiB over PCIe per step (PCIe 4.0 x16,
    assumed) ≈ +1.4 s per step (~1.04× slower)"."""
    if cost.pcie_bytes_per_step == 0 and cost.host_bytes_per_device == 0:
        return f"nothing moves: {cost.link}"
    link = cost.link + (", assumed" if cost.assumed else "")
    out = (
        f"{format_bytes(cost.host_bytes_per_device)} of pinned host RAM per device, "
        f"{format_bytes(cost.pcie_bytes_per_step)} over PCIe per step ({link}) "
        f"≈ +{seconds(cost.pcie_seconds_per_step)} s per step"
    )
    if cost.slowdown is None:
        return out + " (the card's compute peak is not known: no slowdown estimate)"
    return out + f" (~{cost.slowdown:.2f}× slower at an assumed {ASSUMED_MFU:.0%} MFU)"
