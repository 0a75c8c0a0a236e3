"""The shape of one training configuration, as the memory model budgets it (pure).

`TrainShape` and the few facts read straight off it: the compute width, whether FSDP shards,
DDP's buckets, the trainable parameters, and what is offloaded to host memory. The memory
model (`homelab_dp.planning.memory.device_memory`) re-exports them; `homelab_dp.planning.memory.offload_cost` prices the offload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from homelab_dp.planning.memory.moe_memory import lora_param_count
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.vocabulary import (
    PREFERENCE_OBJECTIVES,
    SHARDED,
    Device,
    Distribution,
    Dtype,
    Method,
    Objective,
    Offload,
    Reference,
)

ReferenceMode = Literal["none"] | Reference
"""A resolved `train.reference`, "none" for the objectives without a reference model."""


@dataclass(frozen=True)
class TrainShape:
    """One configuration to budget: method, distribution and batch geometry."""

    method: Method
    distribution: Distribution
    world_size: int
    device: Device
    dtype: Dtype
    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    activation_checkpointing: bool = False
    optimizer: Literal["adamw", "adamw8bit", "sgd"] = "adamw"
    lora_r: int = 16
    lora_targets: str | tuple[str, ...] = "all-linear"
    packed: bool = True
    """data.pack: whole samples per row, positions restarting (no mask); else padded rows."""
    attention: Literal["sdpa", "homelab_packed", "flash_attention_2"] = "sdpa"
    """`train.model.attention`'s kernel: SDPA gets a mask on packed batches too (and repeats GQA's
    key/value heads); homelab_packed (each sample alone) and FlashAttention neither."""
    old_cards: bool = False
    """A planned card is below compute capability 8.0 (no FlashAttention kernels there):
    ``homelab_packed`` then repeats the key/value heads of grouped-query attention per sample
    (`homelab_dp.planning.attention_rule.packed_kernel`)."""
    target_share: float = 1.0
    """Largest share of a block's tokens that are targets (the chunked loss keeps only those);
    1.0, an upper bound, until the data has been read."""
    attention_span: float = 0.0
    """Keys a token attends over in the data's fullest row, Σ L² / seq_len over the row's
    segments (`homelab_dp.data.blocks.attention_span`): homelab_packed and FlashAttention attend
    each sample alone, so a row of samples of lengths L keeps Σ L² attention scores where the
    math kernel keeps any (attention dropout on the CPU), not seq_len². 0, read as seq_len (an
    upper bound), until the data has been read."""
    offload: Offload = "none"
    """`train.offload` as planned: none | optimizer (AdamW's state in host RAM, the step on the
    CPU) | params (FSDP2's CPUOffloadPolicy: sharded weights, gradients and optimizer state in
    pinned host RAM). FSDP only; on the CPU it moves nothing (the device is host RAM)."""
    offload_activations: bool = False
    """The activations saved for backward in pinned host RAM (`train.parallelism.activation_offload`:
    weights, buffers and tensors under 1 KiB stay on the card)."""
    objective: Objective = "sft"
    """`train.objective`. For dpo/orpo/kto ``micro_batch`` and ``seq_len`` are the forward's rows
    and their length (`homelab_dp.planning.memory.objective_memory.forward_rows`: two sequences
    per pair), and the loss head is the plain logits path, not the chunked one."""
    reference: ReferenceMode = "none"
    """The resolved `train.reference` (none: sft and orpo have no reference): adapters (a no-grad
    forward of the base, adapters disabled), precompute (nothing on the device but cached
    log-probabilities), copy (a frozen copy of the weights on every device)."""
    sequence_parallel: int = 1
    """Ranks every sequence is split over (`homelab_dp.planning.sequence_split`); ``seq_len`` is
    then one rank's share, ``seq_len / sequence_parallel`` tokens."""
    tiled_mlp: bool = False
    """`train.tiled_mlp` as planned: each decoder layer's MLP computed in tiles along the
    sequence, recomputed in backward (`homelab_dp.planning.memory.mlp_tiles`): its intermediate
    tensors are one tile's, not the micro-batch's. Ignored for a model whose MLPs stay untiled
    (`tiled_mlp_refusal`)."""


def preference(shape: TrainShape) -> bool:
    """Whether ``shape`` trains a preference objective (two sequences per sample, full logits)."""
    return shape.objective in PREFERENCE_OBJECTIVES


def plain_logits(shape: TrainShape) -> bool:
    """Whether the loss reads the model's full logits (a preference objective, or GRPO's
    completion log-probabilities) rather than the chunked cross-entropy."""
    return preference(shape) or shape.objective == "grpo"


def compute_width(shape: TrainShape) -> int:
    """Bytes per element of activations and gathered weights."""
    return 4 if shape.dtype == "fp32" else 2


def is_fsdp(shape: TrainShape) -> bool:
    return shape.distribution in SHARDED


def attention_masked(shape: TrainShape) -> bool:
    """Whether attention gets a b·s² mask: SDPA on padded and on packed batches alike
    (homelab_packed and FlashAttention attend each sample without one)."""
    return shape.attention == "sdpa"


def attended_keys(shape: TrainShape) -> float:
    """Keys a token attends over, on average, in the fullest row: `TrainShape.attention_span`
    where each sample is attended alone and the data has been read, else ``seq_len`` (SDPA's
    masked route attends the whole row)."""
    if attention_masked(shape) or shape.attention_span <= 0:
        return float(shape.seq_len)
    return min(float(shape.seq_len), shape.attention_span)


def ddp_buckets(shape: TrainShape) -> bool:
    """DDP (or ZeRO-1's DDP) wraps the model: two or more processes, gradients in its buckets."""
    return shape.distribution in ("ddp", "zero1") and shape.world_size > 1


def lora_targets_of(shape: TrainShape) -> str | list[str]:
    """The LoRA target spec as `ModelSpec.lora_targets` takes it."""
    t = shape.lora_targets
    return t if isinstance(t, str) else list(t)


def trainable_params(spec: ModelSpec, shape: TrainShape) -> int:
    """Parameters that receive gradients: a full fine-tune trains everything but a multimodal
    wrapper's vision tower (frozen); LoRA its adapters, on a MoE model as
    `homelab_dp.planning.memory.moe_memory.adapted` picks them."""
    if shape.method == "full":
        return spec.params - spec.vision_params
    return lora_param_count(spec, shape.lora_r, lora_targets_of(shape))


def offloads(shape: TrainShape) -> tuple[bool, bool, bool]:
    """(parameters, optimizer state, activations) in host RAM, as the card sees it.

    Only on CUDA: on the CPU the "device" is host RAM and offloading moves nothing. Parameters
    and optimizer state only under FSDP (`train.offload` needs it); activations under any
    distribution.
    """
    if shape.device != "cuda":
        return (False, False, False)
    sharded = is_fsdp(shape)
    return (
        sharded and shape.offload == "params",
        sharded and shape.offload == "optimizer",
        shape.offload_activations,
    )
