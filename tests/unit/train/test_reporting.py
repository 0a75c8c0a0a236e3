"""Rank 0's loggers (`homelab_dp.train.loop.reporting`), in process: the TensorBoard event files read
back with TensorBoard's own reader hold the figures of the events written, a resumed run
continues the same curves, ``report_to = []`` writes no folder, a failing logger becomes one
warning and training goes on, and a logger that is not installed is refused by ``run`` before
anything starts. The same files of a real two-process run are checked in
tests/integration/test_validation.py::test_keep_best_and_early_stopping.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from homelab_dp.cli.main import main
from homelab_dp.presets.preset import LogSection, Preset
from homelab_dp.runs.run_events import EndEvent, EvalEvent, SampleEvent, StepEvent, WarningEvent
from homelab_dp.runs.run_spec import Launch, Resolved, RunSpec
from homelab_dp.train.loop.event_log import EventLog
from homelab_dp.train.loop.reporting import (
    DeviceSamples,
    Reporting,
    TensorBoardBackend,
    device_scalars,
    open_reporting,
    step_scalars,
)

LOSSES = [2.5, 2.25, 2.0, 1.875]


def spec(report_to: list[str]) -> RunSpec:
    preset = Preset(log=LogSection(report_to=report_to))  # type: ignore[arg-type]
    resolved = Resolved("full", "ddp", False, "cpu", 2, "fp32", 1, 1, 1e-3)
    return RunSpec("20261201-120000-demo-abcd", preset, resolved, Launch(nproc_per_node=2))


def step(n: int, loss: float) -> StepEvent:
    return StepEvent(step=n, total_steps=4, epoch=n / 8, loss=loss, lr=1e-3 * n, grad_norm=0.5 + n,
                     tokens_per_s=1000.0 + n, samples_per_s=10.0, step_time_s=0.25,
                     peak_memory_bytes=[2**30 + n * 2**20, 2**30 + 2 * n * 2**20])  # fmt: skip


def sample(rank0_rss: int, age_s: float = 0.0) -> str:
    """A devices.jsonl line of the CPU monitor, taken ``age_s`` seconds ago."""
    devices = [{"key": "rank0", "utilization_pct": 180.0, "memory_used": rank0_rss},
               {"key": "rank1", "utilization_pct": 170.0, "memory_used": 3 * 2**28}]  # fmt: skip
    doc = {"type": "devices", "time": time.time() - age_s, "devices": devices}
    return json.dumps(doc) + "\n"


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar curve of RUN/tensorboard, read by TensorBoard's own reader."""
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def warnings(run_dir: Path) -> list[str]:
    lines = (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()
    return [e["message"] for e in map(json.loads, lines) if e["type"] == "warning"]


def test_tensorboard_holds_the_events_figures_and_a_resume_continues_the_curves(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    devices = run_dir / "devices.jsonl"
    # An earlier attempt's sample (a minute old), then one taken while the model loaded.
    devices.write_text(sample(1, age_s=60) + sample(4 * 2**28, age_s=1), encoding="utf-8")
    events = EventLog(run_dir / "events.jsonl", enabled=True)
    events.sink = open_reporting(spec(["tensorboard"]), run_dir, 0, events)
    events.write(step(1, LOSSES[0]))
    with devices.open("a", encoding="utf-8") as out:
        out.write(sample(5 * 2**28))  # the monitor's sample while step 2 trains
    events.write(step(2, LOSSES[1]))
    events.write(EvalEvent(step=2, loss=1.5, perplexity=math.exp(1.5), tokens=99))
    events.write(step(3, 9.0))  # no new sample; then the run crashes after step 2's checkpoint
    events.close()

    # The resume from step 2's checkpoint (its monitor sampled while the model loaded): step 3
    # again, with another loss, and step 4.
    with devices.open("a", encoding="utf-8") as out:
        out.write(sample(6 * 2**28, age_s=1))
    events = EventLog(run_dir / "events.jsonl", enabled=True)
    events.sink = open_reporting(spec(["tensorboard"]), run_dir, 2, events)
    events.write(step(3, LOSSES[2]))
    events.write(step(4, LOSSES[3]))
    events.write(EndEvent(reason="completed", steps=4))
    assert events.sink.closed and warnings(run_dir) == []

    found = scalars(run_dir)
    assert found["train/loss"] == [(n + 1, loss) for n, loss in enumerate(LOSSES)]  # 9.0 purged
    assert [n for n, _ in found["train/lr"]] == [1, 2, 3, 4]
    assert [v for _, v in found["train/lr"]] == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3], rel=1e-6)
    assert found["train/grad_norm"] == [(n, 0.5 + n) for n in range(1, 5)]
    assert found["train/tokens_per_s"] == [(n, 1000.0 + n) for n in range(1, 5)]
    # float32, as TensorBoard stores every scalar: exact for whole MiB
    assert found["rank1/peak_memory_bytes"] == [(n, 2**30 + 2 * n * 2**20) for n in range(1, 5)]
    assert found["eval/loss"] == [(2, 1.5)]
    ((at, perplexity),) = found["eval/perplexity"]  # float32, as TensorBoard stores scalars
    assert at == 2 and perplexity == pytest.approx(math.exp(1.5), rel=1e-6)
    # Each fresh sample once, at the step after it was taken (the minute-old one: never).
    assert found["rank0/memory_used_bytes"] == [(1, 4 * 2**28), (2, 5 * 2**28), (3, 6 * 2**28)]
    assert found["rank1/utilization_pct"] == [(1, 170.0), (2, 170.0), (3, 170.0)]
    assert "train/mfu" not in found  # None on the CPU: left out
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["tensors"] == ["run/preset/text_summary"]  # once, by the fresh start
    assert len(list((run_dir / "tensorboard").iterdir())) == 2  # one file per attempt


def test_report_to_nothing_writes_no_folder(tmp_path):
    events = EventLog(tmp_path / "events.jsonl", enabled=True)
    assert open_reporting(spec([]), tmp_path, 0, events) is None
    events.write(step(1, 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl"]


class FullDisk:
    """A logger whose every write fails, as one on a full disk or a lost server would."""

    name = "wandb"

    def __init__(self) -> None:
        self.writes = 0

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.writes += 1
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        raise AssertionError("dropped: never flushed")

    def close(self) -> None:
        raise AssertionError("dropped: never closed")


def test_a_failing_logger_is_one_warning_and_the_others_go_on(tmp_path):
    events = EventLog(tmp_path / "events.jsonl", enabled=True)
    failing = FullDisk()
    board = TensorBoardBackend(tmp_path / "tensorboard", 0, {})
    warn = lambda message: events.write(WarningEvent(message=message))  # noqa: E731
    events.sink = Reporting([failing, board], DeviceSamples(tmp_path / "devices.jsonl"), warn)
    for n, loss in enumerate(LOSSES, start=1):
        events.write(step(n, loss))
    events.write(EndEvent(reason="completed", steps=4))
    assert failing.writes == 1
    assert warnings(tmp_path) == ["wandb: could not write (OSError: [Errno 28] No space left on "
                                  "device); logging to it stopped, training goes on"]  # fmt: skip
    assert [v for _, v in scalars(tmp_path)["train/loss"]] == LOSSES


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_a_logger_that_cannot_start_in_the_worker_is_a_warning(tmp_path):
    """The front end refuses this preset; a resume on a machine without wandb gets here."""
    events = EventLog(tmp_path / "events.jsonl", enabled=True)
    events.sink = open_reporting(spec(["wandb", "tensorboard"]), tmp_path, 0, events)
    events.write(step(1, 2.0))
    events.close()
    assert warnings(tmp_path) == ["wandb: could not start (ModuleNotFoundError: No module named "
                                  "'wandb'); the run goes on without it"]  # fmt: skip
    assert scalars(tmp_path)["train/loss"] == [(1, 2.0)]


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_run_refuses_a_logger_that_is_not_installed(name, in_repo, capsys):
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed")
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    rc = main(["run", "tiny-demo", "--gpus", "cpu:2", "--detach",
               "--set", f'log.report_to=["tensorboard", "{name}"]'])  # fmt: skip
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert lines == [
        f'error: log.report_to: "{name}" is named, but the {name} package is not installed',
        f'hint: pip install "homelab-dp[{name}]", or take "{name}" out of log.report_to',
    ]
    assert not runs.exists() or not any(runs.iterdir())


def test_a_gpu_sample_becomes_per_card_scalars():
    """The monitor's NVML sample (`supervise.device_monitor`): one group per card, None readings left out."""
    card = {"index": 3, "key": "gpu3", "utilization_pct": 97, "memory_utilization_pct": 41,
            "memory_used": 80 * 2**30, "memory_total": 141 * 2**30, "temperature_c": 71,
            "power_w": 650.5, "energy_mj": None, "energy_wh": 0.25}  # fmt: skip
    other = {**card, "index": 4, "key": "gpu4", "power_w": None}
    assert device_scalars({"devices": [card, other]}) == {
        "gpu3/memory_used_bytes": 80.0 * 2**30, "gpu3/utilization_pct": 97.0,
        "gpu3/memory_utilization_pct": 41.0, "gpu3/temperature_c": 71.0, "gpu3/power_w": 650.5,
        "gpu4/memory_used_bytes": 80.0 * 2**30, "gpu4/utilization_pct": 97.0,
        "gpu4/memory_utilization_pct": 41.0, "gpu4/temperature_c": 71.0,
    }  # fmt: skip


class Recorder:
    """A logger that keeps what it is given (the loggers' side of `Reporting`)."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, Any]] = []

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.calls.append(("scalars", step, sorted(values)))

    def samples(self, step: int, rows: list[SampleEvent]) -> None:
        self.calls.append(("samples", step, [(e.prompt, e.text) for e in rows]))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.calls.append(("close", 0, None))


def answer(n: int, prompt: str, text: str) -> SampleEvent:
    return SampleEvent(step=n, prompt=prompt, text=text, tokens=3, seconds=0.5)


def test_a_steps_samples_are_one_table_at_that_step_in_tensorboard_and_every_logger(tmp_path):
    recorder = Recorder()
    tb = TensorBoardBackend(tmp_path / "tensorboard", 0, {})
    reporting = Reporting([recorder, tb], None, lambda m: None)
    reporting.event(step(2, 2.0))
    reporting.event(answer(2, "Name a colour.", "Red | blue\nand green"))
    reporting.event(answer(2, "Two plus two?", "4"))
    reporting.event(answer(4, "Name a colour.", "Red."))  # another step: step 2's table goes
    reporting.event(EndEvent(reason="completed", steps=4))  # the last table before closing
    assert recorder.calls == [
        ("scalars", 2, sorted(step_scalars(step(2, 2.0)))),
        ("samples", 2, [("Name a colour.", "Red | blue\nand green"), ("Two plus two?", "4")]),
        ("samples", 4, [("Name a colour.", "Red.")]),
        ("close", 0, None),
    ]
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [
        (e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("samples/text_summary")
    ]
    assert [n for n, _ in texts] == [2, 4]
    assert texts[0][1].splitlines() == [
        "| prompt | answer | tokens | seconds |", "|---|---|---|---|",
        "| Name a colour. | Red \\| blue<br>and green | 3 | 0.50 |",
        "| Two plus two? | 4 | 3 | 0.50 |",
    ]  # fmt: skip
