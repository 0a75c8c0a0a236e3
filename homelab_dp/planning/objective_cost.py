"""What the training objective costs: the resolved reference, the sequences per sample, the
extra no-grad forwards and the precompute pass (pure; the ``objective`` block of `plan --json`).

SFT costs nothing beyond its tokens. DPO, ORPO and KTO put two sequences per sample through the
model (`homelab_dp.planning.memory.objective_memory.forward_rows`; their memory is budgeted
there); DPO and KTO also need reference log-probabilities, from ``train.reference``:

* ``adapters`` (LoRA/QLoRA, what "auto" picks for them): the same base with the adapters
  disabled, one no-grad forward per micro-batch;
* ``precompute`` (what "auto" picks for a full fine-tune): one data-parallel no-grad pass over
  the data before step 1, cached; each step then costs what ORPO's does;
* ``copy``: a frozen copy of the starting model on every device, one no-grad forward per
  micro-batch.

KTO adds its KL forward (the policy without grad on the mismatched completions). The step time
grows by `homelab_dp.planning.flops.objective_flops_factor`; the precompute pass costs a
forward-only share of an epoch (`ObjectiveCost.precompute_share`), in seconds once the data's
tokens and a throughput are known (`precompute_seconds`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from homelab_dp.planning.flops import (
    causal_span,
    flops_per_token,
    no_grad_forward_flops_per_token,
    no_grad_forwards,
    objective_flops_factor,
)
from homelab_dp.planning.memory.objective_memory import (
    SEQUENCES_PER_SAMPLE,
    forward_rows,
    reference_weight_bytes,
)
from homelab_dp.planning.memory.train_shape import TrainShape
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.vocabulary import PREFERENCE_OBJECTIVES

REFERENCE_OBJECTIVES = ("dpo", "kto")
"""The objectives that compare the policy with a reference model (ORPO needs none)."""


def resolve_reference(objective: str, reference: str, method: str) -> str:
    """The reference a run uses: "none" for SFT and ORPO; "auto" is adapters for LoRA and
    QLoRA (the same base, no second copy) and precompute for a full fine-tune (nothing held
    while training); a named one stays. One the method cannot have (adapters with a full
    fine-tune, a copy with LoRA/QLoRA: the preset's checks refuse them when the method is
    pinned) resolves as "auto" would, so the planner's what-ifs of another method price what
    that method would run."""
    if objective not in REFERENCE_OBJECTIVES:
        return "none"
    lora = method in ("lora", "qlora")
    if reference == "auto" or reference == ("copy" if lora else "adapters"):
        return "adapters" if lora else "precompute"
    return reference


@dataclass(frozen=True)
class ObjectiveCost:
    """What the objective adds to one planned option."""

    name: str
    """`train.objective`: sft | dpo | orpo | kto."""
    reference: str
    """The resolved `train.reference`: none | adapters | precompute | copy."""
    sequences_per_sample: int
    """Sequences a sample puts through the model: 1 (SFT), 2 (a pair; KTO: a completion and its
    KL completion)."""
    rows_per_micro_batch: int
    """Rows of one micro-batch's forward (packed: one per sample, 2 × seq_len long)."""
    row_len: int
    """Tokens per row."""
    no_grad_forwards: int
    """No-grad forwards per micro-batch besides the policy's (reference, KTO's KL)."""
    step_flops_factor: float
    """A step's model FLOPs ÷ those of its trained tokens alone (1.0: nothing extra)."""
    reference_weight_bytes: int
    """Per device: a frozen reference copy's weights (``copy``), else 0."""
    precompute_share: float | None
    """``precompute``: the pass's FLOPs ÷ one epoch's training FLOPs (None otherwise)."""
    precompute_seconds: float | None = None
    """``precompute``: the pass's seconds, once the data's tokens and a throughput are known."""

    @property
    def extra_step_fraction(self) -> float:
        """The share the no-grad forwards add to a step's compute (0.25: +25%)."""
        return self.step_flops_factor - 1.0

    def to_json(self) -> dict[str, Any]:
        """The ``objective`` block of `plan --json` (new keys only may be added)."""
        return {
            "name": self.name,
            "reference": self.reference,
            "sequences_per_sample": self.sequences_per_sample,
            "rows_per_micro_batch": self.rows_per_micro_batch,
            "row_len": self.row_len,
            "no_grad_forwards_per_micro_batch": self.no_grad_forwards,
            "step_flops_factor": self.step_flops_factor,
            "reference_weight_bytes": self.reference_weight_bytes,
            "precompute_share_of_epoch": self.precompute_share,
            "precompute_seconds": self.precompute_seconds,
        }


def objective_cost(
    spec: ModelSpec,
    shape: TrainShape,
    *,
    micro_batch: int,
    seq_len: int,
    lora_r: int = 16,
    lora_targets: str | list[str] = "all-linear",
) -> ObjectiveCost:
    """The cost of ``shape``'s objective (``shape``: the memory model's, rows already laid out;
    ``micro_batch`` and ``seq_len``: the preset's samples per micro-batch and tokens per
    sequence). The attention span is one sequence's (a pair's sequences never attend to each
    other)."""
    rows, row_len = forward_rows(micro_batch, seq_len, packed=shape.packed,
                                 objective=shape.objective)  # fmt: skip
    span = causal_span(seq_len)
    kw = {"method": shape.method, "activation_checkpointing": shape.activation_checkpointing,
          "attention_span": span, "lora_r": lora_r, "lora_targets": lora_targets}  # fmt: skip
    factor = objective_flops_factor(spec, objective=shape.objective, reference=shape.reference,
                                    **kw)  # type: ignore[arg-type]  # fmt: skip
    forwards = no_grad_forwards(shape.objective, shape.reference)
    share = None
    if shape.reference == "precompute":
        train = flops_per_token(spec, **kw)  # type: ignore[arg-type]
        share = no_grad_forward_flops_per_token(spec, attention_span=span) / train
    return ObjectiveCost(
        name=shape.objective,
        reference=shape.reference,
        sequences_per_sample=SEQUENCES_PER_SAMPLE
        if shape.objective in PREFERENCE_OBJECTIVES
        else 1,
        rows_per_micro_batch=rows,
        row_len=row_len,
        no_grad_forwards=forwards,
        step_flops_factor=factor,
        reference_weight_bytes=reference_weight_bytes(spec, shape),
        precompute_share=share,
    )


def precompute_seconds(
    cost: ObjectiveCost, *, epoch_tokens: int, tokens_per_s: float
) -> float | None:
    """Seconds of the precompute pass over data of ``epoch_tokens`` tokens (both sequences of
    every pair), for a run that trains ``tokens_per_s`` tokens a second on all its devices
    together (the pass is data-parallel too): one epoch's training time × its forward-only
    share. None when the run precomputes nothing or the throughput is not known."""
    if cost.precompute_share is None or tokens_per_s <= 0 or epoch_tokens <= 0:
        return None
    return epoch_tokens / tokens_per_s / cost.step_flops_factor * cost.precompute_share


def sequence_len(shape: TrainShape) -> int:
    """Tokens of one sequence of ``shape``'s forward (the attention span's length): a packed
    preference row holds a pair's two sequences, each attending only to itself. A sequence split
    over ranks (``sequence_parallel``) attends over all of it, not one rank's share."""
    if shape.objective in PREFERENCE_OBJECTIVES and shape.packed:
        return max(1, shape.seq_len // SEQUENCES_PER_SAMPLE)
    return shape.seq_len * shape.sequence_parallel


def shape_flops_factor(spec: ModelSpec, shape: TrainShape) -> float:
    """`homelab_dp.planning.flops.objective_flops_factor` of a memory-model shape (its resolved
    objective and reference): what the time model multiplies a trained token's FLOPs by."""
    targets = (
        shape.lora_targets if isinstance(shape.lora_targets, str) else list(shape.lora_targets)
    )
    return objective_flops_factor(
        spec, objective=shape.objective, reference=shape.reference, method=shape.method,
        activation_checkpointing=shape.activation_checkpointing,
        attention_span=causal_span(sequence_len(shape)), lora_r=shape.lora_r,
        lora_targets=targets,
    )  # fmt: skip
