"""What a preference objective (DPO, ORPO, KTO) adds to the memory of a step (pure arithmetic).

Part of the memory model (`homelab_dp.planning.memory.device_memory` budgets these terms with
the rest). A preference objective differs from SFT in four ways, each modelled here as the
worker runs it (`homelab_dp.train.objectives`):

* **Two sequences per sample.** ``train.micro_batch`` counts pairs (KTO: completions, each with
  its mismatched "KL" completion). Packed, whole pairs fill rows of 2 × ``data.seq_len``
  tokens; unpacked, each pair is two padded rows of ``data.seq_len`` (`forward_rows`). The
  planner budgets the forward's rows and their length, so activations, attention masks and
  logits are those of 2 × micro × seq_len tokens.
* **The plain logits path.** The log-probabilities need the logits of every response token
  (`homelab_dp.train.objectives.preference_losses.sequence_log_probs`): the model's full
  [rows, len, vocab] logits in the compute dtype, of which the target rows are copied to fp32
  and normalised (log-sum-exp). Measured on the CPU (live tensor bytes): the forward's peak is
  the logits beside that fp32 copy; the backward's start holds the copy, the two fp32
  gradients of its rows and the logits' gradient (`preference_head_bytes`).
* **The reference forward** (DPO/KTO, ``train.reference`` adapters or copy): one no-grad forward
  per micro-batch, before the policy's, so nothing of it is saved; its peak is its own logits
  head and one layer's transient tensors (`reference_forward_bytes`). ``copy`` also holds a
  frozen fp32 copy of the weights on every device (`reference_weight_bytes`); ``precompute`` holds
  nothing but the cached log-probabilities (two numbers per pair). KTO's KL forward (policy,
  no grad, at the step's start) peaks the same way.
* ORPO has no reference.
"""

from __future__ import annotations

import math

from homelab_dp.planning.memory.train_shape import TrainShape, compute_width, preference
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.vocabulary import PREFERENCE_OBJECTIVES

SEQUENCES_PER_SAMPLE = 2
"""Sequences a preference sample puts through the model: chosen and rejected (KTO: the
completion and its mismatched KL completion)."""


def forward_rows(
    micro_batch: int, seq_len: int, *, packed: bool, objective: str
) -> tuple[int, int]:
    """(rows, row length) of one micro-batch's forward for ``micro_batch`` samples.

    SFT: ``micro_batch`` rows of ``seq_len``. A preference objective: packed, ``micro_batch``
    rows of 2 × ``seq_len`` (whole pairs, chosen then rejected, positions restarting); unpacked,
    2 × ``micro_batch`` rows of ``seq_len`` (row 0 chosen, row 1 rejected, padded). Either way
    2 × micro × seq_len tokens.
    """
    if objective not in PREFERENCE_OBJECTIVES:
        return micro_batch, seq_len
    if packed:
        return micro_batch, SEQUENCES_PER_SAMPLE * seq_len
    return SEQUENCES_PER_SAMPLE * micro_batch, seq_len


def head_targets(shape: TrainShape) -> int:
    """Target tokens of a micro-batch whose logits the loss normalises (at most every token;
    ``TrainShape.target_share`` once the data is read)."""
    tokens = shape.micro_batch * shape.seq_len
    return min(tokens, math.ceil(tokens * shape.target_share))


def preference_head_bytes(spec: ModelSpec, shape: TrainShape) -> dict[str, int]:
    """The plain logits path of a preference objective: bytes at the forward's peak, at the
    backward's start, and ``saved`` (alive from the loss to the backward).

    N tokens, T targets, V vocabulary, w the compute width. Forward: the logits (N·V·w), the
    target rows' fp32 copy (T·V·4) and, in 16-bit, the gathered rows before the cast (T·V·w).
    Backward: the saved fp32 copy, its gradient and log-sum-exp's (2 × T·V·4), and the logits'
    gradient (N·V·w) scattered back from the target rows.
    """
    tokens, vocab, w = shape.micro_batch * shape.seq_len, spec.vocab, compute_width(shape)
    targets = head_targets(shape)
    logits = tokens * vocab * w
    rows32 = targets * vocab * 4
    forward = logits + rows32 + (targets * vocab * w if w != 4 else 0)
    backward = 3 * rows32 + logits
    return {"forward": forward, "backward": backward, "saved": rows32}


def reference_weight_bytes(spec: ModelSpec, shape: TrainShape) -> int:
    """``train.reference = "copy"``: a frozen copy of the starting model on every device (the
    worker deep-copies the unwrapped model of a full fine-tune under DDP or ZeRO-1: its fp32
    weights, 4 bytes each); nothing for the other modes."""
    if shape.reference != "copy":
        return 0
    return spec.params * 4


def no_grad_forwards(shape: TrainShape) -> int:
    """No-grad forwards per micro-batch besides the policy's: the reference's (adapters or
    copy); KTO adds its KL forward of the policy (at the step's start, micro-batch by
    micro-batch, the same size)."""
    if not preference(shape):
        return 0
    ref = 1 if shape.reference in ("adapters", "copy") else 0
    return ref + (1 if shape.objective == "kto" else 0)


def reference_forward_bytes(spec: ModelSpec, shape: TrainShape, layer_bytes: float) -> int:
    """The peak of one no-grad forward (the reference's, or KTO's KL forward) beyond the model
    states: its logits head (`preference_head_bytes` forward) and, at most, one decoder layer's
    tensors (``layer_bytes`` per token, the activations a layer would save), freed as it goes.
    0 when the objective runs none."""
    if no_grad_forwards(shape) == 0:
        return 0
    tokens = shape.micro_batch * shape.seq_len
    head = preference_head_bytes(spec, shape)["forward"]
    return int(max(head, layer_bytes * tokens))
