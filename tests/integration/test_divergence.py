"""A run that diverges (a finite but absurd learning rate) ends with a clear error, exit 1 and
state failed, keeping its last good checkpoint and writing none of non-finite weights
(`homelab_dp.train.loop.divergence`; issue 28, class 7). One real run: torchrun, gloo, 2 CPU
processes, through the controller and the keeper."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from homelab_dp.app.runs import make_controller
from homelab_dp.train.loop.checkpoints import check_checkpoint, find_usable
from tests.conftest import write_preset
from tests.integration.conftest import events
from tests.integration.test_faults import start, wait_done

pytestmark = pytest.mark.slow


def test_a_diverging_run_fails_with_an_error_and_keeps_its_last_good_checkpoint(
    tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    controller = make_controller(tmp_path / "runs")
    preset = write_preset(tmp_path, "diverge", tiny_model, data_dir / "ragged-64.jsonl",
                          lr=1e30, max_steps=6, checkpoint_every=1, log_every=1,
                          max_grad_norm=0.0, collective_timeout_s=30)  # fmt: skip
    doc = wait_done(controller, start(controller, preset))
    run_dir = Path(doc["path"])
    assert doc["status"] == "failed", doc
    assert "training diverged" in doc["reason"], doc["reason"]
    errors = events(run_dir, "error")
    assert errors and all(e["kind"] == "NonFiniteError" for e in errors)
    assert errors[0]["hint"].startswith("lower train.lr (now ")  # the step's lr, after warm-up
    assert not events(run_dir, "end")  # failed, not completed: no result
    assert not (run_dir / "final").exists()
    # Every logged loss is a finite number (no NaN reaches events.jsonl), and the run ended at
    # the first step whose loss was not.
    steps = events(run_dir, "step")
    assert steps and all(math.isfinite(s["loss"]) for s in steps)
    failed_at = len(steps) + 1
    assert f"the loss of step {failed_at} is" in errors[0]["message"]
    for line in (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in events.jsonl"))
    # The checkpoints are those of the finite steps, the newest intact and finite.
    names = [p.name for p in sorted((run_dir / "checkpoints").glob("step-*"))]
    assert names and names[-1] == f"step-{failed_at - 1}", names
    newest, skipped = find_usable(run_dir / "checkpoints")
    assert newest is not None and newest.name == names[-1] and not skipped
    assert check_checkpoint(newest) is None
    print(f"failed at step {failed_at} ({doc['reason']}); kept {names}")
    tensors = [t for f in newest.rglob("*.safetensors") for t in load_file(f).values()]
    assert tensors and all(t.isfinite().all() for t in tensors if t.is_floating_point())
