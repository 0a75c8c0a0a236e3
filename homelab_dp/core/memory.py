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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

from homelab_dp.core.logits_memory import chunk_peak_bytes, chunked_loss, full_logits_bytes
from homelab_dp.core.model_spec import ModelSpec
from homelab_dp.core.vocabulary import SHARDED, Device, Distribution, Dtype, Method

GiB, MiB = 1024**3, 1024**2

NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
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
    attention: Literal["sdpa", "flash_attention_2"] = "sdpa"
    """`train.attention`'s kernel; SDPA gets a mask on packed batches too, FlashAttention none."""
    target_share: float = 1.0
    """Largest share of a block's tokens that are targets (the chunked loss keeps only those);
    1.0, an upper bound, until the data has been read."""


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


def compute_width(shape: TrainShape) -> int:
    """Bytes per element of activations and gathered weights."""
    return 4 if shape.dtype == "fp32" else 2


def is_fsdp(shape: TrainShape) -> bool:
    return shape.distribution in SHARDED


def attention_masked(shape: TrainShape) -> bool:
    """Whether attention gets a b·s² mask: SDPA on padded and on packed batches alike."""
    return shape.attention == "sdpa"


def ddp_buckets(shape: TrainShape) -> bool:
    """DDP (or ZeRO-1's DDP) wraps the model: two or more processes, gradients in its buckets."""
    return shape.distribution in ("ddp", "zero1") and shape.world_size > 1


def layer_activation_bytes(spec: ModelSpec, shape: TrainShape) -> float:
    """Bytes one decoder layer saves for backward, per token (SDPA; no checkpointing).

    LLaMA-style, fp32 (elements): the two residual sums, per RMSNorm its normalised input and
    its output (4h), q and k after RoPE, v, the attention output, and four intermediate-sized MLP
    tensors (gate, up, SiLU(gate), their product). 16-bit on CUDA: the residual stream and the
    norms stay fp32 under autocast, and the norm output is cast to 16-bit once more. GPT-2: the
    two LayerNorm outputs and residual sums, c_attn's q/k/v, the merged heads, c_fc's output and
    gelu_new's four tanh-formula tensors; dropout keeps one mask per site.
    """
    h, inter, a = spec.hidden, spec.intermediate, spec.heads
    attn, kvd = a * spec.head_dim, spec.kv_heads * spec.head_dim
    w = compute_width(shape)
    cpu = shape.device == "cpu"
    small = 4 * (2 + a)  # per-token norm statistics and SDPA's log-sum-exp, fp32
    if spec.model_type == "gpt2":
        out = w * (8 * h + 5 * inter) + small
        if spec.hidden_dropout > 0:
            out += 2 * h * (w if cpu else 1)  # CPU dropout keeps a float mask, CUDA a bool one
    else:
        if attention_masked(shape):
            # With a mask (padding, or packing's block-diagonal one) SDPA converts it to an
            # additive (b, 1, s, s) one per layer, and transformers repeats the key/value heads.
            kvd = attn
        rest = 2 * attn + 2 * kvd + 4 * inter
        if spec.model_type == "phi3":
            rest += attn + kvd  # the fused qkv output stays alive beside the rotated q and k
        out = (24 * h if w == 4 else 28 * h) + w * rest + small
        if shape.method != "full":
            out -= 2 * 4 * h  # frozen norm weights: the normalised input is not saved
        if attention_masked(shape):
            out += shape.seq_len * w
        if spec.model_type == "gemma2":
            out += 4 * h * 4  # post-attention and post-MLP norms keep their input and output
    if cpu and spec.attention_dropout > 0:
        # SDPA has no fused CPU kernel with dropout: the math kernel keeps the softmax, the
        # dropout mask and the dropped probabilities, each heads × seq per token. With one
        # sequence it scales q and k as views of c_attn's output, which then stays alive.
        out += 3 * a * shape.seq_len * w + (2 * h * w if shape.micro_batch == 1 else 0)
    if shape.method != "full":
        out += len(spec.lora_targets(_targets(shape))) * shape.lora_r * w  # lora_A outputs
    return out


def outer_activation_bytes(spec: ModelSpec, shape: TrainShape) -> float:
    """Bytes per token outside the decoder layers: embeddings, final norm, the batch itself."""
    h, w = spec.hidden, compute_width(shape)
    if spec.model_type == "gpt2":
        embed = 2 if spec.embedding_dropout > 0 else 1  # the dropout output and its mask
        out = (embed + 1) * h * 4 if w == 4 else embed * h * 2 + h * 6
    else:
        out = 3 * h * 4 if w == 4 else 14 * h  # embedding output, final norm input/output
        if shape.method != "full":
            # A frozen final norm does not save its normalised input; with 16-bit frozen
            # embeddings and norms (train.lora) only the norm's fp32 input stays (measured).
            out = 2 * h * 4 if w == 4 else 4 * h
    out += 3 * 8  # input ids, attention mask and labels (int64)
    return out


def activation_bytes(spec: ModelSpec, shape: TrainShape) -> int:
    """Activations saved for backward at the end of the forward pass (logits excluded)."""
    tokens = shape.micro_batch * shape.seq_len
    outer = outer_activation_bytes(spec, shape) * tokens + 2 * shape.seq_len * spec.head_dim * 4
    if shape.activation_checkpointing:
        # Each layer keeps only its output (the next layer's input), in the residual dtype.
        res = 4 if shape.dtype == "fp32" or not is_fsdp(shape) else 2
        return int(spec.layers * spec.hidden * res * tokens + outer)
    return int(spec.layers * layer_activation_bytes(spec, shape) * tokens + outer)


def loss_head_bytes(spec: ModelSpec, shape: TrainShape) -> dict[str, int]:
    """The loss head's bytes at the forward's and at the backward's peak (`core.logits_memory`).

    Chunked cross-entropy where the worker installs it: its saved tensors plus its peak extra;
    the matmul runs in the compute dtype, lm_head's weight is fp32 for a full fine-tune under
    DDP (cast, and the cast saved, under autocast) and in the compute dtype otherwise, and the
    hidden states arrive in fp32 when the residual stream is fp32 (full, unsharded).
    """
    tokens, w = shape.micro_batch * shape.seq_len, compute_width(shape)
    if not chunked_loss(spec.model_type):
        return full_logits_bytes(tokens, spec.vocab, w)
    full = shape.method == "full"
    fp32_master = full and not is_fsdp(shape)
    weight_w = 4 if fp32_master else (w if shape.device == "cuda" or full else 4)
    hidden_w = 4 if fp32_master or shape.device == "cpu" else w
    targets = min(tokens, math.ceil(tokens * shape.target_share))
    b = chunk_peak_bytes(spec.vocab, spec.hidden, tokens, w, weight_bytes=weight_w,
                         hidden_bytes=hidden_w, weight_grad=full, targets=targets)  # fmt: skip
    return {"forward": b["saved"] + b["forward"], "backward": b["saved"] + b["backward"]}


def logits_bytes(spec: ModelSpec, shape: TrainShape) -> int:
    """The loss head's bytes at the start of backward (the ``logits`` component)."""
    return loss_head_bytes(spec, shape)["backward"]


def trainable_params(spec: ModelSpec, shape: TrainShape) -> int:
    """Parameters that receive gradients."""
    if shape.method == "full":
        return spec.params
    return spec.lora_params(shape.lora_r, _targets(shape))


def _targets(shape: TrainShape) -> str | list[str]:
    t = shape.lora_targets
    return t if isinstance(t, str) else list(t)


def _optimizer_bytes_per_param(shape: TrainShape) -> float:
    """AdamW: m and v in fp32; 8-bit AdamW: two bytes; SGD: the momentum buffer."""
    return {"adamw": 8.0, "adamw8bit": 2.0, "sgd": 4.0}[shape.optimizer]


def comm_bytes_per_step(spec: ModelSpec, shape: TrainShape) -> int:
    """Bytes each device sends per optimizer step (ring collectives).

    DDP and ZeRO-1 all-reduce fp32 gradients once per step: 2(N-1)/N × gradient bytes; ZeRO-1
    also broadcasts the updated parameter shards. FSDP all-gathers 16-bit (fp32 on CPU)
    parameters every micro-step (grad-op once, full twice: forward and backward) and
    reduce-scatters gradients once. LoRA moves only the adapters' gradients.
    """
    n = shape.world_size
    if n <= 1:
        return 0
    ring = (n - 1) / n
    grad_bytes = trainable_params(spec, shape) * 4
    if shape.method != "full":
        return int(2 * ring * grad_bytes)
    gather = spec.params * compute_width(shape)
    if shape.distribution == "ddp":
        return int(2 * ring * grad_bytes)
    if shape.distribution == "zero1":
        return int(2 * ring * grad_bytes + ring * spec.params * 4)
    gathers = 1 if shape.distribution == "fsdp-grad-op" else 2
    return int(ring * (gathers * shape.grad_accum * gather + grad_bytes))


def _model_states(spec: ModelSpec, shape: TrainShape) -> dict[str, float]:
    """Weights, gradients, optimizer state and the buffers of the step, before activations."""
    n, w = shape.world_size, compute_width(shape)
    trainable = trainable_params(spec, shape)
    opt = trainable * _optimizer_bytes_per_param(shape)
    fsdp = is_fsdp(shape)
    buffers = 0.0
    base_w = w if shape.device == "cuda" else 4  # frozen weights (train.lora); fp32 on the CPU
    if shape.method == "full":
        weights = spec.params * 4 / (n if fsdp else 1)  # fp32 master weights
        grads = trainable * 4 / (n if fsdp else 1)
        opt = opt / (1 if shape.distribution == "ddp" else n)
        if shape.distribution == "fsdp-grad-op":
            buffers += spec.params * w  # unsharded parameters kept from forward to backward
        elif shape.distribution == "fsdp-full":
            # The root unit (embeddings, final norm, lm_head) stays gathered after forward,
            # plus the current and the prefetched decoder layer.
            root = spec.embedding_params + spec.lm_head_params + spec.final_norm_params
            buffers += (root + 2 * spec.layer_params) * w
        elif shape.device == "cuda" and w == 2:
            buffers += spec.params * w  # autocast's 16-bit weight copies, saved for backward
    else:
        if shape.method == "qlora":
            other = spec.params - spec.quantizable_params  # embeddings, lm_head, norms
            base = spec.quantizable_params * NF4_BYTES_PER_PARAM + other * base_w
            largest = max(lin.d_in * lin.d_out for lin in spec.linears)
            buffers += 2 * largest * base_w  # one linear dequantized at a time for the matmul
        else:
            base = spec.params * base_w
            if fsdp:
                base = base / n + 2 * spec.layer_params * base_w
        weights = base + trainable * 4
        grads = trainable * 4
    # DDP on 2+ processes: the gradients are views of its buckets, alive from the load on.
    resident = trainable * 4 if ddp_buckets(shape) else 0.0
    # foreach AdamW (the CPU) makes one temporary per parameter (sqrt of v); fused AdamW none.
    local = trainable / (1 if shape.distribution == "ddp" or shape.method != "full" else n)
    step_temp = local * 4 if shape.optimizer == "adamw" and shape.device == "cpu" else 0.0
    # Accumulated gradients (unless resident); FSDP2 keeps them unsharded while sync is off.
    accum = shape.grad_accum > 1 and not resident
    accum_grads = (trainable * 4 if fsdp else grads) if accum else 0.0
    return {"weights": weights, "grads": grads, "opt": opt, "buffers": buffers,
            "resident": resident, "step_temp": step_temp, "accum_grads": accum_grads,
            "trainable": trainable}  # fmt: skip


def _inside_backward(
    spec: ModelSpec, shape: TrainShape, s: dict[str, float]
) -> tuple[float, float]:
    """Gradients and activations while a decoder layer is back-propagated (logits freed).

    Going down the layers, the parameter gradients made so far grow while the activations
    still saved shrink, so the larger total is at the first or the last layer processed. The
    layer in hand holds its saved (or, with checkpointing, recomputed) activations, and its
    backward the gradients of its input and of the MLP's intermediate tensors.
    """
    tokens, w, n = shape.micro_batch * shape.seq_len, compute_width(shape), shape.world_size
    fsdp = is_fsdp(shape)
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
        head, per_layer = 0.0, s["trainable"] * 4 / spec.layers
    rest = spec.layers - 1
    if shape.grad_accum > 1 or s["resident"]:  # every gradient exists already
        return s["accum_grads"] + s["resident"], outer + layer + temps + rest * saved
    first = (head, rest * saved)  # the last layer: every lower layer's activations saved
    last = (head + rest * per_layer, 0.0)  # the first layer: every other gradient made
    grads, kept = max(first, last, key=sum)
    return grads, outer + layer + temps + kept


def budget(spec: ModelSpec, shape: TrainShape, overhead: Overhead | None = None) -> Budget:
    """The per-device memory budget of ``shape`` for the model ``spec``."""
    s = _model_states(spec, shape)
    tokens = shape.micro_batch * shape.seq_len
    acts = activation_bytes(spec, shape)
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
    phases = {
        "load": s["weights"] + s["resident"],
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
        phases={k: int(v) for k, v in phases.items()},
    )  # fmt: skip


def assumed_overhead(device: str, world_size: int = 1) -> Overhead:
    """The overhead used when nothing was measured on this hardware."""
    if device == "cuda":
        comm = NCCL_BUFFER_BYTES if world_size > 1 else 0
        return Overhead(CUDA_CONTEXT_BYTES + comm, CUDA_FRAGMENTATION)
    return Overhead(CPU_RUNTIME_BYTES, CPU_FRAGMENTATION)
