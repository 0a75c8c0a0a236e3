"""Activations saved for backward and the loss head's tensors, per device (pure arithmetic).

Part of the memory model (`homelab_dp.core.memory`, which budgets them with the model states):
what one decoder layer saves per token, what is saved outside the layers, what activation
checkpointing keeps, and the loss head's bytes (`homelab_dp.core.logits_memory`).
"""

from __future__ import annotations

import math

from homelab_dp.core.logits_memory import chunk_peak_bytes, chunked_loss, full_logits_bytes
from homelab_dp.core.model_spec import ModelSpec
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


def logits_bytes(spec: ModelSpec, shape: TrainShape) -> int:
    """The loss head's bytes at the start of backward (the ``logits`` component)."""
    return loss_head_bytes(spec, shape)["backward"]
