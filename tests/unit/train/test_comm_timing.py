"""The communication timer (`train.parallelism.comm_timing`): its arithmetic, and on two real gloo processes
DDP's hooked all-reduce (the same gradients as DDP's built-in one, every bucket timed, nothing on
a ``no_sync`` micro-step) and FSDP2's timed gathers and reduce-scatters, read through the step
log's one all-gather (`train.loop.rank_stats.RankStats`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.loop.rank_stats import RankStats
from homelab_dp.train.model.trainable_model import load_model
from homelab_dp.train.parallelism.comm_timing import (
    ALL_GATHER,
    NO_COMM,
    REDUCE_SCATTER,
    CommSplit,
    CommTimer,
    blocking_split,
    comm_event_fields,
    overlapped_split,
    union_seconds,
)
from homelab_dp.train.parallelism.strategy import build_optimizer, wrap_model

ROOT = Path(__file__).resolve().parents[3]
DEMO_MODEL = ROOT / "assets" / "models" / "tiny-llama"


def test_union_counts_overlaps_once() -> None:
    assert union_seconds([]) == 0.0
    assert union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 3.5)]) == pytest.approx(2.5)
    assert union_seconds([(0.0, 4.0), (1.0, 2.0)]) == pytest.approx(4.0)  # nested


def test_ddp_split_exposes_only_what_follows_the_last_launch() -> None:
    # Three buckets: launched during backward at 0, 1, 2 s; the last one done at 2.5 s.
    split = overlapped_split([(0.0, 0.8), (1.0, 2.2), (2.0, 2.5)])
    assert split == CommSplit(pytest.approx(2.3), pytest.approx(0.5), 3)
    assert overlapped_split([]) == NO_COMM


def test_fsdp_split_cpu_all_exposed_cuda_first_gather_and_last_scatter() -> None:
    marks = [(0.0, 0.1, ALL_GATHER), (0.5, 0.6, ALL_GATHER), (1.0, 1.2, REDUCE_SCATTER),
             (1.5, 1.8, REDUCE_SCATTER)]  # fmt: skip
    cpu = blocking_split(marks, on_cuda=False)
    assert cpu.comm_seconds == pytest.approx(0.7) and cpu.exposed_seconds == pytest.approx(0.7)
    cuda = blocking_split(marks, on_cuda=True)
    assert cuda.comm_seconds == pytest.approx(0.7)
    assert cuda.exposed_seconds == pytest.approx(0.1 + 0.3)
    assert cuda.collectives == 4


def test_step_event_fields_are_means_over_ranks() -> None:
    rows = [[1.0, 7.0, 2.0, 0.0, 0.6, 0.2], [1.0, 7.0, 3.0, 0.0, 0.4, 1.0]]  # two sums first
    fields = comm_event_fields(rows, world=2)
    assert fields["comm_seconds"] == pytest.approx(0.5)
    assert fields["compute_seconds"] == pytest.approx(((2.0 - 0.2) + (3.0 - 1.0)) / 2)
    assert comm_event_fields(rows[:1], world=1) == {"comm_seconds": None, "compute_seconds": None}


def test_timer_reports_the_last_ended_step_only() -> None:
    timer = CommTimer("ddp", torch.device("cpu"))
    record = timer.launch("all_reduce")
    timer.complete(record)
    assert timer.read() == NO_COMM  # the step has not ended: nothing to report yet
    timer.end_step()
    first = timer.read()
    assert first.collectives == 1 and first.comm_seconds >= 0.0
    timer.end_step()  # a step without collectives
    assert timer.read() == NO_COMM
    assert CommTimer("none", torch.device("cpu")).read() == NO_COMM


def _setup(distribution: str) -> tuple[Any, Resolved]:
    preset = preset_from_dict({
        "model": {"path": str(DEMO_MODEL)},
        "data": {"path": "unused.jsonl", "seq_len": 16},
        "train": {"method": "full", "distribution": distribution, "micro_batch": 2,
                  "grad_accum": 2, "max_steps": 1},
    })  # fmt: skip
    resolved = Resolved(method="full", distribution=distribution,  # type: ignore[arg-type]
                        activation_checkpointing=False, device="cpu", world_size=2,
                        dtype="fp32", micro_batch=2, grad_accum=2, lr=1e-3)  # fmt: skip
    return preset, resolved


def _loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _two_ranks(rank: int, folder: str) -> None:
    """One rank: DDP hooked against DDP built-in, then FSDP2 full; figures to rank{r}.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/pg", rank=rank, world_size=2)
    cpu, out = torch.device("cpu"), {}
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own batch
    a, b = (torch.randint(0, 2048, (2, 16), generator=gen) for _ in range(2))

    preset, resolved = _setup("ddp")
    strategy = wrap_model(load_model(preset, resolved, cpu), resolved, cpu, grad_accum=2)
    plain = DistributedDataParallel(load_model(preset, resolved, cpu).model,
                                    gradient_as_bucket_view=True)  # fmt: skip
    optimizer = build_optimizer(strategy, preset.train, resolved.lr, cpu)
    with strategy.accumulate(final=False):
        _loss(strategy.model, a).backward()
    out["after_no_sync"] = len(strategy.comm._open)
    with strategy.accumulate(final=True):
        _loss(strategy.model, b).backward()
    with plain.no_sync():
        _loss(plain, a).backward()
    _loss(plain, b).backward()
    out["ddp_same_grads"] = all(
        torch.equal(p.grad, q.grad)
        for p, q in zip(strategy.model.parameters(), plain.parameters(), strict=True)
    )
    out["ddp_before_end"] = strategy.comm.read().collectives
    strategy.zero_grad(optimizer)
    split = strategy.comm.read()
    out["ddp"] = [split.comm_seconds, split.exposed_seconds, split.collectives]
    sums = torch.tensor([1.5, float(rank)])  # the objective's metric sums
    rows = RankStats(cpu).gather(sums, 2.0, split)
    out["rows"] = rows

    preset, resolved = _setup("fsdp-full")
    loaded = load_model(preset, resolved, cpu, sharded=True)
    fsdp = wrap_model(loaded, resolved, cpu, grad_accum=1)
    optimizer = build_optimizer(fsdp, preset.train, resolved.lr, cpu)
    with fsdp.accumulate(final=True):
        _loss(fsdp.model, a).backward()
    optimizer.step()
    kinds = [r[2] for r in fsdp.comm._open]
    fsdp.zero_grad(optimizer)
    split = fsdp.comm.read()
    out["fsdp"] = [split.comm_seconds, split.exposed_seconds, split.collectives]
    out["fsdp_kinds"] = kinds
    with fsdp.comm.outside_step(), torch.no_grad():  # an in-run validation between steps
        _loss(fsdp.model, a)
    out["between_steps"] = len(fsdp.comm._open)
    with fsdp.accumulate(final=True):  # the next step records its own collectives alone
        _loss(fsdp.model, b).backward()
    fsdp.zero_grad(optimizer)
    out["next_step"] = fsdp.comm.read().collectives
    out["layers"] = len(loaded.decoder_layers)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out), encoding="utf-8")
    dist.destroy_process_group()


def test_two_gloo_ranks_time_ddp_buckets_and_fsdp_collectives(tmp_path: Path) -> None:
    mp.start_processes(_two_ranks, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["after_no_sync"] == 0  # no_sync: no all-reduce, nothing timed
        assert got["ddp_same_grads"]  # the hook's all-reduce is DDP's own arithmetic
        assert got["ddp_before_end"] == 0  # the step's records close in zero_grad
        comm, exposed, buckets = got["ddp"]
        assert buckets >= 1 and 0.0 < comm < 5.0 and 0.0 <= exposed <= comm + 1e-9
        rows = got["rows"]  # every rank has every rank's row, comm columns included
        assert [row[:2] for row in rows] == [[1.5, 0.0], [1.5, 1.0]]
        assert rows[r][4] == pytest.approx(comm) and rows[r][5] == pytest.approx(exposed)
        assert rows[0][2] == rows[1][2] == 2.0 and rows[r][3] > 0  # step time; peak memory
        comm, exposed, count = got["fsdp"]
        layers = got["layers"]
        # fsdp-full: forward gathers every layer and the root, backward regathers the
        # resharded layers, and every unit reduce-scatters its gradients.
        assert got["fsdp_kinds"].count(ALL_GATHER) >= layers + 1
        assert got["fsdp_kinds"].count(REDUCE_SCATTER) == layers + 1
        assert count == len(got["fsdp_kinds"])
        # A validation's all-gathers between steps are no step's: the next step counts as many
        # collectives as the first did.
        assert got["between_steps"] == 0 and got["next_step"] == count
        assert 0.0 < comm < 5.0 and exposed == pytest.approx(comm)  # CPU: blocking calls
