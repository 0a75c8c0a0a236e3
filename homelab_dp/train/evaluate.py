"""Data-parallel evaluation: the mean negative log-likelihood per target token over a data set.

Each rank takes every world-th block (rank r: blocks r, r + W, r + 2W, …), sums its token
losses in fp64 and counts its target tokens; one all-reduce of the two sums gives every rank
the same loss. The loss is a sum of per-block sums divided by a count, so it does not depend on
how the blocks were spread: 1 and N processes agree to float rounding of the forward itself.

Every rank runs the same number of forward passes (a rank short of blocks runs one with no
target tokens), because FSDP2 gathers parameters in each forward as a collective. The model is
put in eval mode (no dropout, LoRA dropout included) and back in the mode it was in.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class EvalBlocks:
    """Blocks to evaluate, as tensors on the host (every rank holds all of them)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    """IGNORE_INDEX (-100) where a token is not a target."""
    mask: torch.Tensor
    positions: torch.Tensor
    packed: bool
    """Several samples per block: no mask is passed, the positions restart at each sample."""

    @property
    def n_blocks(self) -> int:
        return int(self.input_ids.shape[0])


def eval_blocks(blocks: list[Any], packed: bool) -> EvalBlocks:
    """`EvalBlocks` from `data.blocks.Block` objects."""
    return EvalBlocks(
        input_ids=torch.tensor([b.input_ids for b in blocks], dtype=torch.long),
        labels=torch.tensor([b.labels for b in blocks], dtype=torch.long),
        mask=torch.tensor([b.attention_mask for b in blocks], dtype=torch.long),
        positions=torch.tensor([b.position_ids for b in blocks], dtype=torch.long),
        packed=packed,
    )


@dataclass(frozen=True)
class EvalResult:
    """The summed loss and target-token count over the whole data set (all ranks)."""

    loss_sum: float
    tokens: int
    """Target tokens (labels that are not ignored)."""
    real_tokens: int
    """Non-padding tokens that went through the model (throughput)."""
    seconds: float

    @property
    def loss(self) -> float:
        """Mean negative log-likelihood per target token (nats)."""
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        """exp(loss); inf where the loss overflows it."""
        loss = self.loss
        return math.exp(loss) if loss < 700 else float("inf")

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.seconds if self.seconds > 0 else 0.0


def rank_batches(n_blocks: int, rank: int, world: int, micro: int) -> list[list[int]]:
    """This rank's micro-batches of block indices; every rank gets the same number of batches
    (the last ones may be empty lists: a forward with no targets keeps the collectives paired)."""
    mine = list(range(rank, n_blocks, world))
    per_rank = math.ceil(math.ceil(n_blocks / world) / micro) if n_blocks else 0
    return [mine[i * micro : (i + 1) * micro] for i in range(per_rank)]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    blocks: EvalBlocks,
    *,
    rank: int,
    world: int,
    micro: int,
    device: torch.device,
    autocast: Any = contextlib.nullcontext,
    loss_dtype: torch.dtype = torch.float32,
    loss_head: Any = None,
    flat: bool = False,
) -> EvalResult:
    """The loss over ``blocks`` on ``world`` ranks (call it on every rank; all get the result).

    ``model`` is what the forward runs (a strategy's wrapped model, or the bare model);
    ``loss_head`` is the `train.loss.ChunkedLossHead` installed in it, or None for full
    cross-entropy; ``flat`` sends a packed micro-batch as one row (FlashAttention varlen).
    """
    from homelab_dp.data.blocks import IGNORE_INDEX
    from homelab_dp.train.batches import to_device
    from homelab_dp.train.loss import token_loss_sum

    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = real = 0
    try:
        for idx in rank_batches(blocks.n_blocks, rank, world, micro):
            if idx:
                labels = blocks.labels[idx]
            else:  # this rank has no block left: the first block, every label ignored
                idx = [0]
                labels = torch.full_like(blocks.labels[idx], IGNORE_INDEX)
            input_ids = to_device(blocks.input_ids[idx], device)
            positions = to_device(blocks.positions[idx], device)
            mask = None if blocks.packed else to_device(blocks.mask[idx], device)
            if flat:
                input_ids, positions, labels = (t.reshape(1, -1)
                                                for t in (input_ids, positions, labels))  # fmt: skip
            n_targets = int((labels != IGNORE_INDEX).sum())
            targets = (
                loss_head.targets(labels) if loss_head is not None else contextlib.nullcontext()
            )
            with autocast(), targets:
                out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                            use_cache=False).logits  # fmt: skip
            if loss_head is None:
                labels = labels.to(out.device)
            if n_targets:
                loss_sum += token_loss_sum(out, labels, loss_dtype, loss_head).double()
                tokens += n_targets
                real += int(blocks.mask[idx].sum())
            del out
    finally:
        model.train(was_training)
    totals = torch.tensor([float(tokens), float(real)], dtype=torch.float64, device=device)
    if world > 1:
        import torch.distributed as dist

        both = torch.cat([loss_sum.reshape(1), totals])
        dist.all_reduce(both)
        loss_sum, totals = both[0], both[1:]
    return EvalResult(
        loss_sum=float(loss_sum),
        tokens=int(totals[0]),
        real_tokens=int(totals[1]),
        seconds=time.perf_counter() - t0,
    )
