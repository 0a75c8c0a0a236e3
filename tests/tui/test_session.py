"""The Plan/Launch session: edits become exactly the CLI's --set overrides; no command opens the TUI."""

from __future__ import annotations

import pytest

from homelab_dp import cli
from homelab_dp.tui import tui_app
from homelab_dp.tui.session import Session, override


def test_overrides_are_typed_as_the_cli_reads_them() -> None:
    assert override("train.micro_batch", " 2 ") == "train.micro_batch=2"
    assert (
        override("train.activation_checkpointing", "true") == "train.activation_checkpointing=true"
    )
    assert (
        override("train.activation_checkpointing", "auto")
        == 'train.activation_checkpointing="auto"'
    )
    assert override("model.path", 'my "models"/x') == 'model.path="my \\"models\\"/x"'


@pytest.mark.usefixtures("in_repo")
def test_only_changed_fields_become_overrides_and_plan_with_them() -> None:
    session = Session()
    session.load("tiny-demo")
    session.edits.update({"data.seq_len": "256", "train.grad_accum": "4", "model.path": "x y"})
    session.extra = ["train.max_steps=4"]
    assert session.overrides() == [
        "train.grad_accum=4",
        'model.path="x y"',
        "train.max_steps=4",
    ]
    assert session.command() == (
        "homelab-dp run tiny-demo --set train.grad_accum=4 --set 'model.path=\"x y\"' "
        "--set train.max_steps=4"
    )
    session.edits.pop("model.path")
    planned = session.plan()
    assert planned.plan.grad_accum == 4 and planned.preset.train.max_steps == 4


def test_no_command_opens_the_tui(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[bool] = []
    monkeypatch.setattr(tui_app, "run_tui", lambda: opened.append(True) or 0)
    assert cli.main([]) == 0
    assert opened == [True]
