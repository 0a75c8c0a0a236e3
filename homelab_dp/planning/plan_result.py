"""The planner's answer: `Fit` (the micro-batch finder's answer for one option), `Candidate`
(one option and its budget), `Plan`, and the `plan --json` document they write (pure). The planner (`homelab_dp.planning.planner`) makes them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from homelab_dp.planning.batch_shape import BatchShape
from homelab_dp.planning.memory.device_memory import Budget, assumed_overhead
from homelab_dp.planning.memory.host_memory import HostBudget
from homelab_dp.planning.memory.memory_calibration import (
    HardwareCalibration,
    Measurement,
    calibration_json,
)
from homelab_dp.planning.memory.offload_cost import OffloadCost
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.planning.objective_cost import ObjectiveCost
from homelab_dp.planning.plan_hardware import PlanHardware
from homelab_dp.planning.plan_reasons import LrAdvice
from homelab_dp.planning.seq_len_finder import SeqLenFinder
from homelab_dp.planning.time_model import Prediction

if TYPE_CHECKING:
    from homelab_dp.planning.grpo_plan import GrpoMemory


@dataclass(frozen=True)
class Fit:
    """The finder's answer for one (method, distribution, checkpointing) option."""

    micro_batch: int
    grad_accum: int
    world_size: int
    requested_effective_batch: int
    total_bytes: int
    """Per-device total (tensors and overhead) at the chosen micro-batch."""
    limit_bytes: int
    """What a device may use: its memory times the safety margin."""
    fits: bool
    tried: tuple[tuple[int, int, bool], ...] = ()
    """(micro-batch, per-device total, fits) for every micro-batch budgeted."""
    larger_inexact: int | None = None
    """A larger micro-batch that fits but would round the effective batch up (exact mode)."""

    @property
    def batch(self) -> BatchShape:
        """The batch found (``world_size``: the data ranks it was searched on)."""
        return BatchShape(self.micro_batch, self.world_size, self.grad_accum)

    @property
    def effective_batch(self) -> int:
        return self.batch.effective

    @property
    def exact(self) -> bool:
        """Whether the effective batch is exactly the one the preset asked for."""
        return self.effective_batch == self.requested_effective_batch

    def describe(self) -> str:
        """One plain-words line for the plan's reasons."""
        if not self.fits:
            return (
                "Micro-batch finder: not even a micro-batch of 1 fits "
                f"({self.total_bytes / 2**30:.2f} GiB per device against "
                f"{self.limit_bytes / 2**30:.2f} GiB usable)."
            )
        out = (
            f"Micro-batch finder: {self.micro_batch} is the largest micro-batch that fits "
            f"({self.total_bytes / 2**30:.2f} of {self.limit_bytes / 2**30:.2f} GiB usable per "
            f"device); accumulation {self.grad_accum} gives an effective batch of "
            f"{self.effective_batch}"
        )
        if self.exact:
            out += ", as the preset asked."
            if self.larger_inexact:
                m = self.larger_inexact
                e = BatchShape.reaching(
                    self.requested_effective_batch, m, self.world_size
                ).effective
                out += f" ({m} would fit too, but would round the effective batch up to {e}.)"
            return out
        return (
            out + f" — the preset asked for {self.requested_effective_batch}, which "
            f"{self.micro_batch} × {self.world_size} device(s) does not divide, so it is "
            "rounded up to the next multiple."
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "effective_batch": self.effective_batch,
            "requested_effective_batch": self.requested_effective_batch,
            "exact": self.exact,
            "fits": self.fits,
            "total_bytes": self.total_bytes,
            "limit_bytes": self.limit_bytes,
            "largest_tried": max((m for m, _, _ in self.tried), default=self.micro_batch),
            "larger_inexact": self.larger_inexact,
        }


SAFETY_MARGIN = 0.95
"""A plan fits when its total is at most this fraction of the smallest device's memory (and,
on a local card others use, at most its free memory less a margin: `PlanHardware.budget`)."""


@dataclass(frozen=True)
class Candidate:
    """One (method, distribution, checkpointing) option with its budget."""

    method: str
    distribution: str
    activation_checkpointing: bool
    budget: Budget
    fits: bool
    supported: bool = True
    note: str = ""
    offload: str = "none"
    """`train.offload` of this option: none | optimizer | params (what the run resolves to)."""
    offload_activations: bool = False
    """Saved activations in pinned host RAM (`homelab_dp.train.parallelism.activation_offload`)."""
    offload_cost: OffloadCost | None = None
    """Host RAM, PCIe traffic and expected slowdown of the offload; None when none."""
    predicted: Prediction | None = None
    """The time model's step seconds, tokens/s and scaling (`homelab_dp.planning.speed_plan`);
    None until predicted, and for an option the worker cannot train here."""
    tiled_mlp: bool = False
    """Each decoder layer's MLP in tiles along the sequence (`train.tiled_mlp`,
    `homelab_dp.planning.memory.mlp_tiles`): what the run resolves it to."""

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "distribution": self.distribution,
            "activation_checkpointing": self.activation_checkpointing,
            "fits": self.fits,
            "supported": self.supported,
            "peak_phase": self.budget.peak_phase,
            "phase_tensor_bytes": dict(self.budget.phases),
            "per_device_bytes": self.budget.per_device_bytes(),
            "comm_bytes_per_step": self.budget.comm_bytes_per_step,
            "note": self.note,
            "offload": self.offload,
            "offload_activations": self.offload_activations,
            "offload_cost": self.offload_cost.to_json() if self.offload_cost else None,
            "predicted": self.predicted.to_json() if self.predicted else None,
            "tiled_mlp": self.tiled_mlp,
        }


@dataclass(frozen=True)
class Plan:
    """The planner's answer."""

    spec: ModelSpec
    hardware: PlanHardware
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    micro_batch: int
    grad_accum: int
    seq_len: int
    dtype: str
    lr: LrAdvice
    reasons: tuple[str, ...]
    advice: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = field(default=())
    calibration: HardwareCalibration | None = None
    """What was measured on this hardware (None: nothing looked up, e.g. in tests)."""
    measured: Measurement | None = None
    """A measurement of exactly the chosen configuration on this hardware, if there is one."""
    fit: Fit | None = None
    """The micro-batch finder's answer, when it chose the micro-batch."""
    host: HostBudget | None = None
    """Host RAM of loading, saving and merging (`with_host`); None: not looked at."""
    idle: Candidate | None = None
    """What the plan would choose on the same cards idle, when other processes hold memory
    that cuts a card's budget (None: every card budgeted whole, or nothing held)."""
    objective: ObjectiveCost | None = None
    """What a preference objective (dpo, orpo, kto) costs in the chosen option: the resolved
    reference, the rows of a micro-batch, the extra no-grad forwards (None for sft)."""
    grpo: GrpoMemory | None = None
    """What GRPO adds to a rank's memory in the chosen option (`homelab_dp.planning.grpo_plan`;
    its time is in the prediction's ``generation_*`` fields); None for other objectives."""
    seq_len_finder: SeqLenFinder | None = None
    """`plan --find-seq-len`'s answer: the longest data.seq_len that fits, per candidate, what
    limits it and what would lift it (`homelab_dp.planning.seq_len_finder`); None: not asked."""
    speed_advice: tuple[str, ...] = ()
    """What the time model says of the chosen option's speed and scaling, in words
    (`homelab_dp.planning.speed_plan`); `plan --json` lists it after `advice`."""
    sequence_parallel: int = 1
    """Ranks every sequence is split over (1: whole sequences; `planning.sequence_split`)."""

    @property
    def fits(self) -> bool:
        """The chosen option fits the devices, and the machine's RAM holds its host peaks."""
        return self.chosen.fits and (self.host is None or self.host.fits)

    @property
    def fits_when_idle(self) -> bool:
        """The run would fit once the other processes on its cards are gone (True when it
        fits now: an idle card budgets at least as much)."""
        idle_fits = self.idle.fits if self.idle is not None else self.chosen.fits
        return (self.chosen.fits or idle_fits) and (self.host is None or self.host.fits)

    @property
    def world_size(self) -> int:
        return self.hardware.world_size

    @property
    def batch(self) -> BatchShape:
        """The planned batch: only the data ranks (world / sequence-parallel degree) take
        blocks of their own."""
        return BatchShape.of(self.micro_batch, self.world_size, self.grad_accum,
                             self.sequence_parallel)  # fmt: skip

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step (`batch`)."""
        return self.batch.effective

    def to_json(self) -> dict[str, Any]:
        """The `plan --json` document.

        Its field names are an interface, not internals: the renderer and the TUI read them,
        scripts read `plan --json`, and each run's spec carries the document.
        """
        b = self.chosen.budget
        return {
            "model": {**self.spec.summary(), "trainable_params": b.trainable_params},
            "hardware": {
                "kind": self.hardware.kind,
                "source": self.hardware.source,
                "devices": [
                    {
                        "name": d.name,
                        "memory_bytes": d.memory_bytes,
                        "compute_capability": (
                            list(d.compute_capability) if d.compute_capability else None
                        ),
                        "free_bytes": d.free_bytes,
                        "budget_bytes": d.budget(SAFETY_MARGIN),
                        "processes": [asdict(p) for p in d.processes or ()],
                    }
                    for d in self.hardware.devices
                ],
            },
            "training": {
                "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum,
                "world_size": self.world_size,
                "effective_batch": self.effective_batch,
                "seq_len": self.seq_len,
                "sequence_parallel": self.sequence_parallel,
                "activation_checkpointing": self.chosen.activation_checkpointing,
                "dtype": self.dtype,
            },
            "method": self.chosen.method,
            "distribution": self.chosen.distribution,
            "fits": self.fits,
            "fits_when_idle": self.fits_when_idle,
            "peak_phase": b.peak_phase,
            "phase_tensor_bytes": dict(b.phases),
            "per_device_bytes": b.per_device_bytes(),
            "comm_bytes_per_step": b.comm_bytes_per_step,
            "offload": self.chosen.offload,
            "offload_activations": self.chosen.offload_activations,
            "tiled_mlp": self.chosen.tiled_mlp,
            "offload_cost": cost.to_json() if (cost := self.chosen.offload_cost) else None,
            "lr": self.lr.to_json(),
            "candidates": [c.to_json() for c in self.candidates],
            "reasons": list(self.reasons),
            "advice": [*self.advice, *self.speed_advice],
            "assumptions": list(self.assumptions),
            "calibration": self._calibration_json(),
            "micro_batch_finder": self.fit.to_json() if self.fit else None,
            "seq_len_finder": f.to_json() if (f := self.seq_len_finder) else None,
            "host": self.host.to_json() if self.host else None,
            "predicted": pred.to_json() if (pred := self.chosen.predicted) else None,
            "objective": self.objective.to_json() if self.objective else None,
            "grpo": self._grpo_json(),
        }

    def _grpo_json(self) -> dict[str, Any] | None:
        """GRPO's memory and generation time in the chosen option, None for other objectives."""
        if self.grpo is None:
            return None
        pred = self.chosen.predicted
        timing = {"generation_seconds": pred.generation_seconds,
                  "generation_share": pred.generation_share,
                  "generated_tokens_per_s": pred.generated_tokens_per_s} if pred else {}  # fmt: skip
        return {**self.grpo.to_json(), **timing}

    def _calibration_json(self) -> dict[str, Any]:
        """Which numbers are measured on this hardware and which are estimated or assumed."""
        ov = assumed_overhead(self.hardware.kind, self.world_size)
        return calibration_json(self.calibration, self.measured, self.chosen.budget, ov)
