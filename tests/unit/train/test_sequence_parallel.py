"""The split attention of `homelab_dp.train.parallelism.sequence_parallel` on two gloo ranks: the same
output and gradients as one attention over the whole sequence, per sample.

Two spawned processes (gloo, no model, no launcher) each hold half of a packed row of 24
tokens whose second sample straddles the split at token 12, with 4 query heads and 1
key/value head (repeated for the split). Both halves' outputs and the gradients of q, k, v
(through the backward all-to-all) equal the whole sequence's, computed by ``homelab_packed``
on one process, in fp64; the all-to-alls are timed into the split's timer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from homelab_dp.train.model.packed_attention import PackedSegments, packed_attention_forward
from homelab_dp.train.parallelism.comm_timing import CommSplit, CommTimer
from homelab_dp.train.parallelism.sequence_parallel import (
    CombinedTimer,
    SequenceSplit,
    kv_repeats,
    split_attention_forward,
)

SEQ, HEADS, KV, DIM = 24, 4, 1, 8
POSITIONS = torch.tensor([list(range(7)) + list(range(11)) + list(range(6))])  # 7 | 11 | 6


class _Attn(torch.nn.Module):
    is_causal = True


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, HEADS, SEQ, DIM, dtype=torch.float64, generator=gen)
    k = torch.randn(1, KV, SEQ, DIM, dtype=torch.float64, generator=gen)
    v = torch.randn(1, KV, SEQ, DIM, dtype=torch.float64, generator=gen)
    grad = torch.randn(1, SEQ, HEADS, DIM, dtype=torch.float64, generator=gen)
    return q, k, v, grad


def _whole() -> dict[str, Any]:
    """One process, the whole row: output and gradients."""
    q, k, v, grad = (t.clone() for t in _inputs())
    for t in (q, k, v):
        t.requires_grad_(True)
    segments = PackedSegments(((7, 11, 6),), torch.device("cpu"))
    out, _ = packed_attention_forward(_Attn(), q, k, v, segments, scaling=DIM**-0.5)
    out.backward(grad)
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def _rank(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/pg", rank=rank, world_size=2)
    split = SequenceSplit.create(2, torch.device("cpu"))
    q, k, v, grad = _inputs()
    half = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
    mine = [t[:, :, half].clone().requires_grad_(True) for t in (q, k, v)]
    with split.active(POSITIONS, None):
        out, _ = split_attention_forward(_Attn(), *mine, None, scaling=DIM**-0.5)
        out.backward(grad[:, half])
    split.timer.end_step()
    timed = split.timer.read()
    whole = _whole()
    diffs = {
        "out": float((out.detach() - whole["out"][:, half]).abs().max()),
        **{
            n: float((t.grad - whole[n][:, :, half]).abs().max())
            for n, t in zip("qkv", mine, strict=True)
        },
    }
    doc = {"diffs": diffs, "index": split.index, "data_rank": split.data_rank,
           "exchanges": timed.collectives, "seconds": timed.comm_seconds,
           "exposed": timed.exposed_seconds, "segments": split.segments(POSITIONS, None).lengths}  # fmt: skip
    Path(folder, f"rank{rank}.json").write_text(json.dumps(doc), encoding="utf-8")
    dist.destroy_process_group()


def test_split_attention_equals_the_whole_sequence(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    docs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, doc in enumerate(docs):
        assert doc["index"] == r and doc["data_rank"] == 0
        assert doc["segments"] == [[7, 11, 6]]  # the sample across token 12 stays one
        assert max(doc["diffs"].values()) < 1e-12, doc["diffs"]
        # q, k, v and the output forward, their gradients backward: 8 exchanges, all exposed
        assert doc["exchanges"] == 8
        assert doc["seconds"] > 0 and doc["exposed"] == doc["seconds"]


def test_kv_heads_are_repeated_just_enough() -> None:
    assert kv_repeats(8, 2) == 1 and kv_repeats(8, 8) == 1
    assert kv_repeats(1, 2) == 2 and kv_repeats(2, 4) == 2 and kv_repeats(6, 4) == 2
    assert kv_repeats(8, 16) == 2 and kv_repeats(3, 4) == 4


def test_padding_is_a_segment_of_its_own() -> None:
    split = SequenceSplit(2, 0, 0, 1)
    positions = torch.arange(8)[None, :]
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    assert split.segments(positions, mask).lengths == ((5, 3),)
    assert split.segments(positions, None).lengths == ((8,),)
    assert split.local(torch.arange(8)[None, :]).tolist() == [[0, 1, 2, 3]]


def test_combined_timer_adds_the_all_to_alls_to_the_step() -> None:
    grads, exchange = (
        CommTimer("ddp", torch.device("cpu")),
        CommTimer("blocking", torch.device("cpu")),
    )
    timer = CombinedTimer(grads, exchange)
    grads.complete(grads.launch("all_reduce"))
    for _ in range(3):
        exchange.complete(exchange.launch("all_to_all"))
    with timer.outside_step():  # between steps: not the step's
        exchange.complete(exchange.launch("all_to_all"))
    timer.end_step()
    a, b = grads.read(), exchange.read()
    got = timer.read()
    assert isinstance(got, CommSplit) and got.collectives == 4 == a.collectives + b.collectives
    assert got.comm_seconds == a.comm_seconds + b.comm_seconds
    assert b.exposed_seconds == b.comm_seconds  # blocking: every second exposed
