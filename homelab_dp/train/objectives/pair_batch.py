"""Preference blocks as tensors, and one micro-batch of them through the model.

`PairData` holds every `homelab_dp.data.preference_blocks.PairBlock` of a data set as
``[n_blocks, rows, row_len]`` tensors (every rank holds all of them, as SFT's blocks). A
micro-batch of blocks (`batch_of`) is flattened to ``[blocks · rows, row_len]`` and its
sequence ids are made unique across it: block b's sequence s becomes ``2·P_b + s`` where P_b
counts the pairs of the blocks before it, so the per-sequence log-probabilities
(`train.objectives.preference_losses.sequence_log_probs`) come out in (block, pair, chosen
then rejected) order: chosen ``[0::2]``, rejected ``[1::2]``. That order never depends on how
the blocks are split over ranks and micro-steps, which keeps the loss exact.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from homelab_dp.train.loop.device_copy import to_device
from homelab_dp.train.objectives.preference_losses import IGNORE_INDEX, sequence_log_probs


@dataclass
class PairData:
    """Preference blocks as host tensors (see the module docstring)."""

    input_ids: torch.Tensor
    """``[n_blocks, rows, row_len]``."""
    labels: torch.Tensor
    """Shifted targets, -100 outside the responses."""
    mask: torch.Tensor
    positions: torch.Tensor
    sequence: torch.Tensor
    """Sequence id per position within its block (2k chosen, 2k+1 rejected; -1 padding)."""
    n_pairs: torch.Tensor
    """Pairs (KTO: completions) per block, ``[n_blocks]``."""
    desirable: torch.Tensor
    """KTO: ``[n_blocks, max pairs]``, 1 desirable / 0 undesirable / -1 no pair; else empty."""
    packed: bool
    """Whole pairs packed into one row per block: no mask, positions restart per sequence."""
    ref_logps: torch.Tensor | None = None
    """Precomputed reference log-probabilities, ``[n_blocks, 2 · max pairs]`` float64 (NaN
    where a block has fewer pairs), or None (`train.objectives.reference`)."""

    @property
    def n_blocks(self) -> int:
        """Blocks in the data set."""
        return int(self.input_ids.shape[0])

    @property
    def max_pairs(self) -> int:
        """The most pairs any block holds."""
        return int(self.n_pairs.max()) if self.n_blocks else 0

    @property
    def targets(self) -> torch.Tensor:
        """Target tokens per block (both sequences of every pair)."""
        return (self.labels != IGNORE_INDEX).sum((1, 2))

    @property
    def real_tokens(self) -> torch.Tensor:
        """Non-padding tokens per block."""
        return self.mask.sum((1, 2))

    def chosen_targets(self) -> torch.Tensor:
        """Target tokens of the chosen (KTO: the trained) sequences per block."""
        even = (self.sequence >= 0) & (self.sequence % 2 == 0)
        return ((self.labels != IGNORE_INDEX) & even).sum((1, 2))


def pair_data(blocks: list[Any], packed: bool) -> PairData:
    """`PairData` from `PairBlock` objects (all of one shape)."""
    width = max((len(b.desirable) for b in blocks), default=0)
    desirable = [list(b.desirable) + [-1] * (width - len(b.desirable)) for b in blocks]
    return PairData(
        input_ids=torch.tensor([b.input_ids for b in blocks], dtype=torch.long),
        labels=torch.tensor([b.labels for b in blocks], dtype=torch.long),
        mask=torch.tensor([b.attention_mask for b in blocks], dtype=torch.long),
        positions=torch.tensor([b.position_ids for b in blocks], dtype=torch.long),
        sequence=torch.tensor([b.sequence for b in blocks], dtype=torch.long),
        n_pairs=torch.tensor([b.n_pairs for b in blocks], dtype=torch.long),
        desirable=torch.tensor(desirable, dtype=torch.long),
        packed=packed,
    )


@dataclass
class PairBatch:
    """One micro-batch of preference blocks, ready for the model."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    """On the host: `sequence_log_probs` moves it."""
    positions: torch.Tensor
    mask: torch.Tensor | None
    sequence: torch.Tensor
    """Ids unique across the micro-batch (see the module docstring)."""
    n_sequences: int
    desirable: torch.Tensor
    """KTO: per pair of the micro-batch, in order; empty otherwise."""
    idx: torch.Tensor
    """The blocks (indices into the `PairData`)."""


def batch_of(pairs: PairData, idx: torch.Tensor, device: Any, *, flat: bool = False) -> PairBatch:
    """The blocks ``idx`` of ``pairs`` as one micro-batch (``flat``: one row of all tokens,
    FlashAttention's varlen route for packed blocks)."""
    n = pairs.n_pairs[idx]
    before = torch.cumsum(n, 0) - n
    seq = pairs.sequence[idx]
    seq = torch.where(seq >= 0, seq + 2 * before[:, None, None], seq)
    width = pairs.input_ids.shape[-1]
    ids, labels, positions = (t.reshape(-1, width) for t in (pairs.input_ids[idx],
                                                           pairs.labels[idx],
                                                           pairs.positions[idx]))  # fmt: skip
    seq = seq.reshape(-1, width)
    mask = None if pairs.packed else to_device(pairs.mask[idx].reshape(-1, width), device)
    if flat and pairs.packed:  # exact: every row starts a sequence at position 0
        ids, labels, positions, seq = (t.reshape(1, -1) for t in (ids, labels, positions, seq))
    desirable = pairs.desirable[idx]
    desirable = desirable[desirable >= 0] if desirable.numel() else desirable.reshape(-1)
    return PairBatch(to_device(ids, device), labels, to_device(positions, device), mask, seq,
                     2 * int(n.sum()), desirable, idx)  # fmt: skip


def forward_logps(
    module: Any, batch: PairBatch, *, autocast: Any = contextlib.nullcontext, dtype: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence of ``batch``: the summed log-probability of its response tokens and their
    count, through ``module`` (the strategy's model, or a frozen copy) in ``dtype``."""
    with autocast():
        logits = module(input_ids=batch.input_ids, attention_mask=batch.mask,
                        position_ids=batch.positions, use_cache=False).logits  # fmt: skip
    logps, counts = sequence_log_probs(logits, batch.labels, batch.sequence, batch.n_sequences,
                                       dtype=dtype)  # fmt: skip
    return logps, counts
