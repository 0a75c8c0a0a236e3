"""``train.deterministic``: the preset field, the workers' environment, the torch switches; and
every preset field documented (``presets show`` and the TUI show each field's docstring)."""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import replace

import pytest

from homelab_dp.errors import PresetError
from homelab_dp.presets.preset import SECTIONS, field_docs, preset_from_dict
from homelab_dp.runs.run_spec import RunSpec
from homelab_dp.supervise.launcher import worker_env
from tests.conftest import DATA

RECORDED = DATA / "events" / "20250301-101500-smollm2-135m-lora-7f3a" / "spec.json"


def test_every_preset_field_has_a_docstring() -> None:
    docs = field_docs()
    fields = {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert fields - docs.keys() == set()
    assert all(docs[f].strip() for f in fields)


def test_deterministic_is_off_by_default_and_a_bool() -> None:
    minimal = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}
    assert preset_from_dict(minimal).train.deterministic is False
    on = preset_from_dict({**minimal, "train": {"deterministic": True}})
    assert on.train.deterministic is True
    with pytest.raises(PresetError, match="train.deterministic: expected true or false"):
        preset_from_dict({**minimal, "train": {"deterministic": "yes"}})
    assert typing.get_type_hints(SECTIONS["train"])["deterministic"] is bool


def _spec(deterministic: bool) -> RunSpec:
    spec = RunSpec.from_json(json.loads(RECORDED.read_text(encoding="utf-8")))  # CUDA, 2 cards
    train = replace(spec.preset.train, deterministic=deterministic)
    return replace(spec, preset=replace(spec.preset, train=train))


def test_the_workers_get_cublas_workspace_config_only_when_asked(monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in worker_env(_spec(False))
    assert worker_env(_spec(True))["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own (also valid) choice
    assert worker_env(_spec(True))["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_the_spec_carries_the_field_and_an_older_spec_reads_as_off() -> None:
    doc = _spec(True).to_json()
    assert RunSpec.from_json(doc).preset.train.deterministic is True
    del doc["preset"]["train"]["deterministic"]  # written before the field existed
    assert RunSpec.from_json(doc).preset.train.deterministic is False


def test_set_determinism_turns_the_torch_switches_on(monkeypatch) -> None:
    import torch

    from homelab_dp.train.loop.rank_setup import set_determinism

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded, so restored afterwards
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)  # fmt: skip
    try:
        set_determinism(False)
        assert not torch.are_deterministic_algorithms_enabled()
        set_determinism(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]
