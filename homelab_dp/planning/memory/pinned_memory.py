"""Pinned host memory as torch hands it out: rounded up to a power of two (pure).

torch's caching host allocator (``at::CachingHostAllocator``, behind ``pin_memory=True``,
``Tensor.pin_memory()`` and a non-blocking copy to the host) rounds every request up to the next
power of two (``pinned_max_round_threshold_mb`` unset: no limit) and keeps the block cached for
reuse: a 1.05 GB shard pins 2 GiB. What each offload pins, as `homelab_dp.train` allocates it:

* ``train.offload = "optimizer"`` (`train.parallelism.host_optimizer.HostAdamW`): one flat buffer per kind
  (the weights' copy, the gradients' copy, AdamW's two moments), each of this rank's trainable
  bytes, rounded once per kind (`host_adamw_pinned_bytes`).
* ``train.offload = "params"`` (FSDP2's ``CPUOffloadPolicy``): every parameter's padded shard is
  pinned on its own (``FSDPParam``: ``pin_memory()``), and every trainable parameter's gradient
  shard arrives through a non-blocking copy into pinned memory: each rounds on its own
  (`fsdp_offload_pinned_bytes`). The optimizer state (torch's AdamW on the host shards) is
  ordinary host memory, not rounded.
* ``train.offload_activations`` (`train.parallelism.activation_offload`): every saved activation is pinned on
  its own (`homelab_dp.planning.memory.device_memory.pinned_activation_bytes`).

PCIe traffic is not rounded: only the tensors' own bytes cross the link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from homelab_dp.planning.memory.moe_memory import adapted
from homelab_dp.planning.memory.train_shape import TrainShape, compute_width, lora_targets_of
from homelab_dp.planning.model_spec import ModelSpec

NF4_PACKED_BYTES = 0.5
"""NF4's packed weights: 4 bits each (as `homelab_dp.planning.memory.device_memory`)."""


def pinned_bytes(n: float) -> int:
    """Bytes the caching host allocator pins for a request of ``n`` bytes: the next power of two."""
    size = math.ceil(n)
    return 0 if size <= 0 else 1 << (size - 1).bit_length()


def rounding(n: float) -> float:
    """``pinned_bytes(n) / n`` (1.0 for nothing): how much more a request of ``n`` bytes pins."""
    return pinned_bytes(n) / n if n > 0 else 1.0


def host_adamw_pinned_bytes(local_trainable_bytes: float, kinds: int = 4) -> int:
    """`HostAdamW`'s pinned bytes: ``kinds`` flat buffers (the weights' and the gradients' copies,
    AdamW's two moments), each of this rank's trainable bytes, each rounded once."""
    return kinds * pinned_bytes(local_trainable_bytes)


@dataclass(frozen=True)
class ParamTensor:
    """One kind of parameter tensor FSDP2 shards along its first dimension."""

    rows: int
    """The first dimension (what FSDP2 splits over the ranks, padding the last chunk)."""
    row_bytes: float
    """Bytes of one row."""
    count: int
    """How many such tensors the model has."""
    trainable: bool


def fsdp_param_tensors(spec: ModelSpec, shape: TrainShape) -> list[ParamTensor]:
    """The parameter tensors FSDP2 manages under ``shape``, grouped by kind.

    Embeddings (position embeddings counted with them) and lm_head as vocab × hidden, each
    decoder linear as d_out × d_in (its bias apart), norms as hidden-sized vectors, anything else
    per layer as one vector. A full fine-tune holds fp32 master weights; LoRA/QLoRA a frozen base
    in the compute dtype (QLoRA's linears packed to 4 bits, stored as one column of the compute
    dtype) and fp32 adapters (A: r × d_in, B: d_out × r).
    """
    full = shape.method == "full"
    w = 4 if full or shape.device == "cpu" else compute_width(shape)
    h, L = spec.hidden, spec.layers
    out = [ParamTensor(max(1, spec.embedding_params // h), h * w, 1, full)]
    if spec.lm_head_params:
        out.append(ParamTensor(spec.lm_head_params // h, h * w, 1, full))
    norms = spec.final_norm_params + L * spec.norm_params_per_layer
    norms += sum(g.count * g.kind.norm_params for g in spec.blocks)
    if norms:
        out.append(ParamTensor(h, w, max(1, norms // h), full))
    if spec.other_params_per_layer:
        out.append(ParamTensor(spec.other_params_per_layer, w, L, full))
    weights = [(lin, L, 1) for lin in spec.linears] if not spec.blocks else []
    e = spec.experts
    for g in spec.blocks:  # layer groups: each kind's linears, mixer parameters and experts
        k = g.kind
        weights += [(lin, g.count, 1) for lin in k.linears]
        rest = sum(m.params for m in k.mixers) + k.other_params
        if rest:
            out.append(ParamTensor(rest, w, g.count, full))
        if k.experts is not None:
            stack = k.experts.count if k.experts.fused else 1
            weights += [
                (lin, g.count * k.experts.count // stack, stack) for lin in k.experts.linears
            ]
            router = k.experts.router_params + k.experts.shared_gate_params
            out.append(ParamTensor(max(1, router // h), h * w, g.count, full))
    if spec.extra_params:
        out.append(ParamTensor(max(1, spec.extra_params // h), h * w, 1, full))
    if (
        e is not None and not spec.blocks
    ):  # a MoE model's dense layers, shared experts and fused expert stacks
        weights += [(lin, L - e.layers, 1) for lin in spec.dense_mlp if e.layers < L]
        weights += [(lin, e.layers, 1) for lin in e.shared]
        stack = e.count if e.fused else 1
        weights += [(lin, e.layers * e.count // stack, stack) for lin in e.linears]
        router = e.router_params + e.shared_gate_params
        if router:  # kept in the compute dtype under QLoRA, frozen under LoRA
            out.append(ParamTensor(max(1, router // h), h * w, e.layers, full))
    if spec.vision_params:  # frozen, in the compute dtype
        base_w = compute_width(shape) if shape.device == "cuda" else 4
        out.append(ParamTensor(max(1, spec.vision_params // h), h * base_w, 1, False))
    for lin, count, stack in weights:
        if not count:
            continue
        if shape.method == "qlora":
            packed = stack * lin.d_in * lin.d_out * NF4_PACKED_BYTES
            out.append(ParamTensor(math.ceil(packed / w), w, count, False))
        else:  # a fused stack [E, d_out, d_in] is split by experts
            out.append(ParamTensor(stack * lin.d_out, lin.d_in * w, count, full))
        if lin.bias:
            out.append(ParamTensor(stack * lin.d_out, w, count, full))
    if not full:
        r = shape.lora_r
        for lin, count in adapted(spec, lora_targets_of(shape)):
            out += [ParamTensor(r, lin.d_in * 4, count, True),
                    ParamTensor(lin.d_out, r * 4, count, True)]  # fmt: skip
    return out


def fsdp_offload_pinned_bytes(spec: ModelSpec, shape: TrainShape) -> tuple[int, int]:
    """(parameter shards, gradient shards) that FSDP2's CPU offload pins on one rank, each
    tensor's shard rounded on its own: rank 0's shard is ceil(rows / N) rows (the padded chunk)."""
    n = max(1, shape.world_size)
    shards = grads = 0
    for t in fsdp_param_tensors(spec, shape):
        one = pinned_bytes(math.ceil(t.rows / n) * t.row_bytes) * t.count
        shards += one
        if t.trainable:  # trainable weights are fp32, and so are their gradients
            grads += one
    return shards, grads
