"""Unpacked rows of a recurrent model: a step's samples grouped by length, padding cut.

A model with Gated DeltaNet, Mamba-2 or short-convolution layers trains unpacked
(`homelab_dp.planning.recurrent_packing`): one sample per row, padded at its end to
``data.seq_len``. Two exact savings keep that padding small:

- `group_by_length`: the blocks of one optimizer step are sorted longest first before they are
  split into micro-batches (over ranks and accumulation), so each micro-batch holds samples of
  similar length. The step's loss is the sum over all its blocks divided by all their target
  tokens, whichever rank and micro-batch holds each, so the update is the same set of samples
  as without grouping, and it never depends on the world size.
- `trimmed_width`: a micro-batch is cut to its longest sample. The padding is at the end of each
  row and every layer is causal, so no real token ever read it: the cut changes nothing but the
  work.
"""

from __future__ import annotations

import torch


def group_by_length(blocks: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``blocks`` (a step's block indices) sorted by ``lengths[block]`` longest first, ties in
    their given order (a stable sort: every rank gets the same order)."""
    order = torch.sort(lengths[blocks], descending=True, stable=True).indices
    return blocks[order]


def trimmed_width(idx: torch.Tensor, lengths: torch.Tensor) -> int:
    """The columns a micro-batch of blocks ``idx`` needs: its longest sample (at least 1)."""
    return max(1, int(lengths[idx].max())) if idx.numel() else 1
