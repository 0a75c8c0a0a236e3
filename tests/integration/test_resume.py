"""Checkpoints and exact resume.

11 ragged blocks (12 records, one without a target within seq_len), effective batch 4,
2 epochs → 6 steps. A run stopped after k steps (``HOMELAB_DP_STOP_AT_STEP``, the test hook that
acts like SIGTERM at a step boundary) and resumed ends with weights bit for bit equal to an
uninterrupted run: mid-epoch (k = 2; the resumed part crosses into the second epoch) and right
after the step that crossed the epoch boundary (k = 3: samples 8-11 are 3 of epoch 1 and 1 of
epoch 2; this one with train.deterministic on, which changes no bit on the CPU). A 2-rank
checkpoint resumes on 1 process (accumulation 2 keeps the effective batch); that run matches to
fp32 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_dp.train.loop.checkpoints import check_checkpoint
from tests.integration.conftest import (
    bitwise_equal,
    copy_run,
    events,
    final_weights,
    make_run,
    max_abs_diff,
    run,
    run_together,
)

pytestmark = pytest.mark.slow
TRAIN = {"max_steps": 0, "epochs": 2.0, "warmup_steps": 1, "checkpoint_every": 2}
FP32_TOL = 1e-5  # 1 vs 2 processes: summation order only


def _stopped(rd: Path, k: int) -> None:
    end = events(rd, "end")[-1]
    assert end["reason"] == "stopped" and end["steps"] == k and end["final_path"] is None
    assert check_checkpoint(rd / "checkpoints" / f"step-{k}") is None
    assert not (rd / "final").exists()


def _resumed_from(rd: Path, k: int) -> dict:
    start = events(rd, "start")[-1]
    assert start["start_step"] == k and start["resumed_from"].endswith(f"step-{k}")
    assert events(rd, "end")[-1]["reason"] == "completed"
    return start


def _setup(root: Path, model: Path, data: Path, distribution: str, name: str) -> Path:
    return make_run(root, model, data, name=name, distribution=distribution, train=TRAIN)


@pytest.fixture(scope="module")
def ddp_full(tiny_model: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank DDP run (zero1 must match it bit for bit too)."""
    full = _setup(
        tmp_path_factory.mktemp("ddp"), tiny_model, data_dir / "ragged-12.jsonl", "ddp", "full"
    )
    assert run(full, 2) == 0
    return full


def test_ddp_resume_is_bitwise_mid_epoch_and_at_epoch_boundary(
    ddp_full: Path, tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    data = data_dir / "ragged-12.jsonl"
    full = ddp_full
    reference = final_weights(full)
    assert events(full, "start")[0]["total_steps"] == 6
    # keep_checkpoints = 2: the periodic step-2 was rotated away.
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["step-4", "step-6"]

    n = events(full, "start")[0]["samples"]
    assert n == 11
    stops = {2: (0, 8), 3: (1, 12 - n)}  # step: (epoch, offset) of its checkpoint
    # The k = 3 run also turns train.deterministic on: torch's deterministic-only mode in every
    # rank (no op of a CPU run lacks a deterministic kernel) gives the same bits on the CPU,
    # exact already, as the uninterrupted run without the switch.
    dirs = {k: make_run(tmp_path, tiny_model, data, name=f"stop{k}", distribution="ddp",
                        train={**TRAIN, "deterministic": k == 3})
            for k in stops}  # fmt: skip
    assert run_together(*((rd, 2, {"stop_at": k}) for k, rd in dirs.items())) == [0, 0]
    for k, rd in dirs.items():
        _stopped(rd, k)
        trainer = json.loads((rd / "checkpoints" / f"step-{k}" / "trainer.json").read_text())
        assert (trainer["step"], trainer["epoch"], trainer["offset"]) == (k, *stops[k])
        if k == 2:
            on_one = copy_run(rd, tmp_path, "stop2-on-1-rank")
        # An incomplete newer checkpoint (no marker) must be skipped.
        (rd / "checkpoints" / "step-5").mkdir()
        (rd / "checkpoints" / "step-5" / "shard-00001-model-00001-of-00001.safetensors").write_text(
            ""
        )
    resumed = [(rd, 2, {"resume": True}) for rd in dirs.values()]
    assert run_together(*resumed, (on_one, 1, {"resume": True})) == [0, 0, 0]
    for k, rd in dirs.items():
        _resumed_from(rd, k)
        assert bitwise_equal(final_weights(rd), reference)
        log = (rd / "logs" / "launcher.log").read_text(encoding="utf-8")
        on = log.count("deterministic algorithms on (train.deterministic)")
        assert on == (4 if k == 3 else 0)  # 2 ranks × (the stopped run + the resumed run)

    start = _resumed_from(on_one, 2)
    assert (start["world_size"], start["grad_accum"], start["effective_batch"]) == (1, 2, 4)
    assert max_abs_diff(final_weights(on_one), reference) < FP32_TOL


def test_fsdp_resume_bitwise_and_on_one_process(
    tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    data = data_dir / "ragged-12.jsonl"
    full = _setup(tmp_path, tiny_model, data, "fsdp-full", "full")
    rd = _setup(tmp_path, tiny_model, data, "fsdp-full", "stop")
    assert run_together((full, 2, {}), (rd, 2, {"stop_at": 2})) == [0, 0]
    reference = final_weights(full)
    _stopped(rd, 2)
    on_one = copy_run(rd, tmp_path, "stop-on-1-rank")
    assert run_together((rd, 2, {"resume": True}), (on_one, 1, {"resume": True})) == [0, 0]
    _resumed_from(rd, 2)
    assert bitwise_equal(final_weights(rd), reference)
    _resumed_from(on_one, 2)
    assert max_abs_diff(final_weights(on_one), reference) < FP32_TOL


def test_zero1_resume_is_bitwise(
    ddp_full: Path, tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    """ZeRO-1 updates each shard with the same arithmetic as DDP: stopped, resumed, and still
    bit for bit the uninterrupted DDP run (its optimizer state is saved per parameter)."""
    data = data_dir / "ragged-12.jsonl"
    rd = _setup(tmp_path, tiny_model, data, "zero1", "stop")
    assert run(rd, 2, stop_at=3) == 0
    _stopped(rd, 3)
    assert run(rd, 2, resume=True) == 0
    _resumed_from(rd, 3)
    assert bitwise_equal(final_weights(rd), final_weights(ddp_full))
