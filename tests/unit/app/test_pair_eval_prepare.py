"""`eval` on preference pairs, before anything starts: which reference, which loss settings.

- a full run result is compared with the run's starting model (its preset's model.path), with
  the run's train.beta / dpo_loss / label_smoothing;
- an adapter folder is compared with its base, adapters disabled (``reference`` null in the job);
- ``--reference`` wins over both; a reference with another vocabulary is refused.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from homelab_dp.app.evaluate import job_document, prepare
from homelab_dp.errors import HomelabError
from homelab_dp.runs.folder.run_folder import create_run_dir
from homelab_dp.runs.run_spec import RunSpec
from tests.conftest import DATA, ROOT

TINY = ROOT / "assets" / "models" / "tiny-llama"
PAIRS = ROOT / "assets" / "data" / "tiny-preferences.jsonl"
RECORDED_V1 = DATA / "events" / "20250301-101500-smollm2-135m-lora-7f3a" / "spec.json"


def _model_copy(folder: Path) -> Path:
    shutil.copytree(TINY, folder)
    return folder


def _full_run(tmp_path: Path) -> Path:
    """A completed full fine-tune of the tiny model (its result a copy of the tiny model),
    trained with beta 0.3 and the IPO loss."""
    spec = RunSpec.from_json(json.loads(RECORDED_V1.read_text(encoding="utf-8")))
    p = spec.preset
    preset = replace(
        p, model=replace(p.model, path=str(TINY)),
        train=replace(p.train, method="full", beta=0.3, dpo_loss="ipo", label_smoothing=0.0),
    )  # fmt: skip
    run_dir = create_run_dir(replace(spec, run_id="dpo-full-run", preset=preset), tmp_path)
    _model_copy(run_dir / "final")
    return run_dir


def test_a_full_run_result_is_compared_with_the_runs_starting_model(tmp_path: Path) -> None:
    run_dir = _full_run(tmp_path / "runs")
    job = prepare(str(run_dir), str(PAIRS), seq_len=64, gpus="cpu:1")
    assert job.pairs is not None and job.samples == 96
    assert job.pairs.reference is not None and job.pairs.reference.path == TINY
    assert "the run's starting model" in job.pairs.reference_label
    assert (job.pairs.beta, job.pairs.loss_type, job.pairs.label_smoothing) == (0.3, "ipo", 0.0)
    doc = job_document(job, tmp_path)
    assert doc["reference"]["model_path"] == str(TINY) and doc["reference"]["base_path"] is None
    assert doc["model_path"] == str(run_dir / "final")
    assert (doc["beta"], doc["loss_type"], doc["label_smoothing"]) == (0.3, "ipo", 0.0)


def test_an_adapter_is_compared_with_its_base_adapters_disabled(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(TINY), "peft_type": "LORA"}), encoding="utf-8"
    )
    (adapter / "adapter_model.safetensors").write_bytes(b"")  # only its presence is checked here
    job = prepare(str(adapter), str(PAIRS), seq_len=64, gpus="cpu:1")
    assert job.pairs is not None and job.pairs.reference is None
    assert "adapters disabled" in job.pairs.reference_label
    assert job_document(job, tmp_path)["reference"] is None
    # --reference wins over the base
    other = _model_copy(tmp_path / "other")
    job = prepare(str(adapter), str(PAIRS), seq_len=64, gpus="cpu:1", reference=str(other))
    assert job.pairs is not None and job.pairs.reference.path == other


def test_a_reference_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    other = _model_copy(tmp_path / "other")
    config = json.loads((other / "config.json").read_text(encoding="utf-8"))
    config["vocab_size"] += 64
    (other / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(HomelabError, match="vocabulary") as exc:
        prepare(str(TINY), str(PAIRS), seq_len=64, gpus="cpu:1", reference=str(other))
    assert exc.value.hint
