"""The batch of one optimizer step: micro-batch × data-parallel ranks × gradient accumulation.

`BatchShape` owns the batch's arithmetic for every process that decides it, so that the
product is written out once:

- the **effective batch**, the samples of one optimizer step (only the data ranks take blocks
  of their own: a sequence split over ranks counts once, `BatchShape.of`);
- the accumulation that **reaches** an asked effective batch at a micro-batch (the planner's
  micro-batch finder, `BatchShape.reaching`), rounding up when the product does not divide it;
- the same effective batch **at another micro-batch** (`BatchShape.with_micro`) or **on another
  number of data ranks** (`BatchShape.on_ranks`, a worker started on a world size other than
  the plan's), both exact or nothing, since the learning rate, the schedule and a resume's data
  position were set for that batch;
- the **fallback after out-of-memory** (`after_out_of_memory`, which the keeper of a
  ``run --auto-fit`` asks after a rank reported the failed step): the micro-batch divided by
  its smallest factor and the accumulation multiplied by it; at micro-batch 1, activation
  checkpointing; beyond that, nothing the run can change.

Pure: the standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

AUTO_FIT_RETRY = "; `homelab-dp run PRESET --auto-fit` retries with it by itself"
"""What an out-of-memory hint adds when the fallback exists."""


def accumulation_for(effective: int, micro: int, ranks: int) -> int:
    """Accumulation steps that reach at least ``effective`` samples per optimizer step."""
    return max(1, math.ceil(effective / (micro * ranks)))


def smallest_factor(n: int) -> int:
    """The smallest factor of ``n`` above 1 (``n`` itself when it is prime); ``n`` >= 2."""
    return next(d for d in range(2, n + 1) if n % d == 0)


@dataclass(frozen=True)
class BatchShape:
    """One optimizer step's batch: ``micro`` samples per micro-step on each of ``ranks``
    data-parallel ranks, ``accum`` micro-steps per optimizer step."""

    micro: int
    ranks: int
    """Data-parallel ranks: the processes over the sequence-parallel degree."""
    accum: int

    def __post_init__(self) -> None:
        if min(self.micro, self.ranks, self.accum) < 1:
            raise ValueError(
                f"a batch of micro-batch {self.micro} × {self.ranks} rank(s) × accumulation "
                f"{self.accum}: every factor must be at least 1"
            )

    @classmethod
    def of(cls, micro: int, world: int, accum: int, sequence_parallel: int = 1) -> BatchShape:
        """The batch of ``world`` processes whose sequences are split over
        ``sequence_parallel`` of them (its ranks are the data ranks, at least 1)."""
        return cls(micro, max(1, world // max(1, sequence_parallel)), accum)

    @classmethod
    def reaching(cls, effective: int, micro: int, ranks: int) -> BatchShape:
        """The accumulation that reaches at least ``effective`` at this micro-batch and ranks."""
        return cls(micro, ranks, accumulation_for(effective, micro, ranks))

    @property
    def effective(self) -> int:
        """Samples per optimizer step: micro-batch × data ranks × accumulation."""
        return self.micro * self.ranks * self.accum

    @property
    def per_rank(self) -> int:
        """Samples one rank takes per optimizer step: micro-batch × accumulation."""
        return self.micro * self.accum

    def with_micro(self, micro: int) -> BatchShape | None:
        """The same effective batch at micro-batch ``micro``; None when it cannot be exact."""
        if micro < 1 or self.per_rank % micro:
            return None
        return BatchShape(micro, self.ranks, self.per_rank // micro)

    def on_ranks(self, ranks: int) -> BatchShape | None:
        """The same effective batch and micro-batch on ``ranks`` data ranks (the accumulation
        changes); None when micro-batch × ranks does not divide it."""
        if ranks < 1 or self.effective % (self.micro * ranks):
            return None
        return BatchShape(self.micro, ranks, self.effective // (self.micro * ranks))


@dataclass(frozen=True)
class Fallback:
    """What a run tries after out-of-memory: the batch and activation checkpointing."""

    batch: BatchShape
    checkpointing: bool

    def proposal(self) -> dict[str, Any]:
        """The out-of-memory event's ``proposal`` field (`runs.run_events.ErrorEvent`)."""
        return {"micro_batch": self.batch.micro, "grad_accum": self.batch.accum,
                "activation_checkpointing": self.checkpointing,
                "effective_batch": self.batch.effective}  # fmt: skip


def after_out_of_memory(batch: BatchShape, checkpointing: bool) -> Fallback | None:
    """The next batch to try after out-of-memory, keeping the effective batch (so the run and a
    resume from its checkpoint stay exact): the micro-batch divided by its smallest factor and
    the accumulation multiplied by it; at micro-batch 1, activation checkpointing; None when
    micro-batch 1 with checkpointing ran out of memory."""
    if batch.micro > 1:
        smaller = batch.with_micro(batch.micro // smallest_factor(batch.micro))
        assert smaller is not None  # a factor of the micro-batch divides micro × accumulation
        return Fallback(smaller, checkpointing)
    if not checkpointing:
        return Fallback(batch, True)
    return None


def out_of_memory_words(
    batch: BatchShape, world: int, checkpointing: bool, error: str
) -> tuple[str, str, Fallback | None]:
    """(message, hint, fallback) of a rank that ran out of memory at this batch on ``world``
    processes; ``error`` is the first line of what torch raised."""
    message = (f"out of memory with micro-batch {batch.micro} × accumulation {batch.accum} on "
               f"{world} rank(s) ({error})")  # fmt: skip
    fallback = after_out_of_memory(batch, checkpointing)
    if fallback is None:
        hint = ("micro-batch 1 with activation checkpointing does not fit: use lora or qlora, "
                "fsdp-full, a shorter data.seq_len, more devices, or the sequence split over "
                "them (train.sequence_parallel; see `homelab-dp plan`)")  # fmt: skip
        return message, hint, None
    if fallback.batch == batch:
        return message, "set train.activation_checkpointing = true" + AUTO_FIT_RETRY, fallback
    after = fallback.batch
    hint = (f"set train.micro_batch = {after.micro} and train.grad_accum = {after.accum} "
            f"(same effective batch {after.effective})")  # fmt: skip
    hint += "" if checkpointing else ", or train.activation_checkpointing = true"
    return message, hint + AUTO_FIT_RETRY, fallback
