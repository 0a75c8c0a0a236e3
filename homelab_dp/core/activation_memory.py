"""Activations saved for backward and the loss head's tensors, per device (pure arithmetic).

Part of the memory model (`homelab_dp.core.memory`, which budgets them with the model states):
what one decoder layer saves per token, what is saved outside the layers, what activation
checkpointing keeps, and the loss head's bytes (`homelab_dp.core.logits_memory`).
"""

from __future__ import annotations

import math

from homelab_dp.core.logits_memory import chunk_peak_bytes, chunked_loss, full_logits_bytes
from homelab_dp.core.model_spec import ModelSpec
from homelab_dp.core.pinned_memory import pinned_bytes, rounding
from homelab_dp.core.shape import (
    TrainShape,
    attention_masked,
    compute_width,
    is_fsdp,
    lora_targets_of,
)


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
        out += len(spec.lora_targets(lora_targets_of(shape))) * shape.lora_r * w  # lora_A outputs
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


def loss_head_saved(spec: ModelSpec, shape: TrainShape) -> list[float]:
    """The loss head's tensors saved from forward to backward, one entry per tensor.

    Chunked (`core.logits_memory.chunk_peak_bytes`' ``saved``): the target rows of the hidden
    states, their labels and row indices (int64), the per-token log-sum-exp (fp32) and, when
    lm_head's weight is not in the compute dtype, its cast. Full logits: the fp32 log-softmax.
    """
    tokens, w = shape.micro_batch * shape.seq_len, compute_width(shape)
    if not chunked_loss(spec.model_type):
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
    (`homelab_dp.train.activation_offload`)."""
    return int(activation_bytes(spec, shape) + sum(loss_head_saved(spec, shape)))


def pinned_activation_bytes(spec: ModelSpec, shape: TrainShape) -> int:
    """Host bytes those tensors pin: each saved tensor is pinned on its own, rounded up to a power
    of two (`core.pinned_memory`), and the blocks are reused by the next micro-step.

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
    if spec.model_type == "gpt2":
        parts = [(inter, 5 * inter * w)]
    else:
        if attention_masked(shape):
            kvd = attn
        extra = (attn + kvd) if spec.model_type == "phi3" else 0
        parts = [(inter, 4 * inter * w), (attn, (2 * attn + extra) * w), (kvd, 2 * kvd * w)]
        if attention_masked(shape):
            parts.append((shape.seq_len, shape.seq_len * w))
    rest = total - sum(b for _, b in parts)
    layer = sum(b * r(d) for d, b in parts) + rest * r(h)
    return int(spec.layers * layer * tokens + outer_pinned + rope + head)


def logits_bytes(spec: ModelSpec, shape: TrainShape) -> int:
    """The loss head's bytes at the start of backward (the ``logits`` component)."""
    return loss_head_bytes(spec, shape)["backward"]
