"""Sequence parallelism (``train.sequence_parallel = N``): every sequence split over N ranks.

Ulysses-style (the idea of DeepSpeed-Ulysses and of ALST; this is our own code): the world is
``data ranks × N``; ranks ``d·N … d·N + N - 1`` form sequence group ``d`` and take the same
blocks (data rank ``d``), each holding ``seq_len / N`` consecutive tokens of every block: its
slice of the input ids, the (already shifted) labels and the positions. Everything outside
attention is per token, so it runs on the slice unchanged (embeddings, RoPE from the slice's
own positions, norms, the MLP, the chunked loss over the slice's targets). Attention needs
the whole sequence; before it one all-to-all within the sequence group turns each of q, k, v
from ``(batch, heads, seq/N, head_dim)`` into ``(batch, heads/N, seq, head_dim)`` (this rank's
group of heads over the whole sequence), attention runs per sample over the full sequence
(`train.model.packed_attention`'s per-sample kernels, the samples found from the whole block's
positions, so a packed sample that straddles the split stays one sample), and a second
all-to-all turns the output back to ``(batch, seq/N, heads, head_dim)``. Where a model has
fewer key/value heads than N (or a count N does not divide), each key/value head is repeated
just enough times (`kv_repeats`) that N divides them, keeping the grouped-query mapping.

The exchange is ``all_to_all_single`` on NCCL and on gloo alike (gloo implements it on the
CPU: checked with torch 2.13); its backward is the same exchange of the gradients.

Gradients: each rank's loss is its slice's token-loss sum times world / (the step's target
tokens over every data rank); the strategies average gradients over the whole world, so the
average is the data-parallel mean of the full-sequence gradients, exactly as without the
split (the all-reduce over the whole world is the sum over the sequence group followed by the
mean over the data group). DDP, ZeRO-1 and FSDP2 all reduce over the whole world this way.

Only inside `SequenceSplit.active` (the micro-step's forward and backward, activation
checkpointing's recompute included) is attention split; a forward outside it (the packing
check, in-run validation, sample answers) runs on whole sequences as ``homelab_packed``.

The all-to-all seconds join the step's ``comm_seconds`` (`CombinedTimer`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from homelab_dp.planning.sequence_split import kv_repeats
from homelab_dp.train.model.packed_attention import (
    PackedSegments,
    packed_attention_forward,
    packed_mask,
    segments_from_starts,
)
from homelab_dp.train.parallelism.comm_timing import NO_COMM, CommSplit, CommTimer

SPLIT_ATTENTION = "homelab_seq_split"
"""The ``attn_implementation`` name of the split attention (`install`)."""
ALL_TO_ALL = "all_to_all"

_active: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
    "homelab_seq_split", default=None
)
_registered = False


@dataclass(frozen=True)
class _Active:
    split: SequenceSplit
    segments: PackedSegments
    """The samples of the whole (unsplit) micro-batch."""


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` of a tensor whose first dimension is the N chunks (chunk j goes to
    rank j of the group, chunk i of the output came from rank i); its backward is the same
    exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:  # type: ignore[override]
        ctx.split = split
        return split.exchange(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return ctx.split.exchange(grad.contiguous()), None


@dataclass
class SequenceSplit:
    """This rank's place in the split: its sequence group, its index in it, its data rank."""

    degree: int
    """N: ranks per sequence."""
    index: int
    """This rank's slice of every sequence (0 … N - 1)."""
    data_rank: int
    data_world: int
    group: Any = None
    """The sequence group (None: the default group, when N is the world)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timer: CommTimer = field(default_factory=lambda: CommTimer("blocking", torch.device("cpu")))
    """The all-to-alls of each step (their seconds join ``comm_seconds``)."""

    @classmethod
    def create(cls, degree: int, device: torch.device) -> SequenceSplit:
        """The split of this process (a collective: every rank creates every sequence group)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        group = None
        if degree < world:
            for d in range(world // degree):
                ranks = list(range(d * degree, (d + 1) * degree))
                made = dist.new_group(ranks)
                if rank in ranks:
                    group = made
        return cls(degree, rank % degree, rank // degree, world // degree, group, device,
                   CommTimer("blocking", device))  # fmt: skip

    # ------------------------------------------------------------------ the tokens
    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the last (sequence) dimension."""
        n = t.shape[-1] // self.degree
        return t[..., self.index * n : (self.index + 1) * n]

    def segments(self, positions: torch.Tensor, mask: torch.Tensor | None) -> PackedSegments:
        """The samples of the whole micro-batch: a sample starts where the positions do not
        continue (a packed block's restarts) and, in a right-padded row, the padding is a
        segment of its own (as `packed_mask` makes them). One host read a micro-step."""
        pos = positions.cpu()
        starts = (pos[:, 1:] - pos[:, :-1]) != 1
        if mask is not None:
            n = mask.cpu().sum(-1, keepdim=True)
            starts = starts | (torch.arange(1, pos.shape[1])[None, :] == n)
        rows = [[True, *row] for row in starts.tolist()]
        return PackedSegments(segments_from_starts(rows), self.device)

    @contextlib.contextmanager
    def active(self, positions: torch.Tensor, mask: torch.Tensor | None) -> Iterator[None]:
        """Split attention over the whole micro-batch of ``positions`` (and right-padding
        ``mask``) while inside: the forward and the backward of one micro-step."""
        token = _active.set(_Active(self, self.segments(positions, mask)))
        try:
            yield
        finally:
            _active.reset(token)

    # ------------------------------------------------------------------ the exchange
    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """One timed ``all_to_all_single`` within the sequence group."""
        out = torch.empty_like(x)
        record = self.timer.launch(ALL_TO_ALL)
        dist.all_to_all_single(out, x, group=self.group)
        self.timer.complete(record)
        return out

    def heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, heads, seq/N, d)`` → ``(batch, heads/N, seq, d)``: this rank's heads over
        the whole sequence."""
        b, h, s, d = x.shape
        n = self.degree
        chunks = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()
        got = _Exchange.apply(chunks, self)  # [i]: slice i of the sequence, my heads
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)

    def sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, heads/N, d)`` → ``(batch, seq/N, heads, d)``: every head of this
        rank's slice of the sequence."""
        b, s, h, d = x.shape
        n = self.degree
        chunks = x.reshape(b, n, s // n, h, d).transpose(0, 1).contiguous()
        got = _Exchange.apply(chunks, self)  # [j]: head group j, my slice
        return got.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def split_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
    sliding_window: int | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """The attention function of ``homelab_seq_split`` (transformers' signature: q
    ``(batch, heads, seq, head_dim)``; returns ``((batch, seq, heads, head_dim), None)``).
    Inside `SequenceSplit.active`: the exchange, per-sample attention over the whole sequence
    for this rank's heads, the exchange back. Outside: ``homelab_packed`` on what it was given."""
    state = _active.get()
    if state is None:
        return packed_attention_forward(module, query, key, value, attention_mask, dropout,
                                        scaling, sliding_window, **kwargs)  # fmt: skip
    split = state.split
    rep = kv_repeats(key.shape[1], split.degree)
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    heads = query.shape[1] // split.degree
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # one sink logit per head: this rank's heads'
        kwargs["s_aux"] = sinks[split.index * heads : (split.index + 1) * heads]
    q, k, v = (split.heads_to_sequence(t) for t in (query, key, value))
    out, _ = packed_attention_forward(module, q, k, v, state.segments, dropout, scaling,
                                      sliding_window, **kwargs)  # fmt: skip
    return split.sequence_to_heads(out), None


def split_mask(*args: Any, **kwargs: Any) -> Any:
    """The mask step of ``homelab_seq_split``: none inside a split micro-step (the attention
    has the whole micro-batch's samples), ``homelab_packed``'s outside."""
    if _active.get() is not None:
        return None
    return packed_mask(*args, **kwargs)


def register() -> str:
    """Register ``homelab_seq_split`` with transformers (once per process); its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(SPLIT_ATTENTION, split_attention_forward)
        AttentionMaskInterface.register(SPLIT_ATTENTION, split_mask)
        _registered = True
    return SPLIT_ATTENTION


def install(model: torch.nn.Module) -> None:
    """Make ``model`` (a transformers model, or a peft model around one) attend through
    ``homelab_seq_split``: split inside `SequenceSplit.active`, ``homelab_packed`` elsewhere."""
    register()
    base = model
    while not hasattr(base, "set_attn_implementation") and hasattr(base, "get_base_model"):
        base = base.get_base_model()
    base.set_attn_implementation(SPLIT_ATTENTION)


class CombinedTimer:
    """The strategy's gradient-communication timer and the split's all-to-all timer as one
    (`train.parallelism.strategy.Strategy.comm`): the step's ``comm_seconds`` and exposed seconds are their
    sums (the all-to-alls block the rank: all of their time is exposed)."""

    def __init__(self, grads: CommTimer, exchange: CommTimer) -> None:
        self.grads, self.exchange = grads, exchange
        self.kind = grads.kind

    @contextlib.contextmanager
    def outside_step(self) -> Iterator[None]:
        with self.grads.outside_step(), self.exchange.outside_step():
            yield

    def end_step(self) -> None:
        self.grads.end_step()
        self.exchange.end_step()

    def read(self) -> CommSplit:
        a, b = self.grads.read(), self.exchange.read()
        if a is NO_COMM and b is NO_COMM:
            return NO_COMM
        return CommSplit(a.comm_seconds + b.comm_seconds, a.exposed_seconds + b.exposed_seconds,
                         a.collectives + b.collectives)  # fmt: skip
