"""Supervised fine-tuning: the summed token cross-entropy over the target tokens.

The unit is the target token: a step's loss is the sum of token losses over the whole
effective batch divided by its target tokens, so N ranks × micro m equals one process with
micro N·m, or with accumulation, on any data (`train.loop.training_loop`'s exactness).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from homelab_dp.train.loop.device_copy import to_device
from homelab_dp.train.loop.length_groups import trimmed_width
from homelab_dp.train.model.loss import token_loss_sum
from homelab_dp.train.model.packed_attention import PackedSegments, block_segments, known_segments

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch


class SftObjective:
    """`train.objectives.objective.Objective` of SFT: one unit count (target tokens), one sum."""

    name = "sft"
    metrics = ("loss_sum",)

    def __init__(self) -> None:
        self._segments: list[tuple[int, ...]] | None = None
        """Packed data: each block's sample lengths (`block_segments`), made at the first step."""

    def units(self, data: Any) -> torch.Tensor:
        """Target tokens per block, as a ``[n_blocks, 1]`` float64 column."""
        import torch

        return data.targets.to(torch.float64)[:, None]

    def begin_step(self, model: Any, data: Any, rank: Any, micro_idx: list[Any]) -> None:
        """Nothing to agree on before the micro-steps."""

    def micro_step(
        self, model: Any, data: Any, idx: torch.Tensor, counts: Sequence[float], rank: Any,
        probe: Any = None, rows: Sequence[int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """`micro_step` of the blocks ``idx``, scaled by world / the step's target tokens.
        ``rows`` (``idx`` as Python ints) lets a packed micro-batch's samples come from the
        host (`block_segments`, made once) rather than from a read of the device a forward."""
        dev = rank.device
        # Packed blocks go without a mask: the positions restart at each sample and
        # transformers masks attention to within each one from them.
        # Unpacked rows of a recurrent model: cut to the longest sample (padding ends a row).
        width = trimmed_width(idx, data.real_tokens) if getattr(data, "grouped", False) else None
        mask = None if data.packed else to_device(data.mask[idx, :width], dev)
        scale = rank.world / max(float(counts[0]), 1.0)
        ids, labels, positions = (data.input_ids[idx, :width], data.labels[idx, :width],
                                  data.positions[idx, :width])  # fmt: skip
        split = getattr(rank, "split", None)
        segments = None
        if data.packed and split is None and rows is not None:
            if self._segments is None:
                self._segments = block_segments(data.positions)
            segments = PackedSegments(tuple(self._segments[i] for i in rows), dev)
        split_context: Any = contextlib.nullcontext()
        if split is not None:  # this rank's slice of every sequence; attention sees them whole
            split_context = split.active(positions, mask)
            ids, labels, positions, mask = (split.local(ids), split.local(labels),
                                            split.local(positions), None)  # fmt: skip
        with split_context:
            loss = micro_step(
                model.strategy, to_device(ids, dev), mask, labels, scale,
                positions=to_device(positions, dev), autocast=model.autocast,
                loss_dtype=model.loss_dtype, scaler=model.scaler, probe=probe,
                loss_head=model.loss_head, flat=model.flat_batches, segments=segments,
            )  # fmt: skip
        return loss.reshape(1)

    def fields(self, sums: Sequence[float], counts: Sequence[float]) -> dict[str, float | None]:
        """The mean token loss."""
        return {"loss": sums[0] / max(float(counts[0]), 1.0)}


def micro_step(
    strategy: Any, input_ids: Any, mask: Any, labels: Any, scale: float, *, autocast: Any,
    loss_dtype: Any, positions: Any = None, scaler: Any = None, probe: Any = None,
    loss_head: Any = None, flat: bool = False, segments: PackedSegments | None = None,
) -> Any:  # fmt: skip
    """Forward, loss and backward of one micro-batch; returns the detached sum of token losses.

    The loss is the sum of token cross-entropies times ``scale`` (world / global target tokens).
    With ``loss_head`` (`train.model.loss.ChunkedLossHead`) the model's forward returns that sum,
    computed chunk by chunk without full logits; ``labels`` may stay on the host (the head
    finds the target rows there without a device sync). Without it the logits are not kept
    past the loss: holding them would keep one more batch × seq_len × vocab tensor alive
    through the backward pass. ``mask`` is None for packed blocks, whose ``positions`` restart
    at every sample; ``flat`` sends a packed micro-batch as one row (FlashAttention's varlen
    route). ``probe`` (a `memtrack.MemoryProbe`, or None) marks the end of each phase.
    ``segments``: the packed rows' sample lengths, known on the host (`known_segments`).

    A MoE model with a router aux loss (``strategy.aux_coef`` > 0) returns its router logits
    and its aux loss (over this micro-batch's real tokens: the mask excludes padding; a packed
    block has no mask, so the padding at its end, at most one sample's worth, counts too). The
    effective batch's aux loss is the mean over its micro-batches (world × accumulation of
    them); as every strategy averages gradients over ranks, each rank adds ``aux_coef × aux /
    accumulation``: exact across world sizes and accumulation, as the token loss is.
    """

    if flat:  # exact: every row starts a sample at position 0
        input_ids, positions, labels = (t.reshape(1, -1) for t in (input_ids, positions, labels))
        if segments is not None:
            segments = PackedSegments((sum(segments.lengths, ()),), segments.device)
    targets = loss_head.targets(labels) if loss_head is not None else contextlib.nullcontext()
    known: Any = contextlib.nullcontext()
    if segments is not None and positions is not None:
        known = known_segments(positions, segments)
    aux_coef = getattr(strategy, "aux_coef", 0.0)
    router = {"output_router_logits": True} if aux_coef else {}
    with autocast(), targets, known:
        output = strategy.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False,
            **router,
        )  # fmt: skip
    out, aux = output.logits, output.aux_loss if aux_coef else None
    del output  # the router logits go with it
    if loss_head is None:
        labels = labels.to(out.device)
    token_loss = token_loss_sum(out, labels, loss_dtype, loss_head)
    del out
    if probe is not None:
        probe.mark("forward")
    scaled = token_loss * scale
    if aux is not None:
        scaled = scaled + aux_coef * aux.to(scaled.dtype) / strategy.grad_accum
        strategy.add_aux(aux)
    (scaler.scale(scaled) if scaler else scaled).backward()
    if probe is not None:
        probe.mark("backward")
    return token_loss.detach()
