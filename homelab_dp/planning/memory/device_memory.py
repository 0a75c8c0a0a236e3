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
* ``optimizer``: weights, every gradient and the optimizer state (fused AdamW: no temporaries).
* ``load``: the weights (and DDP's buckets) before the first step. (``forward`` is the peak
  only at DDP's bucket rebuild with accumulation, see below.)

The loss head (``logits``, `planning.memory.device_memory`): chunked cross-entropy over the target tokens
(`train.loss`; ``TrainShape.target_share``), else the full logits (3 × b·s·V fp32). Gradients: DDP
on 2+ processes keeps them in its buckets (``gradient_as_bucket_view``, zeroed in place), alive
from the load on, with no other copy (but once, with accumulation: the bucket rebuild at the
second forward). On one process there is no wrapper: gradients live from the first backward to
the step. ``buffers``: FSDP's gathered parameters, autocast's 16-bit weight copies, QLoRA's
dequantized weight. Attention: SDPA with a mask (padding, or packing's block-diagonal one) and
eager attention keep a b·s² mask per layer and repeated key/value heads; ``homelab_packed``
(each sample alone, the worker's default) and FlashAttention-2 neither (`_masked`).

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
(`Budget.pcie_bytes_per_step`); `homelab_dp.planning.memory.offload_cost` prices them.

Bytes of the loss head: chunked cross-entropy or full logits (pure arithmetic, no torch).

The worker replaces lm_head by `homelab_dp.train.model.loss.ChunkedLossHead` for every model whose
logits are not changed after lm_head (`unsupported_reason`); Gemma-2's final logit softcapping
keeps the full logits path. The chunk size and the bytes of `train.loss`'s chunked
cross-entropy are defined here, in pure arithmetic, and the worker uses the same chunk size;
tests/unit/train/test_chunked_loss.py checks `chunk_peak_bytes` against measured live tensor bytes.

Activations saved for backward and the loss head's tensors, per device (pure arithmetic).

Part of the memory model (`homelab_dp.planning.memory.device_memory`, which budgets them with the model states):
what one decoder layer saves per token, what is saved outside the layers, what activation
checkpointing keeps, and the loss head's bytes (`homelab_dp.planning.memory.device_memory`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from homelab_dp.planning.attention_rule import PACKED_ATTENTION, packed_kernel
from homelab_dp.planning.memory.layer_kinds import blocks_activation_bytes, gemma4_layer_extra_bytes
from homelab_dp.planning.memory.mlp_tiles import (
    mlp_lora_outputs,
    mlp_tile_bytes,
    tiled_mlp_saved,
    tiles_mlp,
)
from homelab_dp.planning.memory.moe_memory import (
    adapted_experts,
    decoder_params,
    expert_width,
    largest_dequantized,
    largest_layer_params,
    largest_quantized,
    lora_outputs_per_layer,
    merged_expert_bytes,
    mlp_bytes_per_layer,
    mlp_temporaries,
)
from homelab_dp.planning.memory.objective_memory import (
    preference_head_bytes,
    reference_forward_bytes,
    reference_weight_bytes,
)
from homelab_dp.planning.memory.pinned_memory import (
    fsdp_offload_pinned_bytes,
    host_adamw_pinned_bytes,
    pinned_bytes,
    rounding,
)
from homelab_dp.planning.memory.train_shape import (
    TrainShape,
    attended_keys,
    attention_masked,
    compute_width,
    ddp_buckets,
    is_fsdp,
    lora_targets_of,
    offloads,
    plain_logits,
    trainable_params,
)
from homelab_dp.planning.model_spec import ModelSpec

CHUNK_ELEMENTS = 1 << 24
"""Logit elements per chunk: 2^24 (64 MiB in fp32), ~128 tokens at a 128k vocabulary, 8192 at
the demo's 2048 (a whole micro-batch)."""

FULL_LOGITS_TYPES = ("gemma2", "gemma4_text", "falcon_h1")
"""Model types whose forward transforms the logits after lm_head, for a spec that does not say
so itself (`ModelSpec.full_logits`), so the worker keeps the full logits path whatever the
config's values (`homelab_dp.train.model.loss.unsupported_reason` reads the forward's code): Gemma-2
and Gemma 4's final_logit_softcapping (Gemma 4 tests it for None there), Falcon-H1's
``lm_head_multiplier`` on the lm_head line itself."""


EAGER_ATTENTION_TYPES = ("gpt_oss",)
"""Model types with attention sinks (`homelab_dp.planning.attention_rule.SINK_TYPES`): the
worker attends through ``homelab_packed``'s ``"sinks"`` route, each sample's softmax written out
with the key/value heads repeated, budgeted as the eager attention it replaces (a mask row and
repeated key/value heads per token)."""


def kv_repeated(spec: ModelSpec, shape: TrainShape) -> bool:
    """Whether ``homelab_packed`` repeats the key/value heads of ``spec``'s grouped-query
    attention per sample on ``shape`` (`homelab_dp.planning.attention_rule.packed_kernel`'s
    ``"sdpa-repeat-kv"``: fp32 or a card below 8.0 on CUDA, so that SDPA's memory-efficient
    kernel runs instead of the math one): the key/value it saves are then query-wide."""
    if shape.attention != PACKED_ATTENTION or spec.kv_heads == spec.heads:
        return False
    capability = (7, 5) if shape.old_cards else None
    route = packed_kernel(shape.device, shape.dtype, capability, spec.head_dim, True,
                          window=spec.sliding_window > 0 and spec.sliding_layers > 0)  # fmt: skip
    return route == "sdpa-repeat-kv"


def _masked(spec: ModelSpec, shape: TrainShape) -> bool:
    """Whether attention allocates a b·s² mask and repeated key/value heads: SDPA's route
    (`attention_masked`) and eager attention do; ``homelab_packed`` (each sample alone,
    `train.model.packed_attention`) and FlashAttention-2 do not."""
    return attention_masked(shape) or spec.model_type in EAGER_ATTENTION_TYPES


def chunked_loss(spec: ModelSpec) -> bool:
    """Whether the worker computes the loss of ``spec``'s model chunk by chunk: not when its
    logits are transformed after lm_head (`ModelSpec.full_logits`; Gemma-2 always)."""
    return not (spec.full_logits or spec.model_type in FULL_LOGITS_TYPES)


def chunk_tokens(vocab: int) -> int:
    """Rows per chunk: ``CHUNK_ELEMENTS // vocab``, rounded down to a multiple of 8, at least 8."""
    return max(8, (CHUNK_ELEMENTS // max(1, vocab)) // 8 * 8)


def chunk_peak_bytes(
    vocab: int, hidden: int, tokens: int, compute_bytes: int, *, weight_bytes: int | None = None,
    hidden_bytes: int | None = None, weight_grad: bool = True, targets: int | None = None,
) -> dict[str, int]:  # fmt: skip
    """Bytes the chunked loss holds beyond its inputs: ``saved`` from its forward to its backward,
    and the extra at the forward's and the backward's peaks (on top of ``saved``).

    The terms are listed in `homelab_dp.train.model.loss`'s docstring. ``tokens``: the micro-batch's
    tokens; ``compute_bytes``: the matmul element size (2 under bf16/fp16, 4 in fp32, 8 in fp64);
    ``weight_bytes`` / ``hidden_bytes`` those of lm_head's weight and of the hidden states,
    ``weight_grad`` False when the weight is frozen. ``targets`` (default: ``tokens``) are the
    tokens with a loss: only their rows get logits; the hidden-state gradient has every row.
    """
    e, v, h, n = compute_bytes, vocab, hidden, (tokens if targets is None else targets)
    a = 8 if e == 8 else 4
    w_b, h_b = weight_bytes or e, hidden_bytes or e
    c = min(chunk_tokens(v), n)
    logits = c * v * a + (c * v * e if e != a else 0) + 4 * c * a + 64
    saved = n * (h * e + 16 + a) + (v * h * e if w_b != e else 0)
    grads = n * h * (e + (h_b if h_b != e else 0)) + tokens * h * h_b
    backward = logits + grads
    if weight_grad:
        product = c * v * e + v * h * e if e != a else 0
        cast = v * h * w_b if w_b != a else 0
        backward = max(logits, product, cast) + v * h * a + grads
    return {"saved": saved, "forward": logits, "backward": backward}


def full_logits_bytes(tokens: int, vocab: int, compute_bytes: int) -> dict[str, int]:
    """The full logits path: ``forward`` at the loss (the logits, in 16-bit beside their fp32
    copy, and the log-softmax output) and ``backward`` at its start (the log-softmax output and
    two fp32 gradients of vocabulary size; the worker drops the logits after the loss)."""
    fwd = tokens * vocab * (8 if compute_bytes == 4 else 10)
    return {"forward": fwd, "backward": tokens * vocab * 12}


def layer_activation_bytes(spec: ModelSpec, shape: TrainShape) -> float:
    """Bytes one decoder layer saves for backward, per token (SDPA; no checkpointing).

    LLaMA-style, fp32 (elements): the two residual sums, per RMSNorm its normalised input and
    its output (4h), q and k after RoPE, v, the attention output, and four intermediate-sized MLP
    tensors (gate, up, SiLU(gate), their product; a MoE layer's routed and shared experts as
    `homelab_dp.planning.memory.moe_memory.moe_mlp_bytes` says, averaged over the layers with
    the dense ones). 16-bit on CUDA: the residual stream and the
    norms stay fp32 under autocast, and the norm output is cast to 16-bit once more. GPT-2: the
    two LayerNorm outputs and residual sums, c_attn's q/k/v, the merged heads, c_fc's output and
    gelu_new's four tanh-formula tensors; dropout keeps one mask per site.
    """
    h, inter, a = spec.hidden, spec.intermediate, spec.heads
    experts_trained = shape.method == "full" or bool(adapted_experts(spec, lora_targets_of(shape)))
    attn, kvd = a * spec.head_dim, spec.kv_heads * spec.head_dim
    w = compute_width(shape)
    cpu = shape.device == "cpu"
    small = 4 * (2 + a)  # per-token norm statistics and SDPA's log-sum-exp, fp32
    if spec.blocks:  # layer groups: each kind's own bytes (`planning.memory.layer_kinds`)
        out = blocks_activation_bytes(
            spec, w, experts_trained=experts_trained, frozen_norms=shape.method != "full",
            masked_kv=_masked(spec, shape), seq_len=shape.seq_len,
        )  # fmt: skip
    elif spec.model_type == "gpt2":
        out = w * (8 * h + 5 * inter) + small
        if spec.hidden_dropout > 0:
            out += 2 * h * (w if cpu else 1)  # CPU dropout keeps a float mask, CUDA a bool one
    else:
        if _masked(spec, shape) or kv_repeated(spec, shape):
            # With a mask (padding, or packing's block-diagonal one) SDPA converts it to an
            # additive (b, 1, s, s) one per layer, and transformers repeats the key/value heads;
            # homelab_packed repeats them per sample where SDPA's flash kernel cannot run.
            kvd = attn
        rest = 2 * attn + 2 * kvd
        if spec.model_type == "phi3":
            rest += attn + kvd  # the fused qkv output stays alive beside the rotated q and k
        mlp = tiled_mlp_saved(spec, shape, mlp_bytes_per_layer(spec, w, experts_trained))
        out = (24 * h if w == 4 else 28 * h) + w * rest + mlp + small
        if shape.method != "full":
            out -= 2 * 4 * h  # frozen norm weights: the normalised input is not saved
        if _masked(spec, shape):
            out += shape.seq_len * w
        if spec.model_type == "gemma2":
            out += 4 * h * 4  # post-attention and post-MLP norms keep their input and output
        if spec.model_type == "gemma4_text":
            out += gemma4_layer_extra_bytes(spec, w)
    if cpu and spec.attention_dropout > 0:
        # SDPA has no fused CPU kernel with dropout: the math kernel keeps the softmax, the
        # dropout mask and the dropped probabilities, each heads × the keys a token attends
        # (the whole row under SDPA's mask, its own sample under homelab_packed). With one
        # sequence it scales q and k as views of c_attn's output, which then stays alive.
        out += 3 * a * attended_keys(shape) * w + (2 * h * w if shape.micro_batch == 1 else 0)
    if shape.method != "full":
        adapters = lora_outputs_per_layer(spec, lora_targets_of(shape))
        if tiles_mlp(spec, shape):  # the MLP's adapters save inside the tiles only
            adapters -= mlp_lora_outputs(spec, shape)
        out += adapters * shape.lora_r * w  # lora_A
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
    if spec.experts is not None and spec.experts.aux_loss_coef > 0:
        # The router's load-balancing loss keeps the fp32 softmax of every MoE layer's router
        # logits for backward (measured: tokens × experts × 4 bytes per layer).
        outer += spec.experts.layers * tokens * spec.experts.count * 4
    if shape.activation_checkpointing:
        # Each layer keeps only its output (the next layer's input), in the residual dtype.
        res = 4 if shape.dtype == "fp32" or not is_fsdp(shape) else 2
        return int(spec.layers * spec.hidden * res * tokens + outer)
    merged = spec.layers * merged_layer_bytes(spec, shape)
    return int(spec.layers * layer_activation_bytes(spec, shape) * tokens + outer + merged)


def merged_layer_bytes(spec: ModelSpec, shape: TrainShape) -> float:
    """LoRA on routed experts: the folded ``W + B·A`` expert weights a layer saves for backward
    (`homelab_dp.planning.memory.moe_memory.merged_expert_bytes`), averaged over the layers."""
    if shape.method == "full" or spec.experts is None:
        return 0.0
    per_moe = merged_expert_bytes(spec, lora_targets_of(shape), compute_width(shape))
    return per_moe * spec.experts.layers / spec.layers


def loss_head_bytes(spec: ModelSpec, shape: TrainShape) -> dict[str, int]:
    """The loss head's bytes at the forward's and at the backward's peak (`planning.memory.device_memory`).

    Chunked cross-entropy where the worker installs it: its saved tensors plus its peak extra;
    the matmul runs in the compute dtype, lm_head's weight is fp32 for a full fine-tune under
    DDP (cast, and the cast saved, under autocast) and in the compute dtype otherwise, and the
    hidden states arrive in fp32 when the residual stream is fp32 (full, unsharded).
    """
    tokens, w = shape.micro_batch * shape.seq_len, compute_width(shape)
    if plain_logits(shape):  # the plain logits path (`planning.memory.objective_memory`)
        head = preference_head_bytes(spec, shape)
        return {"forward": head["forward"], "backward": head["backward"]}
    if not chunked_loss(spec):
        return full_logits_bytes(tokens, spec.vocab, w)
    full = shape.method == "full"
    fp32_master = full and not is_fsdp(shape)
    weight_w = 4 if fp32_master else (w if shape.device == "cuda" or full else 4)
    hidden_w = 4 if fp32_master or shape.device == "cpu" else w
    targets = min(tokens, math.ceil(tokens * shape.target_share))
    b = chunk_peak_bytes(spec.vocab, spec.hidden, tokens, w, weight_bytes=weight_w,
                         hidden_bytes=hidden_w, weight_grad=full, targets=targets)  # fmt: skip
    return {"forward": b["saved"] + b["forward"], "backward": b["saved"] + b["backward"]}


def loss_head_saved(spec: ModelSpec, shape: TrainShape) -> list[float]:
    """The loss head's tensors saved from forward to backward, one entry per tensor.

    Chunked (`planning.memory.device_memory.chunk_peak_bytes`' ``saved``): the target rows of the hidden
    states, their labels and row indices (int64), the per-token log-sum-exp (fp32) and, when
    lm_head's weight is not in the compute dtype, its cast. Full logits: the fp32 log-softmax.
    """
    tokens, w = shape.micro_batch * shape.seq_len, compute_width(shape)
    if plain_logits(shape):
        return [float(preference_head_bytes(spec, shape)["saved"])]
    if not chunked_loss(spec):
        return [tokens * spec.vocab * 4.0]
    full = shape.method == "full"
    fp32_master = full and not is_fsdp(shape)
    weight_w = 4 if fp32_master else (w if shape.device == "cuda" or full else 4)
    n = min(tokens, math.ceil(tokens * shape.target_share))
    acc = 8 if w == 8 else 4
    parts = [float(n * spec.hidden * w), n * 8.0, n * 8.0, float(n * acc)]
    if weight_w != w:
        parts.append(float(spec.vocab * spec.hidden * w))
    return parts


def moved_activation_bytes(spec: ModelSpec, shape: TrainShape) -> int:
    """Bytes ``train.offload_activations`` sends to host memory each micro-step (each comes back
    once in backward): the activations saved for backward (`activation_bytes`) and the loss
    head's saved tensors; weights, buffers and autocast's weight casts stay on the card
    (`homelab_dp.train.parallelism.activation_offload`)."""
    return int(activation_bytes(spec, shape) + sum(loss_head_saved(spec, shape)))


def pinned_activation_bytes(spec: ModelSpec, shape: TrainShape) -> int:
    """Host bytes those tensors pin: each saved tensor is pinned on its own, rounded up to a power
    of two (`planning.memory.pinned_memory`), and the blocks are reused by the next micro-step.

    Every activation is tokens × d elements, so it rounds by ``rounding(tokens · d)`` whatever
    its element size (a power of two): d is the intermediate size for the MLP's tensors, the
    query and the key/value widths for attention's, the sequence length for SDPA's mask, one for
    the batch's int64 tensors and the hidden size for the rest (the residual stream, the norms;
    LoRA's narrow outputs and per-token statistics are counted there too, an approximation).
    """
    tokens = shape.micro_batch * shape.seq_len
    h, inter = spec.hidden, spec.intermediate

    def r(d: float) -> float:
        return rounding(tokens * d)

    head = sum(pinned_bytes(t) for t in loss_head_saved(spec, shape))
    rope = 2 * pinned_bytes(shape.seq_len * spec.head_dim * 4)
    outer = outer_activation_bytes(spec, shape) - 24
    outer_pinned = outer * tokens * r(h) + 3 * pinned_bytes(8 * tokens)
    if shape.activation_checkpointing:
        res = 4 if shape.dtype == "fp32" or not is_fsdp(shape) else 2
        return int(spec.layers * h * res * tokens * r(h) + outer_pinned + rope + head)
    w = compute_width(shape)
    attn, kvd = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    total = layer_activation_bytes(spec, shape)
    if spec.blocks:  # layer groups: every tensor rounded as a hidden-wide one (approximate)
        parts = []
    elif spec.model_type == "gpt2":
        parts = [(inter, 5 * inter * w)]
    else:
        if _masked(spec, shape) or kv_repeated(spec, shape):
            kvd = attn
        extra = (attn + kvd) if spec.model_type == "phi3" else 0
        routed = spec.experts.top_k * expert_width(spec) if spec.experts else inter
        trained = shape.method == "full" or bool(adapted_experts(spec, lora_targets_of(shape)))
        mlp = tiled_mlp_saved(spec, shape, mlp_bytes_per_layer(spec, w, trained))
        parts = [(routed, mlp), (attn, (2 * attn + extra) * w), (kvd, 2 * kvd * w)]
        if _masked(spec, shape):
            parts.append((shape.seq_len, shape.seq_len * w))
    rest = total - sum(b for _, b in parts)
    layer = sum(b * r(d) for d, b in parts) + rest * r(h)
    return int(spec.layers * layer * tokens + outer_pinned + rope + head)


def logits_bytes(spec: ModelSpec, shape: TrainShape) -> int:
    """The loss head's bytes at the start of backward (the ``logits`` component)."""
    return loss_head_bytes(spec, shape)["backward"]


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
        # fp32 master weights; a vision tower is frozen in the compute dtype (no master copy).
        frozen = spec.vision_params
        weights = ((spec.params - frozen) * 4 + frozen * base_w) / (n if fsdp else 1)
        shard = weights if fsdp else 0.0
        grads = trainable * 4 / (n if fsdp else 1)
        opt = opt / (1 if shape.distribution == "ddp" else n)
        if shape.distribution == "fsdp-grad-op":
            buffers += spec.params * w  # unsharded parameters kept from forward to backward
        elif shape.distribution == "fsdp-full":
            # The root unit (embeddings, final norm, lm_head) stays gathered after forward,
            # plus the current and the prefetched decoder layer.
            buffers += (root + 2 * largest_layer_params(spec)) * w
        elif shape.device == "cuda" and w == 2:
            # autocast's 16-bit copies of the trained weights, saved for backward
            buffers += (spec.params - frozen) * w
    elif shape.method == "qlora" and fsdp:
        # FSDP2 shards the packed weights, the 16-bit rest and the fp32 adapters (weights,
        # gradients, AdamW state: /N); the quantization state stays whole on every rank.
        packed, state, rest = _qlora_packed(spec, shape)
        shard = (packed + rest + trainable * 4) / n
        weights, grads, opt = shard + state, trainable * 4 / n, opt / n
        if shape.distribution == "fsdp-grad-op":
            buffers += packed + rest + trainable * 4  # every unit gathered forward to backward
        else:  # the root unit after forward, the current and the prefetched decoder layer
            q_layer = (
                largest_layer_params(spec)
                - spec.norm_params_per_layer
                - spec.other_params_per_layer
            )
            router = (
                spec.experts.router_params + spec.experts.shared_gate_params if spec.experts else 0
            )
            layer = (q_layer - router) * NF4_PACKED_BYTES + trainable * 4 / spec.layers
            other = spec.norm_params_per_layer + spec.other_params_per_layer + router
            buffers += root * base_w + 2 * (layer + other * base_w)
        buffers += 2 * largest_dequantized(spec) * base_w  # dequantized for the matmul
    else:
        if shape.method == "qlora":
            other = spec.params - spec.quantizable_params  # embeddings, lm_head, norms
            base = spec.quantizable_params * NF4_BYTES_PER_PARAM + other * base_w
            buffers += (
                2 * largest_dequantized(spec) * base_w
            )  # one linear (or one expert) dequantized at a time for the matmul
        else:
            base = spec.params * base_w
            if fsdp:  # gathered as for a full fine-tune: grad-op everything, full the root
                shard = base / n + trainable * 4  # unit and two layers (counted as weights)
                kept = spec.params if shape.distribution == "fsdp-grad-op" else (
                    root + 2 * largest_layer_params(spec))  # fmt: skip
                base = base / n + kept * base_w
        weights = base + trainable * 4
        grads = trainable * 4
    if shape.method != "full" and shape.device == "cuda" and shape.dtype == "fp16":
        # Under fp16 the frozen base keeps its embeddings and norms in fp32 (train.lora.
        # residual_in_fp32: the residual stream must not overflow fp16): 2 bytes more each.
        # FSDP is never planned in fp16, so nothing here is sharded.
        weights += 2 * (spec.embedding_params + spec.final_norm_params
                        + sum(g.count * g.kind.norm_params for g in spec.layer_groups))  # fmt: skip
    # train.reference = "copy": the frozen reference model beside the trained one.
    weights += reference_weight_bytes(spec, shape)
    # DDP on 2+ processes: the gradients are views of its buckets, alive from the load on.
    resident = trainable * 4 if ddp_buckets(shape) else 0.0
    # AdamW is fused on the CPU and CUDA alike (`train.parallelism.strategy.build_optimizer`): no
    # temporary per parameter (foreach AdamW's sqrt of v, the CPU's until issue 33).
    step_temp = 0.0
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
    (`homelab_dp.planning.memory.pinned_memory`): each FSDP2 shard and gradient shard on its own,
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


def device_states(spec: ModelSpec, shape: TrainShape) -> dict[str, float]:
    """The model states of ``shape`` on the device once its offload is applied (bytes):
    ``weights``, ``grads``, ``opt``, ``buffers``, ``resident`` (DDP's buckets),
    ``accum_grads``, ``step_temp``, ``trainable``, ``shard``, ``host``, ``pcie``. What
    `budget` starts from; GRPO's generation phase (`homelab_dp.planning.grpo_plan`) too."""
    return _offload(spec, shape, _model_states(spec, shape))


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
    layer = layer_activation_bytes(spec, shape) * tokens + merged_layer_bytes(spec, shape)
    res = 4 if shape.dtype == "fp32" or not fsdp else 2
    saved = spec.hidden * res * tokens if shape.activation_checkpointing else layer
    outer = activation_bytes(spec, shape) - spec.layers * saved
    temps = (spec.hidden + mlp_temporaries(spec)) * tokens * w
    if tiles_mlp(spec, shape):  # one tile's MLP at a time, beside the whole input gradient
        temps = 2 * spec.hidden * tokens * w + mlp_tile_bytes(spec, shape)
    if shape.method == "full":
        head = (spec.lm_head_params or spec.embedding_params) * 4 / (n if fsdp else 1)
        per_layer = decoder_params(spec) / spec.layers * 4 / (n if fsdp else 1)
        if fsdp:
            # the layer's unsharded gradient before reduce-scatter
            temps += largest_layer_params(spec) * 4
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
    memory (`_offload`); with the activations offloaded (`train.parallelism.activation_offload`) every
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
    # The reference's no-grad forward (and KTO's KL forward) runs before the policy's: nothing
    # of the policy is saved yet (`planning.memory.objective_memory`).
    reference = (
        base + held + reference_forward_bytes(spec, shape, layer_activation_bytes(spec, shape))
    )
    # With accumulation DDP rebuilds its buckets at a forward after the first step, before any
    # activation: the old buckets (the gradients' views) beside the new ones, and the batch.
    rebuilds = s["resident"] and shape.grad_accum > 1
    rebuild = base + 2 * s["resident"] + 24 * tokens if rebuilds else 0
    load = s["weights"] + s["resident"]
    if shape.method == "qlora" and is_fsdp(shape):
        # Rank 0 streams the checkpoint (`train.model.quantized_load`): beside its shards, the tensor
        # in hand in the compute dtype (the largest: an embedding, lm_head or a linear).
        largest = max(spec.embedding_params, spec.lm_head_params, largest_quantized(spec))
        load += largest * (compute_width(shape) if shape.device == "cuda" else 4)
    phases = {
        "load": load,
        "forward": max(forward, rebuild, reference),
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
