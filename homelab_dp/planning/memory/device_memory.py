"""Per-device memory budget of one training configuration (pure arithmetic, no torch).

The tensor memory alive at the peak, by component, plus an overhead for what is not a tensor
(CUDA context, NCCL buffers, fragmentation, the CPU's Python runtime). References: ZeRO §3.1/§5,
Korthikanti et al. 2022 §4, QLoRA §3.

The peak is modelled as it happens in `homelab_dp.train` (checked against measured live tensor
bytes on the CPU by `benchmarks/memory_accuracy.py`). Four moments are budgeted and the largest
is the peak (`Budget.phases`, `Budget.peak_phase`):

* ``forward``: the end of the forward pass, at the loss head's peak.
* ``backward``: the largest of (a) the start of backward (every saved activation and the loss
  head's backward peak), (b) inside the last layer's backward, when the loss head's tensors are
  freed but the lm_head gradient, with activation checkpointing one recomputed layer, and the
  MLP's backward temporaries are alive, and (c) its end (every gradient; a tied embedding's
  second one).
* ``optimizer``: weights, every gradient, the optimizer state and foreach AdamW's temporaries.
* ``load``: the weights (and DDP's buckets) before the first step. (``forward`` is the peak
  only at DDP's bucket rebuild with accumulation, see below.)

The loss head (``logits``, `core.logits_memory`): chunked cross-entropy over the target tokens
(`train.loss`; ``TrainShape.target_share``), else the full logits (3 × b·s·V fp32). Gradients: DDP
on 2+ processes keeps them in its buckets (``gradient_as_bucket_view``, zeroed in place), alive
from the load on, with no other copy (but once, with accumulation: the bucket rebuild at the
second forward). On one process there is no wrapper: gradients live from the first backward to
the step. ``buffers``: FSDP's gathered parameters, autocast's 16-bit weight copies, QLoRA's
dequantized weight. Attention: SDPA with a mask (padding, or packing's block-diagonal one) keeps a
b·s² mask per layer and repeated key/value heads; FlashAttention varlen (CUDA) neither.

QLoRA under FSDP2, as the worker runs it: the NF4 weights are stored with bitsandbytes'
quant_storage = the compute dtype, so their packed bytes (0.5 per weight) are ordinary FSDP2
parameters, sharded over N; their quantization state (absmax: `NF4_BYTES_PER_PARAM` − 0.5 per
weight) is no parameter and stays whole on every rank. Embeddings, lm_head and norms stay in the
compute dtype (fp32 on the CPU), sharded; the fp32 LoRA adapters sit in the same units, so their
weights, gradients and AdamW state are sharded too. Gathered (``buffers``): fsdp-full the root
unit after forward plus the current and the prefetched decoder layer, fsdp-grad-op every unit
from forward to backward; plus one linear dequantized at a time, as under DDP.

Offload (`TrainShape.offload`, ``offload_activations``; CUDA only, the CPU's device is host
RAM): what moves to pinned host memory leaves the card's components, and the budget says how
many bytes this rank pins (`Budget.offload_host_bytes`) and moves over PCIe per step
(`Budget.pcie_bytes_per_step`); `homelab_dp.core.offload` prices them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from homelab_dp.core.activation_memory import (
    activation_bytes,
    layer_activation_bytes,
    loss_head_bytes,
    moved_activation_bytes,
    outer_activation_bytes,
    pinned_activation_bytes,
)
from homelab_dp.core.model_spec import ModelSpec
from homelab_dp.core.pinned_memory import fsdp_offload_pinned_bytes, host_adamw_pinned_bytes
from homelab_dp.core.shape import (
    TrainShape,
    compute_width,
    ddp_buckets,
    is_fsdp,
    offloads,
    trainable_params,
)

GiB, MiB = 1024**3, 1024**2

NF4_PACKED_BYTES = 0.5
"""NF4's packed weights: 4 bits each (an FSDP2 parameter under quant_storage = compute dtype)."""
NF4_BYTES_PER_PARAM = NF4_PACKED_BYTES + 1 / 64 + 4 / (64 * 256)
"""NF4 weights with double quantization: 4 bits, an 8-bit absmax per 64-block, fp32 per 256 blocks."""

# Assumed, not measured (stated as such in every plan) unless a calibration replaces them.
CUDA_CONTEXT_BYTES = 512 * MiB
NCCL_BUFFER_BYTES = 256 * MiB
CUDA_FRAGMENTATION = 0.10
CPU_RUNTIME_BYTES = 700 * MiB
CPU_FRAGMENTATION = 0.05

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "buffers")
PHASES = ("load", "forward", "backward", "optimizer")


@dataclass(frozen=True)
class Overhead:
    """What is not a tensor: a fixed part per process and a fraction of the tensor bytes."""

    runtime_bytes: int
    """CUDA context and NCCL buffers, or the Python/torch runtime on the CPU."""
    fragmentation: float
    """Allocator slack as a fraction of the tensor peak."""
    source: str = "assumed"
    """"assumed", or where the figures were measured (a calibration)."""
    fragmentation_source: str = "assumed"
    """Where the fragmentation was measured (the runtime may be measured while it is not)."""

    def bytes_for(self, tensor_bytes: float) -> float:
        return self.runtime_bytes + self.fragmentation * tensor_bytes


@dataclass(frozen=True)
class Budget:
    """Bytes per device at the peak, by component."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    buffers: int
    overhead: int
    peak_phase: str
    """When the peak happens: "backward", "optimizer" or (DDP's bucket rebuild) "forward"."""
    comm_bytes_per_step: int
    trainable_params: int
    phases: dict[str, int] = field(default_factory=dict)
    """Predicted live tensor bytes at each budgeted moment (load, forward, backward, optimizer)."""
    offload_host_bytes: int = 0
    """Pinned host bytes of this rank's offloaded state and activations (0: nothing offloaded)."""
    pcie_bytes_per_step: int = 0
    """Bytes this device moves over PCIe per optimizer step for the offload, both directions."""

    @property
    def tensors(self) -> int:
        """Predicted peak of live tensor bytes (everything but the overhead)."""
        return sum(getattr(self, c) for c in COMPONENTS)

    @property
    def total(self) -> int:
        return self.tensors + self.overhead

    def per_device_bytes(self) -> dict[str, int]:
        """The `per_device_bytes` block of `plan --json`."""
        out = {c: int(getattr(self, c)) for c in COMPONENTS}
        out["overhead"] = int(self.overhead)
        out["total"] = int(self.total)
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def _optimizer_bytes_per_param(shape: TrainShape) -> float:
    """AdamW: m and v in fp32; 8-bit AdamW: two bytes; SGD: the momentum buffer."""
    return {"adamw": 8.0, "adamw8bit": 2.0, "sgd": 4.0}[shape.optimizer]


def _qlora_packed(spec: ModelSpec, shape: TrainShape) -> tuple[float, float, float]:
    """QLoRA's (packed 4-bit linears, their quantization state, the rest in 16-bit) in bytes.

    The NF4 weights are stored with bitsandbytes' quant_storage = the compute dtype: 0.5 bytes
    per weight, ordinary parameters that FSDP2 shards. Their quantization state (an 8-bit absmax
    per 64 weights, fp32 per 256 blocks) is not a parameter and stays whole on every rank.
    Embeddings, lm_head and norms stay in the compute dtype (fp32 on the CPU).
    """
    base_w = compute_width(shape) if shape.device == "cuda" else 4
    q = spec.quantizable_params
    return (
        q * NF4_PACKED_BYTES,
        q * (NF4_BYTES_PER_PARAM - NF4_PACKED_BYTES),
        (spec.params - q) * base_w,
    )


def comm_bytes_per_step(spec: ModelSpec, shape: TrainShape) -> int:
    """Bytes each device sends per optimizer step (ring collectives).

    DDP and ZeRO-1 all-reduce fp32 gradients once per step: 2(N-1)/N × gradient bytes; ZeRO-1
    also broadcasts the updated parameter shards. FSDP all-gathers 16-bit (fp32 on CPU)
    parameters every micro-step (grad-op once, full twice: forward and backward) and
    reduce-scatters gradients once. LoRA moves only the adapters' gradients; QLoRA under FSDP
    all-gathers its packed 4-bit weights, the 16-bit rest and the fp32 adapters every
    micro-step and reduce-scatters the adapters' gradients.
    """
    n = shape.world_size
    if n <= 1:
        return 0
    ring = (n - 1) / n
    grad_bytes = trainable_params(spec, shape) * 4
    gathers = (1 if shape.distribution == "fsdp-grad-op" else 2) * shape.grad_accum
    if shape.method == "qlora" and is_fsdp(shape):
        packed, _, rest = _qlora_packed(spec, shape)
        return int(ring * (gathers * (packed + rest + grad_bytes) + grad_bytes))
    if shape.method != "full":
        return int(2 * ring * grad_bytes)
    gather = spec.params * compute_width(shape)
    if shape.distribution == "ddp":
        return int(2 * ring * grad_bytes)
    if shape.distribution == "zero1":
        return int(2 * ring * grad_bytes + ring * spec.params * 4)
    return int(ring * (gathers * gather + grad_bytes))


def _model_states(spec: ModelSpec, shape: TrainShape) -> dict[str, float]:
    """Weights, gradients, optimizer state and the buffers of the step, before activations.

    ``shard``: the bytes of this rank's FSDP-sharded parameters (what params offload moves).
    """
    n, w = shape.world_size, compute_width(shape)
    trainable = trainable_params(spec, shape)
    opt = trainable * _optimizer_bytes_per_param(shape)
    fsdp = is_fsdp(shape)
    buffers = shard = 0.0
    base_w = w if shape.device == "cuda" else 4  # frozen weights (train.lora); fp32 on the CPU
    root = spec.embedding_params + spec.lm_head_params + spec.final_norm_params
    if shape.method == "full":
        weights = spec.params * 4 / (n if fsdp else 1)  # fp32 master weights
        shard = weights if fsdp else 0.0
        grads = trainable * 4 / (n if fsdp else 1)
        opt = opt / (1 if shape.distribution == "ddp" else n)
        if shape.distribution == "fsdp-grad-op":
            buffers += spec.params * w  # unsharded parameters kept from forward to backward
        elif shape.distribution == "fsdp-full":
            # The root unit (embeddings, final norm, lm_head) stays gathered after forward,
            # plus the current and the prefetched decoder layer.
            buffers += (root + 2 * spec.layer_params) * w
        elif shape.device == "cuda" and w == 2:
            buffers += spec.params * w  # autocast's 16-bit weight copies, saved for backward
    elif shape.method == "qlora" and fsdp:
        # FSDP2 shards the packed weights, the 16-bit rest and the fp32 adapters (weights,
        # gradients, AdamW state: /N); the quantization state stays whole on every rank.
        packed, state, rest = _qlora_packed(spec, shape)
        shard = (packed + rest + trainable * 4) / n
        weights, grads, opt = shard + state, trainable * 4 / n, opt / n
        if shape.distribution == "fsdp-grad-op":
            buffers += packed + rest + trainable * 4  # every unit gathered forward to backward
        else:  # the root unit after forward, the current and the prefetched decoder layer
            layer = spec.linear_params_per_layer * NF4_PACKED_BYTES + trainable * 4 / spec.layers
            other = spec.norm_params_per_layer + spec.other_params_per_layer
            buffers += root * base_w + 2 * (layer + other * base_w)
        buffers += 2 * max(lin.d_in * lin.d_out for lin in spec.linears) * base_w  # dequantized
    else:
        if shape.method == "qlora":
            other = spec.params - spec.quantizable_params  # embeddings, lm_head, norms
            base = spec.quantizable_params * NF4_BYTES_PER_PARAM + other * base_w
            largest = max(lin.d_in * lin.d_out for lin in spec.linears)
            buffers += 2 * largest * base_w  # one linear dequantized at a time for the matmul
        else:
            base = spec.params * base_w
            if fsdp:  # gathered as for a full fine-tune: grad-op everything, full the root
                shard = base / n + trainable * 4  # unit and two layers (counted as weights)
                kept = spec.params if shape.distribution == "fsdp-grad-op" else (
                    root + 2 * spec.layer_params)  # fmt: skip
                base = base / n + kept * base_w
        weights = base + trainable * 4
        grads = trainable * 4
    if shape.method != "full" and shape.device == "cuda" and shape.dtype == "fp16":
        # Under fp16 the frozen base keeps its embeddings and norms in fp32 (train.lora.
        # residual_in_fp32: the residual stream must not overflow fp16): 2 bytes more each.
        # FSDP is never planned in fp16, so nothing here is sharded.
        weights += 2 * (spec.embedding_params + spec.final_norm_params
                        + spec.norm_params_per_layer * spec.layers)  # fmt: skip
    # DDP on 2+ processes: the gradients are views of its buckets, alive from the load on.
    resident = trainable * 4 if ddp_buckets(shape) else 0.0
    # foreach AdamW (the CPU) makes one temporary per parameter (sqrt of v); fused AdamW none.
    local = trainable / (1 if shape.distribution == "ddp" or shape.method == "lora" else n)
    step_temp = local * 4 if shape.optimizer == "adamw" and shape.device == "cpu" else 0.0
    # Accumulated gradients (unless resident); FSDP2 keeps them unsharded while sync is off.
    accum = shape.grad_accum > 1 and not resident
    accum_grads = (trainable * 4 if fsdp else grads) if accum else 0.0
    return {"weights": weights, "grads": grads, "opt": opt, "buffers": buffers,
            "resident": resident, "step_temp": step_temp, "accum_grads": accum_grads,
            "trainable": trainable, "shard": shard}  # fmt: skip


def _offload(spec: ModelSpec, shape: TrainShape, s: dict[str, float]) -> dict[str, float]:
    """The states left on the card once ``shape.offload`` moved some to pinned host memory,
    with ``host`` (this rank's pinned bytes) and ``pcie`` (its bytes over PCIe per step).

    params (FSDP2's CPUOffloadPolicy): the sharded parameters, their gradients and the
    optimizer state live in host RAM and the step runs on the CPU; the shards go to the card at
    every all-gather (forward each micro-step, fsdp-full also backward) and the gradient shards
    come back once per step. optimizer: AdamW's state (and a host copy of the fp32 weights)
    lives in host RAM; per step the gradient and weight shards go to the host and the updated
    weights come back (3 × 4 bytes per local trainable parameter). Activations: `budget`.
    ``host`` counts what is pinned, rounded as torch's caching host allocator rounds it
    (`homelab_dp.core.pinned_memory`): each FSDP2 shard and gradient shard on its own,
    `HostAdamW`'s flat buffers once per kind; the PCIe bytes are the tensors' own.
    """
    params, optimizer, _ = offloads(shape)
    out = {**s, "host": 0.0, "pcie": 0.0}
    if params:
        gathers = (1 if shape.distribution == "fsdp-grad-op" else 2) * shape.grad_accum
        shards, grads = fsdp_offload_pinned_bytes(spec, shape)
        out["host"] = shards + grads + s["opt"] + s["step_temp"]
        out["pcie"] = gathers * s["shard"] + s["grads"]
        out.update(weights=s["weights"] - s["shard"], grads=0.0, opt=0.0, step_temp=0.0)
    elif optimizer:
        # m and v, the weights' host copy (the size of the gradient shards) and, during the
        # step, the gradients' host copies.
        kinds = 2 + (round(s["opt"] / s["grads"]) if s["grads"] else 0)
        out["host"] = host_adamw_pinned_bytes(s["grads"], kinds) + s["step_temp"]
        out["pcie"] = 3 * s["grads"]
        out.update(opt=0.0, step_temp=0.0)
    elif is_fsdp(shape) and shape.offload == "optimizer":
        # On the CPU `HostAdamW`'s copies share the one memory: the weights' copy from the
        # first step on (counted with the optimizer state), the gradients' during the step.
        out.update(opt=s["opt"] + s["grads"], step_temp=s["step_temp"] + s["grads"])
    return out


def _inside_backward(
    spec: ModelSpec, shape: TrainShape, s: dict[str, float]
) -> tuple[float, float]:
    """Gradients and activations while a decoder layer is back-propagated (logits freed).

    Going down the layers, the parameter gradients made so far grow while the activations
    still saved shrink, so the larger total is at the first or the last layer processed. The
    layer in hand holds its saved (or, with checkpointing, recomputed) activations, and its
    backward the gradients of its input and of the MLP's intermediate tensors. With the
    parameters offloaded each layer's gradients go to the host once reduced; with the
    activations offloaded only the next layer's saved tensors are back on the card.
    """
    tokens, w, n = shape.micro_batch * shape.seq_len, compute_width(shape), shape.world_size
    fsdp = is_fsdp(shape)
    off_params, _, off_acts = offloads(shape)
    layer = layer_activation_bytes(spec, shape) * tokens
    res = 4 if shape.dtype == "fp32" or not fsdp else 2
    saved = spec.hidden * res * tokens if shape.activation_checkpointing else layer
    outer = activation_bytes(spec, shape) - spec.layers * saved
    temps = (spec.hidden + 2 * spec.intermediate) * tokens * w
    if shape.method == "full":
        head = (spec.lm_head_params or spec.embedding_params) * 4 / (n if fsdp else 1)
        per_layer = spec.layer_params * 4 / (n if fsdp else 1)
        if fsdp:
            temps += spec.layer_params * 4  # the layer's unsharded gradient before reduce-scatter
    else:
        head, per_layer = 0.0, s["grads"] / spec.layers
        if fsdp and shape.method == "qlora":
            temps += s["trainable"] * 4 / spec.layers  # unsharded before reduce-scatter
    if off_params:
        head = per_layer = 0.0
    rest = spec.layers - 1
    if off_acts:
        outer, kept = 24.0 * tokens, saved  # the batch; the next layer's tensors come back
        if shape.grad_accum > 1 or s["resident"]:
            return s["accum_grads"] + s["resident"], outer + layer + temps + kept
        return max(head, head + rest * per_layer), outer + layer + temps + kept
    if shape.grad_accum > 1 or s["resident"]:  # every gradient exists already
        return s["accum_grads"] + s["resident"], outer + layer + temps + rest * saved
    first = (head, rest * saved)  # the last layer: every lower layer's activations saved
    last = (head + rest * per_layer, 0.0)  # the first layer: every other gradient made
    grads, kept = max(first, last, key=sum)
    return grads, outer + layer + temps + kept


def budget(spec: ModelSpec, shape: TrainShape, overhead: Overhead | None = None) -> Budget:
    """The per-device memory budget of ``shape`` for the model ``spec``.

    Offload (`TrainShape.offload`, `offload_activations`, CUDA only) moves state to pinned host
    memory (`_offload`); with the activations offloaded (`train.activation_offload`) every
    saved activation, the loss head's included, goes to the host as it is saved (weights stay):
    about one decoder layer's is on the card, plus the loss head, and 2 × the moved bytes
    (`moved_activation_bytes`) cross PCIe per micro-step; the host pins them each rounded to a
    power of two (`pinned_activation_bytes`). The host bytes and the PCIe traffic are
    `Budget.offload_host_bytes` and `Budget.pcie_bytes_per_step`.
    """
    s = _offload(spec, shape, _model_states(spec, shape))
    tokens = shape.micro_batch * shape.seq_len
    acts = activation_bytes(spec, shape)
    if offloads(shape)[2]:
        res = 4 if shape.dtype == "fp32" or not is_fsdp(shape) else 2
        layer = (
            spec.hidden * res
            if shape.activation_checkpointing
            else (layer_activation_bytes(spec, shape))
        )
        acts = int(layer * tokens + 24 * tokens)
        s["host"] += pinned_activation_bytes(spec, shape)
        s["pcie"] += 2 * moved_activation_bytes(spec, shape) * shape.grad_accum
    head = loss_head_bytes(spec, shape)
    logits = head["backward"]
    bufs = s["buffers"]
    base = s["weights"] + s["opt"] + bufs
    held = s["accum_grads"] + s["resident"]  # gradients alive before this backward
    in_grads, in_acts = _inside_backward(spec, shape, s)
    start = base + held + acts + logits
    inside = base + in_grads + in_acts
    # The end of backward: every gradient exists; a tied embedding adds its second gradient
    # to the lm_head's out of place (three vocab × hidden tensors at that moment).
    tied = shape.method == "full" and spec.tied_embeddings and not is_fsdp(shape)
    end_grads = s["grads"] + (2 * spec.vocab * spec.hidden * 4 if tied else 0)
    end = base + end_grads + outer_activation_bytes(spec, shape) * tokens
    forward = base + held + acts + head["forward"]
    # With accumulation DDP rebuilds its buckets at a forward after the first step, before any
    # activation: the old buckets (the gradients' views) beside the new ones, and the batch.
    rebuilds = s["resident"] and shape.grad_accum > 1
    rebuild = base + 2 * s["resident"] + 24 * tokens if rebuilds else 0
    load = s["weights"] + s["resident"]
    if shape.method == "qlora" and is_fsdp(shape):
        # Rank 0 streams the checkpoint (`train.quantized_load`): beside its shards, the tensor
        # in hand in the compute dtype (the largest: an embedding, lm_head or a linear).
        largest = max(spec.embedding_params, spec.lm_head_params,
                      max(lin.d_in * lin.d_out for lin in spec.linears))  # fmt: skip
        load += largest * (compute_width(shape) if shape.device == "cuda" else 4)
    phases = {
        "load": load,
        "forward": max(forward, rebuild),
        "backward": max(start, inside, end),
        "optimizer": s["weights"] + s["grads"] + s["opt"] + s["step_temp"],
    }
    if rebuild > max(phases["backward"], phases["optimizer"]):
        phase = "forward"
        parts = (s["weights"], 2 * s["resident"], s["opt"], 24 * tokens, 0, bufs)
    elif phases["optimizer"] > phases["backward"]:
        phase = "optimizer"
        parts = (s["weights"], s["grads"], s["opt"] + s["step_temp"], 0, 0, 0)
    elif start >= max(inside, end):
        phase = "backward"
        parts = (s["weights"], held, s["opt"], acts, logits, bufs)
    elif inside >= end:
        phase = "backward"
        parts = (s["weights"], in_grads, s["opt"], in_acts, 0, bufs)
    else:
        phase = "backward"
        parts = (s["weights"], end_grads, s["opt"], end - base - end_grads, 0, bufs)
    ints = [int(p) for p in parts]
    ov = overhead or assumed_overhead(shape.device, shape.world_size)
    return Budget(
        weights=ints[0], gradients=ints[1], optimizer=ints[2], activations=ints[3],
        logits=ints[4], buffers=ints[5], overhead=int(ov.bytes_for(sum(ints))), peak_phase=phase,
        comm_bytes_per_step=comm_bytes_per_step(spec, shape), trainable_params=int(s["trainable"]),
        phases={k: int(v) for k, v in phases.items()}, offload_host_bytes=int(s["host"]),
        pcie_bytes_per_step=int(s["pcie"]),
    )  # fmt: skip


def assumed_overhead(device: str, world_size: int = 1) -> Overhead:
    """The overhead used when nothing was measured on this hardware."""
    if device == "cuda":
        comm = NCCL_BUFFER_BYTES if world_size > 1 else 0
        return Overhead(CUDA_CONTEXT_BYTES + comm, CUDA_FRAGMENTATION)
    return Overhead(CPU_RUNTIME_BYTES, CPU_FRAGMENTATION)
