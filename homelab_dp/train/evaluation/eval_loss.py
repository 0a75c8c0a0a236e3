"""Data-parallel evaluation: the mean negative log-likelihood per target token over a data set.

Each rank takes every world-th block (rank r: blocks r, r + W, r + 2W, …), sums its token
losses in fp64 and counts its target tokens; one all-reduce of the two sums gives every rank
the same loss. The loss is a sum of per-block sums divided by a count, so it does not depend on
how the blocks were spread: 1 and N processes agree to float rounding of the forward itself.

Every rank runs the same number of forward passes (a rank short of blocks runs one with no
target tokens), because FSDP2 gathers parameters in each forward as a collective. The model is
put in eval mode (no dropout, LoRA dropout included) and back in the mode it was in.

Also the in-run preference eval (`evaluate_pairs`): an objective's loss and figures over the
preference eval data, on the same split of blocks over the ranks.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from homelab_dp.data.blocks import IGNORE_INDEX
from homelab_dp.train.loop.device_copy import to_device
from homelab_dp.train.model.loss import token_loss_sum


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
    split: Any = None,
) -> EvalResult:
    """The loss over ``blocks`` on ``world`` ranks (call it on every rank; all get the result).

    ``model`` is what the forward runs (a strategy's wrapped model, or the bare model);
    ``loss_head`` is the `train.model.loss.ChunkedLossHead` installed in it, or None for full
    cross-entropy; ``flat`` sends a packed micro-batch as one row (FlashAttention varlen).
    ``split`` (`train.parallelism.sequence_parallel.SequenceSplit`): each sequence group takes its data
    rank's blocks and each rank its slice of every sequence, as in training.
    """

    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = real = 0
    mine = (rank, world) if split is None else (split.data_rank, split.data_world)
    try:
        for idx in rank_batches(blocks.n_blocks, *mine, micro):
            if idx:
                labels = blocks.labels[idx]
            else:  # this rank has no block left: the first block, every label ignored
                idx = [0]
                labels = torch.full_like(blocks.labels[idx], IGNORE_INDEX)
            ids, pos, real_mask = blocks.input_ids[idx], blocks.positions[idx], blocks.mask[idx]
            mask = None if blocks.packed else to_device(real_mask, device)
            scope: Any = contextlib.nullcontext()
            if split is not None:  # this rank's slice; attention sees the whole sequences
                scope = split.active(pos, None if blocks.packed else real_mask)
                ids, pos, labels, real_mask = (
                    split.local(t) for t in (ids, pos, labels, real_mask)
                )
                mask = None
            input_ids, positions = to_device(ids, device), to_device(pos, device)
            if flat:
                input_ids, positions, labels = (
                    t.reshape(1, -1) for t in (input_ids, positions, labels)
                )
            n_targets = int((labels != IGNORE_INDEX).sum())
            targets = (
                loss_head.targets(labels) if loss_head is not None else contextlib.nullcontext()
            )
            with autocast(), targets, scope:
                out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                            use_cache=False).logits  # fmt: skip
            if loss_head is None:
                labels = labels.to(out.device)
            if n_targets:
                loss_sum += token_loss_sum(out, labels, loss_dtype, loss_head).double()
                tokens += n_targets
                real += int(real_mask.sum())
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


@dataclass(frozen=True)
class PairEvalResult:
    """An objective's figures over the whole preference eval data (all ranks)."""

    loss: float
    """The objective's mean loss (DPO: per pair; ORPO: NLL per chosen token + mean term)."""
    pairs: int
    """Pairs (KTO: completions) evaluated."""
    tokens: int
    """Target tokens of every sequence evaluated."""
    seconds: float
    fields: dict[str, float | None]
    """The objective's event fields besides the loss (rewards, margin, accuracy, nll, ...)."""

    @property
    def perplexity(self) -> float:
        """No perplexity for a preference loss."""
        return float("nan")


def evaluate_pairs(model: Any, pairs: Any, objective: Any, rank: Any) -> PairEvalResult:
    """``objective``'s mean loss and figures over the `PairData` ``pairs`` on every rank (a
    collective): each rank its blocks r, r + W, ... in micro-batches of ``rank.micro``, the
    metric sums and unit counts all-reduced, so every rank has the same result on any world
    size. Eval mode (no dropout), no grad; the model's mode restored after."""
    t0 = time.perf_counter()
    module = model.strategy.model
    was_training = module.training
    module.eval()
    sums: torch.Tensor | None = None
    units = torch.zeros(objective.eval_units(pairs).shape[1] + 1, dtype=torch.float64)
    try:
        with torch.no_grad():
            for idx in rank_batches(pairs.n_blocks, rank.rank, rank.world, rank.micro):
                # A rank short of blocks runs a forward too (FSDP2 gathers as a collective).
                part = objective.eval_sums(model, pairs, torch.tensor(idx or [0]), rank.device)
                if not idx:
                    continue
                sums = part if sums is None else sums + part
                units[:-1] += objective.eval_units(pairs)[idx].sum(0)
                units[-1] += float(pairs.targets[idx].sum())
    finally:
        module.train(was_training)
    if sums is None:
        sums = torch.zeros(len(objective.metrics), dtype=torch.float64, device=rank.device)
    both = torch.cat([sums.to(torch.float64), units.to(sums.device)])
    if rank.world > 1:
        import torch.distributed as dist

        dist.all_reduce(both)
    values = both.tolist()
    n = len(objective.metrics)
    counts = values[n:-1]
    fields = objective.fields(values[:n], counts)
    loss = float(fields.pop("loss") or float("nan"))
    return PairEvalResult(loss=loss, pairs=int(counts[0]), tokens=int(values[-1]),
                          seconds=time.perf_counter() - t0, fields=fields)  # fmt: skip
