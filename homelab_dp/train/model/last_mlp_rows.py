"""The last decoder layer's MLP on the rows that have a loss target, and on no other.

A causal LM's last decoder layer feeds only position-wise steps (a residual add, the final norm,
lm_head) before the loss, so a row (a token position) whose next token has no target (a
prompt, a chat template's framing, the padding at a block's end) never reaches the loss
through that layer's MLP: its MLP output is computed and differentiated for nothing. Earlier
layers are different: their rows feed later tokens through attention. Within
`homelab_dp.train.model.loss.ChunkedLossHead.targets` (the SFT step and the evaluation's loss,
where the labels are known before the forward), `skip_untargeted_rows`' forward runs the MLP on
the target rows only (``index_select``) and writes them into zeros (``index_copy``); outside it
(generation, the packing check, the preference objectives' log-probabilities) the MLP runs as
before.

Exact: the loss and every gradient are those of the whole MLP; the skipped rows' outputs are
zeros instead of values nothing reads, and their gradient was zero anyway (the loss does not
depend on them). Only the rounding of a matrix product over fewer rows may differ.
`tests/unit/train/test_last_mlp_rows.py` checks it. On `benchmarks/vs_hf_trainer.py`'s
4-layer model and ragged instruction data, about a third of a block's rows have no target:
+4.6% real tokens/s (A/B, 4 interleaved repeats); the share of compute it saves is the
untargeted rows' share times one layer's MLP over the model's, so a 28-layer model gains
about an eighth of that.

Not installed (`row_skip_refusal` says why) without the chunked loss head, with activation
checkpointing (the recompute runs after ``targets`` has ended, so it would see other rows), with
``torch.compile`` (a data-dependent row count per micro-step), under sequence parallelism (a
rank holds a shard of each sequence), for a MoE model (its routing and load-balancing loss see
every token) or a last layer without a dense ``mlp``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from homelab_dp.train.model.lora import is_moe
from homelab_dp.train.model.loss import ChunkedLossHead


def row_skip_refusal(
    model: nn.Module, layers: list[nn.Module], head: ChunkedLossHead | None, *,
    checkpointing: bool, compiling: bool, sequence_split: bool,
) -> str | None:  # fmt: skip
    """Why the last layer's MLP must run on every row here, or None when it may skip."""
    if head is None:
        return "no chunked loss head (the full cross-entropy reads every row's logits)"
    if checkpointing:
        return "activation checkpointing recomputes the layer outside the loss's targets"
    if compiling:
        return "torch.compile would see a different row count every micro-step"
    if sequence_split:
        return "sequence parallelism: each rank holds a shard of the sequence"
    if not layers or not isinstance(getattr(layers[-1], "mlp", None), nn.Module):
        return "the last decoder layer has no mlp"
    if is_moe(model):
        return "a MoE model: routing and its load-balancing loss see every token"
    return None


def skip_untargeted_rows(layer: nn.Module, head: ChunkedLossHead) -> None:
    """Make ``layer.mlp`` compute only the rows with a target while ``head.targets`` is active
    (the module's forward as it is now: a tiled MLP stays tiled)."""
    mlp = layer.mlp
    inner = mlp.forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows = head.target_rows()
        flat = x.reshape(-1, x.shape[-1])
        # Outside the targets, or labels that are not these rows' (then nothing is skipped).
        if rows is None or head.label_count() != flat.shape[0] or rows.numel() == flat.shape[0]:
            return inner(x, *args, **kwargs)
        rows = rows.to(x.device, non_blocking=True)
        # An empty selection still runs: every parameter gets its (zero) gradient, as DDP
        # expects of each backward.
        y = inner(flat.index_select(0, rows).unsqueeze(0), *args, **kwargs).squeeze(0)
        out = y.new_zeros(flat.shape[0], y.shape[-1]).index_copy(0, rows, y)
        return out.view(*x.shape[:-1], y.shape[-1])

    mlp.forward = forward
