"""`BatchShape`: the batch's arithmetic, owned once (effective batch, reaching an asked batch,
rescaling to other ranks or another micro-batch, the out-of-memory fallback)."""

from __future__ import annotations

import pytest

from homelab_dp.planning.batch_shape import (
    BatchShape,
    Fallback,
    after_out_of_memory,
    out_of_memory_words,
)


@pytest.mark.parametrize(
    ("micro", "world", "accum", "degree", "ranks", "effective"),
    [
        (2, 4, 3, 1, 4, 24),
        (2, 4, 3, 2, 2, 12),  # a sequence split over 2 ranks: 2 data ranks
        (3, 4, 1, 4, 1, 3),  # every rank on one sequence: one data rank
        (1, 1, 7, 1, 1, 7),
    ],
)
def test_effective_batch_counts_the_data_ranks(micro, world, accum, degree, ranks, effective):
    b = BatchShape.of(micro, world, accum, degree)
    assert (b.ranks, b.effective, b.per_rank) == (ranks, effective, micro * accum)


@pytest.mark.parametrize(
    ("effective", "micro", "ranks", "accum", "reached"),
    [(32, 4, 2, 4, 32), (32, 14, 1, 3, 42), (5, 2, 2, 2, 8), (3, 8, 1, 1, 8)],
)
def test_reaching_rounds_the_accumulation_up(effective, micro, ranks, accum, reached):
    b = BatchShape.reaching(effective, micro, ranks)
    assert (b.accum, b.effective) == (accum, reached)


def test_on_ranks_keeps_the_effective_batch_or_refuses():
    planned = BatchShape(micro=2, ranks=4, accum=3)  # 24
    assert planned.on_ranks(2) == BatchShape(2, 2, 6)
    assert planned.on_ranks(1) == BatchShape(2, 1, 12)
    assert planned.on_ranks(12) == BatchShape(2, 12, 1)
    assert planned.on_ranks(4) == planned
    for ranks in (5, 8, 24, 0):  # 2 × 5 and 2 × 8 do not divide 24; 2 × 24 exceeds it
        assert planned.on_ranks(ranks) is None


def test_with_micro_keeps_the_effective_batch_or_refuses():
    b = BatchShape(micro=6, ranks=2, accum=2)  # 12 per rank, 24 in all
    assert b.with_micro(4) == BatchShape(4, 2, 3)
    assert b.with_micro(1) == BatchShape(1, 2, 12)
    assert b.with_micro(5) is None and b.with_micro(0) is None


@pytest.mark.parametrize(
    ("micro", "accum", "ckpt", "expected"),
    [
        (4, 2, False, (2, 4, False)),  # halve the micro-batch, double the accumulation
        (6, 1, True, (3, 2, True)),  # the smallest factor: 6 = 2 × 3
        (9, 2, False, (3, 6, False)),  # 9 = 3 × 3
        (7, 1, False, (1, 7, False)),  # a prime: down to 1
        (1, 4, False, (1, 4, True)),  # micro-batch 1: activation checkpointing
        (1, 4, True, None),  # nothing left to change in this run
    ],
)
def test_out_of_memory_fallback(micro, accum, ckpt, expected):
    before = BatchShape(micro, 2, accum)
    got = after_out_of_memory(before, ckpt)
    if expected is None:
        assert got is None
        return
    assert (got.batch.micro, got.batch.accum, got.checkpointing) == expected
    assert got.batch.effective == before.effective == micro * 2 * accum
    assert got.batch.ranks == 2


def test_out_of_memory_words_and_the_event_proposal():
    message, hint, fallback = out_of_memory_words(BatchShape(4, 1, 2), 2, False, "boom")
    assert message == "out of memory with micro-batch 4 × accumulation 2 on 2 rank(s) (boom)"
    assert hint.startswith("set train.micro_batch = 2 and train.grad_accum = 4 (same effective "
                           "batch 8), or train.activation_checkpointing = true")  # fmt: skip
    assert fallback == Fallback(BatchShape(2, 1, 4), False)
    assert fallback.proposal() == {"micro_batch": 2, "grad_accum": 4,
                                   "activation_checkpointing": False, "effective_batch": 8}  # fmt: skip
    _, hint, fallback = out_of_memory_words(BatchShape(1, 1, 2), 1, True, "boom")
    assert fallback is None and "lora" in hint and "--auto-fit" not in hint


def test_a_factor_below_one_is_refused():
    for bad in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError, match="at least 1"):
            BatchShape(*bad)
