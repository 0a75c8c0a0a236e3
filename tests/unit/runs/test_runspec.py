"""The run contract: RunSpec reads every format version, writes what scripts read, and its
changes (resume, a new rendezvous, the out-of-memory retry) keep what must not change."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from homelab_dp.runs.folder.run_folder import create_run_dir, read_run_spec
from homelab_dp.runs.run_spec import RUN_SPEC_VERSION, Rendezvous, RunSpec
from tests.conftest import DATA

RECORDED_V1 = DATA / "events" / "20250301-101500-smollm2-135m-lora-7f3a" / "spec.json"


def _v1() -> dict:
    return json.loads(RECORDED_V1.read_text(encoding="utf-8"))


def test_a_version_1_spec_reads_with_defaults_for_what_it_lacks() -> None:
    old = _v1()
    spec = RunSpec.from_json(old)
    assert spec.run_id == old["run_id"] and spec.resolved.method == "lora"
    assert spec.launch.nproc_per_node == 2 and spec.launch.gpu_indices == (0, 1)
    assert spec.launch.rendezvous == Rendezvous()  # single node on loopback
    assert not spec.resume and spec.retries == () and spec.measure_steps == 0
    assert spec.preset.source == old["preset_source"]
    assert spec.planned_bytes == old["plan"]["per_device_bytes"]


def test_the_written_document_keeps_every_version_1_key_and_value() -> None:
    old = _v1()
    new = RunSpec.from_json(old).to_json()
    assert new["version"] == RUN_SPEC_VERSION
    for key in ("run_id", "preset_source", "plan", "gpu_indices", "nproc_per_node"):
        assert new[key] == old[key], key
    # Fields added since (offload) come with their defaults; every old one keeps its value.
    assert {k: new["resolved"][k] for k in old["resolved"]} == old["resolved"]
    assert new["resolved"]["offload"] == "none" and new["resolved"]["offload_activations"] is False
    assert new["preset"] == RunSpec.from_json(old).preset.to_dict()
    assert new["rendezvous"] == {"nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1",
                                 "master_port": None}  # fmt: skip


def test_a_round_trip_through_the_run_folder_is_lossless(tmp_path: Path) -> None:
    spec = RunSpec.from_json(_v1()).with_batch(2, 8, True)
    spec = replace(spec, run_id="rt", measure_steps=3, collective_timeout_s=90.0)
    run_dir = create_run_dir(spec, tmp_path)
    assert read_run_spec(run_dir) == spec
    assert (run_dir.stat().st_mode & 0o777) == 0o700


def test_the_out_of_memory_retry_keeps_the_effective_batch_and_records_itself() -> None:
    spec = RunSpec.from_json(_v1())
    retried = spec.with_batch(2, 8, True)
    assert retried.resolved.effective_batch == spec.resolved.effective_batch == 32
    assert retried.preset.train.micro_batch == 2 and retried.preset.train.grad_accum == 8
    assert retried.resolved.activation_checkpointing and retried.resume
    (retry,) = retried.retries
    assert retry.before == (4, 4, False) and retry.after == (2, 8, True)


def test_a_relaunch_resumes_with_the_new_rendezvous_only() -> None:
    spec = RunSpec.from_json(_v1())
    rdzv = Rendezvous(nnodes=2, node_rank=1, master_addr="10.0.0.2", master_port=29500)
    again = spec.relaunched(rdzv)
    assert again.resume and again.launch.rendezvous == rdzv
    assert replace(again, resume=False, launch=spec.launch) == spec
