"""The host-RAM model: peak host memory of the moments a run holds whole-model copies in RAM —
loading, saving the result, merging an adapter — per process and for the machine (pure).

Loading: DDP and ZeRO-1 read a full copy in every process (fp32 for a full fine-tune, the
compute dtype for LoRA); FSDP reads one, on rank 0, and scatters the shards; QLoRA quantizes as
it loads (about one tensor at a time; under FSDP only rank 0 reads). Saving the result: rank 0
holds the whole model once (FSDP gathers it, DDP copies it off the card). A merge loads the
16-bit base again on rank 0. Training with offload: every rank's pinned host memory (the
offloaded state, the saved activations). The numbers that are assumed, not measured, say so
below.
"""

from __future__ import annotations

from dataclasses import dataclass

from homelab_dp.planning.memory.device_memory import (
    NF4_PACKED_BYTES,
    Budget,
    GiB,
    TrainShape,
    compute_width,
    is_fsdp,
    trainable_params,
)
from homelab_dp.planning.memory.moe_memory import largest_quantized
from homelab_dp.planning.model_spec import ModelSpec

CHECKPOINT_BYTES_PER_PARAM = 2
"""Assumed: the model folder's weights are 16-bit (bf16/fp16), as published checkpoints are.
A merge loads the base in the folder's own dtype."""
CUDA_HOST_RUNTIME_BYTES = 2 * GiB
"""Assumed: host RAM of one CUDA worker besides model copies (Python, torch, the CUDA and NCCL
libraries and their host buffers)."""
HOST_PHASES = ("load", "checkpoint", "merge", "train")


@dataclass(frozen=True)
class HostBudget:
    """Peak host RAM of the moments a run holds whole-model copies in host memory.

    ``phases`` maps a moment to (the busiest process's bytes, the machine's bytes): rank 0 is
    the busiest, and the machine is every local process together.
    """

    processes: int
    phases: dict[str, tuple[int, int]]
    available_bytes: int | None
    """Host RAM available to the run (the probe's available, else total); None: not known
    (what-if cards sit in some other machine), so not checked."""

    @property
    def per_process_bytes(self) -> int:
        return max(p for p, _ in self.phases.values())

    @property
    def total_bytes(self) -> int:
        return max(t for _, t in self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k][1])

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.total_bytes <= self.available_bytes

    def to_json(self) -> dict:
        """The ``host`` block of `plan --json`."""
        return {
            "per_process_bytes": self.per_process_bytes,
            "total_bytes": self.total_bytes,
            "available_bytes": self.available_bytes,
            "fits": self.fits,
            "peak_phase": self.peak_phase,
            "processes": self.processes,
            "phases": {
                k: {"per_process_bytes": p, "total_bytes": t} for k, (p, t) in self.phases.items()
            },
        }


def host_budget(
    spec: ModelSpec,
    shape: TrainShape,
    device_budget: Budget,
    *,
    merge: bool = False,
    available: int | None = None,
) -> HostBudget:
    """Peak host RAM of loading, saving the result and merging it, per process and machine.

    What `homelab_dp.train` holds on the host at each moment, with ``shape.world_size`` processes
    on the machine (rank 0's machine: the busiest of a multi-node run):

    * ``load``: DDP and ZeRO-1 load the whole model on the CPU in every process
      (``from_pretrained``: fp32 master weights for a full fine-tune, the compute dtype for
      LoRA's frozen base), then move it to the card. FSDP loads sharded: only rank 0 reads the
      model (one copy, freed tensor by tensor as it is sent), the others build it on the meta
      device and receive their shards; on the CPU rank 0 also holds its shard of the tensor in
      flight. QLoRA quantizes onto the card tensor by tensor (one 16-bit tensor on the host):
      under DDP every process reads the checkpoint; under FSDP only rank 0 does (the largest
      16-bit tensor and its packed copy at a time) and the others hold only their runtime.
    * ``checkpoint``: writing the result on rank 0. FSDP gathers the full state dict there (the
      fp32 weights, or LoRA's adapters); DDP's safetensors writer copies the card's weights to
      host memory (no copy when they are already there, on the CPU).
    * ``merge`` (``train.merge`` with LoRA/QLoRA): rank 0 loads the base again, in the folder's
      dtype (`CHECKPOINT_BYTES_PER_PARAM`, assumed 16-bit), merges in place and writes it.
    * ``train`` (only with offload on CUDA): every rank's pinned host memory for what is
      offloaded (``device_budget.offload_host_bytes``: the sharded weights, gradients and
      optimizer state, or the optimizer state and a host copy of the weights, or the saved
      activations of a micro-step, as torch's caching host allocator pins them: rounded up to
      a power of two, `homelab_dp.planning.memory.pinned_memory`), beside its runtime; every local rank
      together.

    Besides those copies every process holds, on CUDA, `CUDA_HOST_RUNTIME_BYTES` (assumed); on
    the CPU, where the "device" is host RAM, its own tensors of that moment from
    ``device_budget`` (the load phase's weights; weights and optimizer state at the end) and the
    budget's overhead. Activations are not host memory on CUDA and are gone by then on the CPU.
    Not modelled: the page cache of the model files (reclaimable), DCP checkpoints (each rank
    stages only its own shards).
    """
    n = max(1, shape.world_size)
    cpu = shape.device == "cpu"
    fsdp = is_fsdp(shape)
    trainable = trainable_params(spec, shape)
    if shape.method == "full":
        load_width = 4  # fp32 master weights
        saved = spec.params * 4
    else:
        load_width = 4 if cpu else compute_width(shape)
        saved = trainable * 4
    adapters = trainable * 4 if shape.method != "full" else 0
    copy = spec.params * load_width + adapters
    # A linear, or a MoE model's fused expert stack [E, out, in] (one tensor in the checkpoint).
    biggest_linear = largest_quantized(spec)
    largest = max(spec.embedding_params, spec.lm_head_params, biggest_linear)
    b = device_budget
    runtime = b.overhead if cpu else CUDA_HOST_RUNTIME_BYTES
    at_load = b.phases.get("load", b.weights) if cpu else 0
    at_end = b.weights + b.optimizer if cpu else 0

    if shape.method == "qlora" and fsdp:  # rank 0 reads, one tensor and its packed copy
        tensor = largest * CHECKPOINT_BYTES_PER_PARAM + biggest_linear * NF4_PACKED_BYTES
        first, other = runtime + at_load + tensor, runtime + at_load
    elif shape.method == "qlora":
        first = other = runtime + (at_load if cpu else largest * CHECKPOINT_BYTES_PER_PARAM)
    elif fsdp:
        first = runtime + copy + (largest * load_width // n if cpu else 0)
        other = runtime + at_load
    else:
        first = other = runtime + (at_load if cpu else copy)
    phases = {"load": (first, first + (n - 1) * other)}

    end = runtime + at_end
    gathered = saved if fsdp or not cpu else 0  # DDP on the CPU writes its own tensors
    phases["checkpoint"] = (end + gathered, end + gathered + (n - 1) * end)
    if merge and shape.method != "full":
        base = spec.params * CHECKPOINT_BYTES_PER_PARAM + adapters
        phases["merge"] = (end + base, end + base + (n - 1) * end)
    if b.offload_host_bytes:
        pinned = runtime + b.offload_host_bytes
        phases["train"] = (pinned, n * pinned)
    return HostBudget(
        processes=n,
        phases={k: (int(p), int(t)) for k, (p, t) in phases.items()},
        available_bytes=available,
    )
