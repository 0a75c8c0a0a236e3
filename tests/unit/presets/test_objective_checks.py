"""The preference objective's fields checked against each other: one `error:` line naming the
key, a `hint:`, exit 2, nothing started (through the CLI, on the shipped tiny-demo preset)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from homelab_dp.errors import PresetError
from homelab_dp.presets.preset import preset_from_dict
from tests.conftest import run_cli

BAD = [
    (["train.objective=simpo"], "train.objective: expected 'sft' | 'dpo' | 'orpo' | 'kto' | 'grpo'"),
    (["train.objective=dpo", "train.method=full", "train.reference=adapters"],
     "train.reference = 'adapters' needs LoRA or QLoRA"),
    (["train.objective=kto", "train.method=full", "train.reference=adapters"],
     "train.reference = 'adapters' needs LoRA or QLoRA"),
    (["train.objective=dpo", "train.method=lora", "train.reference=copy"],
     "train.reference = 'copy' is for a full fine-tune"),
    (["train.objective=dpo", "train.distribution=fsdp-full", "train.reference=copy"],
     "train.reference = 'copy' needs an unsharded model"),
    (["train.objective=dpo", "train.beta=0"], "train.beta: must be greater than 0"),
    (["train.objective=kto", "train.beta=-0.5"], "train.beta: must be greater than 0"),
    (["train.objective=dpo", "train.label_smoothing=0.5"],
     "train.label_smoothing: must be at least 0 and below 0.5"),
    (["train.objective=dpo", "train.label_smoothing=-0.1"],
     "train.label_smoothing: must be at least 0 and below 0.5"),
    (["train.objective=orpo", "train.orpo_lambda=-1"], "train.orpo_lambda: must not be negative"),
    (["train.objective=dpo", "train.dpo_loss=ipo", "train.label_smoothing=0.1"],
     "train.label_smoothing: the ipo loss has no label smoothing"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("sets", "message"), BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)]
)
def test_a_bad_objective_setting_is_one_error_line_with_a_hint(
    in_repo: Path, capsys: pytest.CaptureFixture[str], sets: list[str], message: str
) -> None:
    argv = [a for s in sets for a in ("--set", s)]
    rc, out, err = run_cli(capsys, "plan", "tiny-demo", *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and out == ""
    assert len(lines) == 2 and lines[0].startswith("error: ") and message in lines[0], err
    assert lines[1].startswith("hint: ")
    assert "Traceback" not in err


def test_run_with_a_bad_objective_setting_starts_nothing(
    in_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run_cli(capsys, "run", "tiny-demo", "--set", "train.objective=dpo",
                         "--set", "train.beta=0", "--detach")  # fmt: skip
    assert rc == 2 and "train.beta" in err.splitlines()[0]
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    assert not runs.exists() or not any(runs.iterdir())


def test_the_choices_the_checks_leave_alone_are_valid() -> None:
    def preset(**train: object):
        return preset_from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "train": train})

    preset(objective="dpo", dpo_loss="ipo", label_smoothing=0.0)
    preset(objective="dpo", label_smoothing=0.49, beta=0.01)
    preset(objective="orpo", orpo_lambda=0.0, method="full")
    preset(objective="dpo", method="lora", reference="adapters")
    preset(objective="dpo", method="auto", reference="adapters")  # the planner keeps to LoRA
    preset(objective="dpo", method="full", reference="precompute")
    preset(objective="dpo", method="full", distribution="zero1", reference="copy")
    preset(objective="orpo", method="lora", reference="copy")
    preset(objective="orpo", method="full", reference="adapters")  # ORPO reads no reference
    with pytest.raises(PresetError) as exc:  # every problem is listed
        preset(objective="dpo", beta=0.0, orpo_lambda=-1.0)
    assert len(exc.value.problems) == 2
