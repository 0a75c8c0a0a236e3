"""The run contract: `RunSpec`, the one document the worker, the keeper, the launcher and the
monitor read (``runs/<id>/spec.json``).

The controller resolves everything the worker must not decide by itself — method,
distribution, activation checkpointing, dtype, device, world size, the learning rate after
scaling, the devices and the rendezvous — builds one `RunSpec` and writes it into the run folder;
the worker takes no pile of flags. Pure: stdlib and `homelab_dp.presets.preset` only.

Format: version 2 keeps every top-level key of version 1 where it was (scripts read them) and
adds ``rendezvous``; `RunSpec.from_json` reads both, so run folders written before still resume.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from homelab_dp.hub.hub_models import ModelOrigin
from homelab_dp.presets.preset import Preset, preset_from_dict
from homelab_dp.vocabulary import Device, Distribution, Dtype, Method, Offload

RUN_SPEC_VERSION = 2
"""Written into every spec.json; 1 is the untyped document of earlier versions."""


MEASURED_STEPS = 3
"""Steps a `homelab-dp measure` run tracks memory on the CPU (`train.loop.memtrack`): the optimizer
state exists after the first, DDP rebuilds its buckets in the second, the third is steady;
later steps run untracked, at full speed, and give the speed `measure` records."""


@dataclass(frozen=True)
class Resolved:
    """Decisions fixed before launch."""

    method: Method
    distribution: Distribution
    activation_checkpointing: bool
    device: Device
    world_size: int
    """Processes over all nodes."""
    dtype: Dtype
    """Compute dtype: fp32 everywhere on CPU; bf16/fp16 autocast over fp32 master weights on CUDA."""
    micro_batch: int
    grad_accum: int
    lr: float
    """Peak learning rate after any effective-batch scaling."""
    offload: Offload = "none"
    """What FSDP keeps in host RAM (none | optimizer | params); none in specs written before."""
    offload_activations: bool = False
    """Saved activations in host RAM (`homelab_dp.train.parallelism.activation_offload`)."""
    sequence_parallel: int = 1
    """Ranks per sequence (`homelab_dp.train.parallelism.sequence_parallel`; 1: off): the world is data
    ranks × this, and only the data ranks take blocks of their own."""

    tiled_mlp: bool = False
    """Each decoder layer's MLP in tiles along the sequence (`homelab_dp.train.model.tiled_mlp`):
    the planner's decision for `train.tiled_mlp`; False in specs written before."""

    @property
    def data_world(self) -> int:
        """Data-parallel ranks: the world size over the sequence-parallel degree."""
        return max(1, self.world_size // max(1, self.sequence_parallel))

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.data_world * self.grad_accum


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: torchrun's c10d rendezvous (single node: the defaults, on loopback)."""

    nnodes: int = 1
    node_rank: int = 0
    """This machine's number, 0..nnodes-1."""
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    """None on a single node: the kernel picks a free port at bind time."""


@dataclass(frozen=True)
class Launch:
    """How the run is started on this machine."""

    nproc_per_node: int
    """Worker processes on this machine (world size / nodes)."""
    gpu_indices: tuple[int, ...] = ()
    """The planned GPUs by NVML index; empty on the CPU."""
    rendezvous: Rendezvous = field(default_factory=Rendezvous)
    gpu_uuids: tuple[str, ...] = ()
    """The same GPUs by NVML UUID, one per index (empty: not known, or a spec written before
    this field); the launcher prefers them for CUDA_VISIBLE_DEVICES."""


@dataclass(frozen=True)
class Retry:
    """One automatic resume after out-of-memory (`run --auto-fit`)."""

    time: float
    before: tuple[int, int, bool]
    """(micro_batch, grad_accum, activation_checkpointing) before the change."""
    after: tuple[int, int, bool]


@dataclass(frozen=True)
class RunSpec:
    """Everything a run is: the resolved preset, the plan and how it is launched."""

    run_id: str
    preset: Preset
    """The preset with absolute model and data paths and the resolved values applied."""
    resolved: Resolved
    launch: Launch
    plan: dict[str, Any] = field(default_factory=dict)
    """The plan it was made from, as `plan --json` prints it (estimate and reasons)."""
    blocks: int = 0
    """Training blocks the preflight counted (checked again by the worker)."""
    auto_fit: bool = False
    """After out-of-memory the keeper resumes with the worker's proposal by itself."""
    collective_timeout_s: float | None = None
    """None: the worker's default (60 s on CPU, 600 s on CUDA)."""
    resume: bool = False
    """Continue from the newest complete checkpoint."""
    measure_steps: int = 0
    """`homelab-dp measure`: probe memory for this many steps, no checkpoint or result."""
    retries: tuple[Retry, ...] = ()
    model_origin: ModelOrigin | None = None
    """The Hugging Face id the model came from (None: a local folder was given)."""
    sweep_id: str | None = None
    """The `homelab-dp sweep` this run is a point of (None: a run of its own)."""
    sweep_point: dict[str, Any] = field(default_factory=dict)
    """The grid values of this point, by dotted preset key ({} outside a sweep)."""
    notify: str | None = None
    """`--notify CMD`: the user's command the keeper runs once when the run ends ("desktop":
    notify-send); None: ``notify.command`` of the user's config file, if any. Kept on resume."""

    @property
    def planned_bytes(self) -> dict[str, int]:
        """The plan's per-device estimate by component ({} when there is no plan)."""
        return dict(self.plan.get("per_device_bytes") or {})

    def resumed(self) -> RunSpec:
        """This spec, set to continue from its newest checkpoint."""
        return replace(self, resume=True)

    def relaunched(self, rendezvous: Rendezvous) -> RunSpec:
        """This spec, resuming, with the rendezvous of a new launch (`resume` on any node)."""
        return replace(self, resume=True, launch=replace(self.launch, rendezvous=rendezvous))

    def with_batch(self, micro_batch: int, grad_accum: int, checkpointing: bool) -> RunSpec:
        """The out-of-memory retry: a new batch split (same effective batch), resuming."""
        before = (self.resolved.micro_batch, self.resolved.grad_accum,
                  self.resolved.activation_checkpointing)  # fmt: skip
        after = (micro_batch, grad_accum, checkpointing)
        resolved = replace(self.resolved, micro_batch=micro_batch, grad_accum=grad_accum,
                           activation_checkpointing=checkpointing)  # fmt: skip
        train = replace(self.preset.train, micro_batch=micro_batch, grad_accum=grad_accum,
                        activation_checkpointing=checkpointing)  # fmt: skip
        return replace(self, resolved=resolved, preset=replace(self.preset, train=train),
                       resume=True, retries=(*self.retries, Retry(time.time(), before, after)))  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """The spec.json document."""
        out: dict[str, Any] = {
            "version": RUN_SPEC_VERSION,
            "run_id": self.run_id,
            "preset": self.preset.to_dict(),
            "preset_source": self.preset.source,
            "resolved": asdict(self.resolved),
            "plan": self.plan,
            "gpu_indices": list(self.launch.gpu_indices),
            "gpu_uuids": list(self.launch.gpu_uuids),
            "nproc_per_node": self.launch.nproc_per_node,
            "rendezvous": asdict(self.launch.rendezvous),
            "blocks": self.blocks,
            "auto_fit": self.auto_fit,
            "resume": self.resume,
            "measure_steps": self.measure_steps,
            "retries": [
                {"time": r.time, "from": list(r.before), "to": list(r.after)} for r in self.retries
            ],
        }
        if self.collective_timeout_s:
            out["collective_timeout_s"] = self.collective_timeout_s
        if self.model_origin is not None:
            out["model_origin"] = asdict(self.model_origin)
        if self.sweep_id:
            out["sweep"] = {"id": self.sweep_id, "point": dict(self.sweep_point)}
        if self.notify:
            out["notify"] = self.notify
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSpec:
        """Read a spec.json document of any version (1 had no version, rendezvous or retries
        in typed form; missing keys take their defaults)."""
        resolved = Resolved(**data["resolved"])
        rendezvous = Rendezvous(**(data.get("rendezvous") or {}))
        launch = Launch(
            nproc_per_node=int(data.get("nproc_per_node") or resolved.world_size),
            gpu_indices=tuple(data.get("gpu_indices") or ()),
            rendezvous=rendezvous,
            gpu_uuids=tuple(data.get("gpu_uuids") or ()),
        )
        retries = tuple(
            Retry(float(r.get("time", 0.0)), tuple(r["from"]), tuple(r["to"]))  # type: ignore[arg-type]
            for r in data.get("retries") or ()
        )
        sweep = data.get("sweep") or {}
        return cls(
            run_id=str(data["run_id"]),
            preset=preset_from_dict(data["preset"], source=data.get("preset_source", "")),
            resolved=resolved,
            launch=launch,
            plan=dict(data.get("plan") or {}),
            blocks=int(data.get("blocks") or 0),
            auto_fit=bool(data.get("auto_fit")),
            collective_timeout_s=data.get("collective_timeout_s"),
            resume=bool(data.get("resume")),
            measure_steps=int(data.get("measure_steps") or 0),
            retries=retries,
            model_origin=ModelOrigin(**data["model_origin"]) if data.get("model_origin") else None,
            sweep_id=str(sweep["id"]) if sweep.get("id") else None,
            sweep_point=dict(sweep.get("point") or {}),
            notify=str(data["notify"]) if data.get("notify") else None,
        )
