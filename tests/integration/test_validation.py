"""Validation while training, end to end through the real console script, torchrun and gloo.

- eval events every ``train.eval_every`` steps and at the end, with the same loss on 1 and 2
  processes, equal to `homelab_dp.train.evaluation.eval_loss` on the final model computed here, and shown
  by the follower's lines and by ``status`` (text and ``--json``);
- ``train.keep_best`` keeps the best checkpoint beside the newest, and early stopping ends the
  run after ``train.early_stopping_patience`` evaluations without a lower loss, as completed;
  the same run's TensorBoard files hold its step and eval losses and device samples;
- each bad preset of the feature: one clear error, nothing started.

The split itself (disjoint, seeded, the same on any world size, never trained on) is
tests/unit/data/test_split.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from homelab_dp.cli.main import main
from tests.conftest import DATA
from tests.integration.conftest import DEMO_DATA, events

EXE = Path(sys.executable).with_name("homelab-dp")
pytestmark = pytest.mark.slow


def write(folder: Path, name: str, model: Path, *, nproc: int, data: dict, train: dict) -> Path:
    """A full DDP fine-tune preset on ``nproc`` CPU processes of the demo data."""
    doc = {
        "model": {"path": str(model)},
        "data": {"path": str(DEMO_DATA), "seq_len": 64, "pack": True, **data},
        "train": {"method": "full", "distribution": "ddp", "micro_batch": 2, "lr": 1e-3,
                  "seed": 11, **train},
        "hardware": {"devices": "cpu", "nproc": nproc},
    }  # fmt: skip
    path = folder / f"{name}.toml"
    path.write_text(f"# homelab-dp run {path}\n" + tomli_w.dumps(doc), encoding="utf-8")
    return path


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(EXE), *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )


def finished(env: dict[str, str], preset: Path, stop_at: int | None = None) -> tuple[Path, str]:
    """Run ``preset`` in the foreground (plain lines); its folder and output. ``stop_at``:
    stopped after that many steps (a test stop), then resumed to the end."""
    stops = {} if stop_at is None else {"HOMELAB_DP_STOP_AT_STEP": str(stop_at)}
    out = cli({**env, **stops}, "run", str(preset))
    runs = Path(env["HOMELAB_DP_RUNS"])
    run_dir = max(runs.iterdir(), key=lambda p: p.stat().st_mtime)
    if stop_at is not None:
        assert out.returncode == 130, out.stdout + out.stderr  # interrupted
        out = cli(env, "resume", run_dir.name)
    assert out.returncode == 0, out.stdout + out.stderr
    return run_dir, out.stdout


def status(env: dict[str, str], run_dir: Path) -> dict[str, Any]:
    return json.loads(cli(env, "status", run_dir.name, "--json").stdout)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HOMELAB_DP_RUNS": str(tmp_path / "runs")}


def test_eval_every_and_at_the_end_the_same_on_1_and_2_processes_and_as_computed_here(
    env: dict[str, str], tiny_model: Path, tmp_path: Path
) -> None:
    data = {"eval_fraction": 0.02}  # 40 of the 2,000 samples
    train = {"max_steps": 5, "eval_every": 2, "keep_checkpoints": 3}
    two = write(tmp_path, "two", tiny_model, nproc=2, data=data, train={**train, "grad_accum": 2})
    one = write(tmp_path, "one", tiny_model, nproc=1, data=data, train={**train, "grad_accum": 4})
    run_two, out_two = finished(env, two)
    run_one, _ = finished(env, one, stop_at=3)  # and resumed: it evaluates as if not
    # The checkpoint of the stop carries the evaluations so far (the best: step 2).
    trainer = json.loads((run_one / "checkpoints" / "step-3" / "trainer.json").read_text())
    step_2 = events(run_one, "eval")[0]
    assert trainer["eval"] == {"best_loss": step_2["loss"], "best_step": 2, "since_best": 0}
    evals = {n: events(r, "eval") for n, r in ((2, run_two), (1, run_one))}
    for n, found in evals.items():
        assert [e["step"] for e in found] == [2, 4, 5], n  # every 2 steps and the last
        assert all(e["tokens"] == found[0]["tokens"] > 0 for e in found)
        assert [e["best"] for e in found] == [True, True, True]  # lr 1e-3: still falling
    for e1, e2 in zip(evals[1], evals[2], strict=True):
        assert e1["tokens"] == e2["tokens"]
        assert e1["loss"] == pytest.approx(e2["loss"], rel=1e-6, abs=0)
        assert e2["perplexity"] == pytest.approx(math.exp(e2["loss"]), rel=1e-12)

    # The last eval is the result's loss on the held-out samples, computed here directly.
    direct = _evaluate_here(run_two / "final", read_preset(two))
    worst = max(abs(e1["loss"] / e2["loss"] - 1) for e1, e2 in zip(*evals.values(), strict=True))
    print(
        f"eval losses (2 processes) {[e['loss'] for e in evals[2]]}; 1 vs 2 processes: worst "
        f"relative difference {worst:.2e}; computed here {direct.loss!r} "
        f"({abs(direct.loss / evals[2][-1]['loss'] - 1):.2e} from the last event)"
    )
    assert direct.tokens == evals[2][-1]["tokens"]
    assert direct.loss == pytest.approx(evals[2][-1]["loss"], rel=1e-6, abs=0)

    # The follower printed each eval; status shows the last (and the best).
    n = events(run_two, "start")[0]["eval_blocks"]
    assert n > 0 and f"evaluating {n} block{'s' if n > 1 else ''} every 2 steps" in out_two
    for e in evals[2]:
        assert f"eval step {e['step']}: loss {e['loss']:.4f}, ppl {e['perplexity']:,.1f}, " \
               f"{e['tokens']:,} tokens" in out_two  # fmt: skip
    last = evals[2][-1]
    assert status(env, run_two)["eval"] == {
        "step": 5, "loss": last["loss"], "perplexity": last["perplexity"],
        "tokens": last["tokens"], "best_step": 5, "best_loss": last["loss"],
    }  # fmt: skip
    text = cli(env, "status", run_two.name).stdout
    assert f"eval      step 5: loss {last['loss']:.4f}" in text


def read_preset(path: Path) -> Any:
    from homelab_dp.presets.preset import load_preset

    return load_preset(path)


def _evaluate_here(final: Path, preset: Any) -> Any:
    """`train.evaluation.eval_loss.evaluate` on the saved result, one process, the eval blocks as built by
    the data layer for this preset."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from homelab_dp.data.eval_split import load_train_eval
    from homelab_dp.train.evaluation.eval_loss import eval_blocks, evaluate

    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    split = load_train_eval(
        preset.data, tokenizer, seed=preset.train.seed, seq_len_limit=None, min_blocks=1
    )
    blocks = eval_blocks(split.eval, packed=True)
    return evaluate(model, blocks, rank=0, world=1, micro=3, device=torch.device("cpu"))


def test_keep_best_and_early_stopping(env: dict[str, str], tiny_model: Path, tmp_path: Path):
    """A learning rate far too high: the eval loss soon stops falling. The run ends after
    ``patience`` evaluations without a new best, completed with its result, and the best
    step's checkpoint is kept beside the newest although ``keep_checkpoints`` is 1."""
    patience, max_steps = 2, 40
    train = {"max_steps": max_steps, "lr": 0.05, "grad_accum": 1, "eval_every": 1,
             "early_stopping_patience": patience, "keep_best": True, "checkpoint_every": 1,
             "keep_checkpoints": 1}  # fmt: skip
    preset = write(tmp_path, "stop", tiny_model, nproc=2, data={"eval_fraction": 0.01}, train=train)
    run_dir, _ = finished(env, preset)
    doc = status(env, run_dir)
    found = events(run_dir, "eval")
    losses = [e["loss"] for e in found]
    # The rule, replayed on the losses: stop at the first eval `patience` evals after the best.
    best, since, stop_at = math.inf, 0, None
    for e in found:
        best, since = (e["loss"], 0) if e["loss"] < best else (best, since + 1)
        assert e["best"] == (since == 0)
        if since >= patience:
            stop_at = e["step"]
            break
    assert stop_at is not None and stop_at < max_steps, losses
    assert found[-1]["step"] == stop_at  # nothing evaluated after the stop
    end = events(run_dir, "end")[-1]
    assert (end["reason"], end["steps"]) == ("early_stopped", stop_at)
    assert doc["status"] == "completed" and doc["step"] == stop_at
    assert "early stopped at step" in doc["reason"]
    assert (run_dir / "final" / "model.safetensors").is_file()

    best_step = min(found, key=lambda e: e["loss"])["step"]
    marker = json.loads((run_dir / "checkpoints" / "BEST").read_text(encoding="utf-8"))
    assert marker["step"] == best_step and marker["loss"] == min(losses)
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == sorted({"BEST", f"step-{best_step}", f"step-{stop_at}"})
    trainer = json.loads((run_dir / "checkpoints" / f"step-{stop_at}" / "trainer.json").read_text())
    assert trainer["eval"] == {"best_loss": min(losses), "best_step": best_step,
                               "since_best": patience}  # fmt: skip
    assert doc["eval"]["best_step"] == best_step and doc["eval"]["step"] == stop_at

    # Rank 0's TensorBoard files (the default log.report_to), read by TensorBoard's own
    # reader: the figures of events.jsonl (as float32) and the device monitor's samples.
    curves = tensorboard_scalars(run_dir / "tensorboard")
    for tag, kind, field in (("train/loss", "step", "loss"), ("train/lr", "step", "lr"),
                             ("eval/loss", "eval", "loss")):  # fmt: skip
        written = events(run_dir, kind)
        assert [n for n, _ in curves[tag]] == [e["step"] for e in written], tag
        assert [v for _, v in curves[tag]] == pytest.approx([e[field] for e in written], rel=1e-7)
    for name in ("memory_used_bytes", "utilization_pct"):  # CPU: each rank's RSS and CPU %
        assert {"rank0", "rank1"} <= {t.split("/")[0] for t in curves if t.endswith(name)}
    assert all(v > 0 for _, v in curves["rank0/memory_used_bytes"])


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar curve of a TensorBoard folder: tag → [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


BAD = {
    "eval-fraction-out-of-range": "data.eval_fraction: must be between 0.0 and 0.5, got 0.75",
    "eval-path-and-fraction": "data.eval_path and data.eval_fraction: both set",
    "patience-without-eval-data": "train.early_stopping_patience: set to 3, but there is no "
    "eval data (set data.eval_path or data.eval_fraction)",
    "missing-eval-data": "data.eval_path: "
    + str(DATA.parent.parent / "no/such/eval.jsonl")
    + " does not exist",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_validation_presets_are_refused_before_anything_starts(name, in_repo, capsys):
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    try:
        rc = main(["run", str(DATA / "bad_presets" / f"{name}.toml"), "--detach"])
    except SystemExit as exc:
        rc = int(exc.code)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and BAD[name] in lines[0] and lines[0].startswith("error: "), err
    assert lines[-1].startswith("hint: ") and "Traceback" not in err
    assert not runs.exists() or not any(runs.iterdir())
