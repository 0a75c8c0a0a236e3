"""MIG (Multi-Instance GPU) on an A100: the probe reads the mode and the slices, a plan uses
one slice (never the whole card) or refuses, and `doctor` says which; on recorded NVML answers
(tests/data/nvml/a100-80gb-mig.json: two 3g.40gb slices, the first 20 GiB busy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_dp.app import doctor
from homelab_dp.app.doctor import torch_mismatch
from homelab_dp.app.plan import make_plan
from homelab_dp.byte_units import GiB
from homelab_dp.errors import HardwareSpecError
from homelab_dp.presets.preset_store import open_preset
from homelab_dp.probe.fake_nvml import FAKE_ENV, FakeNvml, load_recording
from homelab_dp.probe.hardware import MigInfo, MigSlice
from homelab_dp.probe.machine_facts import BnbFacts, DiskFacts, Facts, TorchDevice, TorchFacts
from homelab_dp.probe.nvml import probe
from homelab_dp.probe.visible_gpus import visibility
from tests.conftest import DATA, run_cli

NVML = DATA / "nvml"
MIG_A100 = NVML / "a100-80gb-mig.json"
CARD_BYTES = 81920 * 2**20  # the whole A100 80GB
SLICE_BYTES = 40192 * 2**20  # one 3g.40gb MIG instance
BUSY_SLICE = "MIG-8f2d6c1a-3e57-5b90-a4c8-1d6e9f3b7a25"
FREE_SLICE = "MIG-c41e7a09-6b3d-5f28-9e1a-52d8b7c0f6e4"
SLICE_NAME = "NVIDIA A100-SXM4-80GB MIG 3g.40gb"


def _recording() -> dict:
    return json.loads(MIG_A100.read_text())


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "recording.json"
    path.write_text(json.dumps(data))
    return path


def _plan(monkeypatch: pytest.MonkeyPatch, recording: Path, *overrides: str, visible=None):
    monkeypatch.setenv(FAKE_ENV, str(recording))
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return make_plan(open_preset("qwen2-0.5b-full-ddp", ["hardware.devices=auto", *overrides]))


# -- the probe --------------------------------------------------------------------------------


def test_the_probe_reads_the_mig_mode_and_each_slice() -> None:
    fake = load_recording(MIG_A100)
    (gpu,) = probe(fake).gpus
    assert gpu.memory_total == CARD_BYTES  # NVML's answer for the card stays as it is
    assert gpu.mig == MigInfo(
        enabled=True,
        pending=True,
        slices=(
            MigSlice(0, BUSY_SLICE, SLICE_NAME, SLICE_BYTES, 20655898624, 21488467968),
            MigSlice(1, FREE_SLICE, SLICE_NAME, SLICE_BYTES, 42130735104, 13631488),
        ),
    )
    # Indices 2..6 hold no instance: NVML answers "not found" there, and that is no slice
    assert fake.calls.count("nvmlDeviceGetMigDeviceHandleByIndex") == 7
    assert (fake.init_count, fake.shutdown_count) == (1, 1)


def test_probe_json_shows_the_slices(monkeypatch, capsys) -> None:
    monkeypatch.setenv(FAKE_ENV, str(MIG_A100))
    rc, out, _ = run_cli(capsys, "probe", "--json")
    (gpu,) = json.loads(out)["gpus"]
    assert rc == 0 and gpu["memory_total"] == CARD_BYTES
    assert gpu["mig"]["enabled"] is True and gpu["mig"]["pending"] is True
    assert [(s["uuid"], s["memory_bytes"]) for s in gpu["mig"]["slices"]] == [
        (BUSY_SLICE, SLICE_BYTES),
        (FREE_SLICE, SLICE_BYTES),
    ]


def test_probe_json_of_a_card_without_mig_has_mig_null(monkeypatch, capsys) -> None:
    monkeypatch.setenv(FAKE_ENV, str(NVML / "1x4090.json"))  # NVML: MIG not supported
    rc, out, _ = run_cli(capsys, "probe", "--json")
    assert rc == 0 and json.loads(out)["gpus"][0]["mig"] is None


def test_the_probe_table_lists_the_slices(monkeypatch, capsys) -> None:
    monkeypatch.setenv(FAKE_ENV, str(MIG_A100))
    rc, out, _ = run_cli(capsys, "probe")
    assert rc == 0 and "MIG on" in out
    assert BUSY_SLICE in out and FREE_SLICE in out and "3g.40gb" in out


# -- the plan ---------------------------------------------------------------------------------


def test_the_plan_uses_one_slice_never_the_whole_card(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    planned = _plan(monkeypatch, MIG_A100)
    hw = planned.hardware
    (device,) = hw.devices
    # The slice with the most free memory, by its MIG UUID (what the run puts in
    # CUDA_VISIBLE_DEVICES), under the card's NVML index
    assert (device.name, device.memory_bytes, device.free_bytes) == (
        SLICE_NAME,
        SLICE_BYTES,
        42130735104,
    )
    assert hw.indices == (0,) and hw.uuids == (FREE_SLICE,)
    assert device.compute_capability == (8, 0) and planned.plan.dtype == "bf16"
    assert device.budget(0.9) <= SLICE_BYTES < CARD_BYTES
    assert planned.plan.chosen.budget.per_device_bytes()["total"] <= device.budget(0.9)
    doc = planned.plan.to_json()
    assert [d["memory_bytes"] for d in doc["hardware"]["devices"]] == [SLICE_BYTES]
    assert doc["training"]["world_size"] == 1
    said = [r for r in planned.plan.reasons if "MIG" in r]
    assert said and FREE_SLICE in said[0] and "GPU 0 (NVIDIA A100-SXM4-80GB)" in said[0]
    assert "nvidia-smi -i 0 -mig 0" in said[0]


def test_plan_json_on_the_mig_card(monkeypatch, capsys, in_repo: Path) -> None:
    monkeypatch.setenv(FAKE_ENV, str(MIG_A100))
    rc, out, err = run_cli(capsys, "plan", "qwen2-0.5b-full-ddp", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert [d["memory_bytes"] for d in doc["hardware"]["devices"]] == [SLICE_BYTES]
    assert all(d["budget_bytes"] <= SLICE_BYTES for d in doc["hardware"]["devices"])


def test_cuda_visible_devices_naming_a_slice_picks_it(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    planned = _plan(monkeypatch, MIG_A100, visible=BUSY_SLICE[:13])  # a unique prefix will do
    (device,) = planned.hardware.devices
    assert planned.hardware.uuids == (BUSY_SLICE,)
    assert (device.memory_bytes, device.free_bytes) == (SLICE_BYTES, 20655898624)
    report = planned.report
    assert report is not None and report.notice is not None and BUSY_SLICE in report.notice


def test_visibility_of_a_mig_value() -> None:
    slices = {0: (BUSY_SLICE, FREE_SLICE)}
    names = {0: "NVIDIA A100-SXM4-80GB", 1: "NVIDIA A100-SXM4-80GB"}
    uuids = {0: "GPU-a", 1: "GPU-b"}
    seen = visibility({"CUDA_VISIBLE_DEVICES": FREE_SLICE}, 2, uuids, names, slices)
    assert seen.indices == (0,) and seen.mig_uuid == FREE_SLICE
    assert "hides GPU 1" in seen.notice and FREE_SLICE in seen.notice
    # CUDA gives a process one MIG instance: the first listed
    both = visibility(
        {"CUDA_VISIBLE_DEVICES": f"{BUSY_SLICE},{FREE_SLICE}"}, 2, uuids, names, slices
    )
    assert both.mig_uuid == BUSY_SLICE and "one MIG" in both.notice
    # A MIG instance NVML does not list here: not applied, every card stays
    other = visibility({"CUDA_VISIBLE_DEVICES": "MIG-0000"}, 2, uuids, names, slices)
    assert other.indices is None and other.mig_uuid is None and "not applied" in other.notice


def test_several_cards_with_a_mig_one_are_refused(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path, tmp_path: Path, capsys
) -> None:
    data = _recording()
    second = {**data["devices"][0], "uuid": "GPU-0d1e2f30-4a5b-6c7d-8e9f-a0b1c2d3e4f5",
              "pci_bus_id": "00000000:81:00.0", "mig_mode": [0, 0], "mig_devices": [],
              "memory": {"total": CARD_BYTES, "free": CARD_BYTES - 2**20, "used": 2**20}}  # fmt: skip
    data["devices"].append(second)
    path = _write(tmp_path, data)
    with pytest.raises(HardwareSpecError) as err:
        _plan(monkeypatch, path)
    message, hint = err.value.message, err.value.hint
    assert "GPU 0 (NVIDIA A100-SXM4-80GB)" in message and "MIG" in message
    assert "NCCL" in message and err.value.exit_code == 2
    assert "sudo nvidia-smi -i 0 -mig 0" in hint and "hardware.devices=[1]" in hint
    # The card without MIG alone is a whole-card plan; the MIG card alone is one slice
    whole = _plan(monkeypatch, path, "hardware.devices=[1]")
    assert [d.memory_bytes for d in whole.hardware.devices] == [CARD_BYTES]
    one = _plan(monkeypatch, path, "hardware.devices=[0]")
    assert [d.memory_bytes for d in one.hardware.devices] == [SLICE_BYTES]
    # The command: one error line, one hint, exit 2
    monkeypatch.setenv(FAKE_ENV, str(path))
    rc, out, err_text = run_cli(capsys, "plan", "qwen2-0.5b-full-ddp")
    lines = err_text.strip().splitlines()
    assert rc == 2 and lines[0].startswith("error: ") and "GPU 0" in lines[0]
    assert lines[-1].startswith("hint: ") and "-mig 0" in lines[-1]


def test_mig_on_without_any_slice_is_refused(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path, tmp_path: Path
) -> None:
    data = _recording()
    data["devices"][0]["mig_devices"] = []
    with pytest.raises(HardwareSpecError) as err:
        _plan(monkeypatch, _write(tmp_path, data))
    assert "GPU 0 (NVIDIA A100-SXM4-80GB)" in err.value.message
    assert "no MIG instance" in err.value.message
    assert "-cgi" in err.value.hint and "-mig 0" in err.value.hint


def test_mig_pending_only_still_plans_the_whole_card(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path, tmp_path: Path
) -> None:
    """MIG turned on but the card not reset yet: CUDA still sees the whole card."""
    data = _recording()
    data["devices"][0].update(mig_mode=[0, 1], mig_devices=[])
    planned = _plan(monkeypatch, _write(tmp_path, data))
    assert [d.memory_bytes for d in planned.hardware.devices] == [CARD_BYTES]
    assert planned.hardware.uuids == ("GPU-3b8e1f64-9a2c-4d71-b5e0-7c42d19f8a06",)


# -- doctor ------------------------------------------------------------------------------------

A100_SLICE = TorchDevice(SLICE_NAME, SLICE_BYTES, (8, 0))


def _facts(report, torch: TorchFacts) -> Facts:
    bnb = BnbFacts("0.50.2", imported=True, cuda_kernels=True)
    return Facts(report, torch, bnb, DiskFacts("/srv/runs", 500 * GiB, 2000 * GiB), 16 * GiB,
                 (1048576, 1048576))  # fmt: skip


def _torch(*devices: TorchDevice) -> TorchFacts:
    return TorchFacts("2.13.0+cu126", cuda="12.6", cuda_available=True, devices=devices, nccl=True)


def test_doctor_reports_the_mig_mode() -> None:
    report = probe(load_recording(MIG_A100))
    # torch, asked without CUDA_VISIBLE_DEVICES, sees one MIG slice: that is not a mismatch
    assert torch_mismatch(report, _torch(A100_SLICE)) is None
    checks = {c.name: c for c in doctor.run_checks(_facts(report, _torch(A100_SLICE)))}
    mig = checks["GPU 0 MIG"]
    assert mig.status == "warn"
    assert "2 slices" in mig.detail and "3g.40gb" in mig.detail and FREE_SLICE in mig.detail
    assert "sudo nvidia-smi -i 0 -mig 0" in mig.hint
    assert checks["torch sees the cards"].status == "ok"
    # A card with MIG possible but off: ok, the whole card is planned
    data = _recording()
    data["devices"][0].update(mig_mode=[0, 0], mig_devices=[])
    off = probe(FakeNvml(data))
    a100 = TorchDevice("NVIDIA A100-SXM4-80GB", CARD_BYTES, (8, 0))
    check = {c.name: c for c in doctor.run_checks(_facts(off, _torch(a100)))}["GPU 0 MIG"]
    assert check.status == "ok" and "whole card" in check.detail
    # Turned on, not yet in effect: warn, and say how to apply it
    data["devices"][0].update(mig_mode=[0, 1])
    pending = probe(FakeNvml(data))
    check = {c.name: c for c in doctor.run_checks(_facts(pending, _torch(a100)))}["GPU 0 MIG"]
    assert check.status == "warn" and "reset" in check.hint


def test_doctor_json_on_the_mig_card(monkeypatch, capsys) -> None:
    monkeypatch.setenv(FAKE_ENV, str(MIG_A100))
    monkeypatch.setattr(doctor, "torch_facts", lambda: _torch(A100_SLICE))
    monkeypatch.setattr(doctor, "bnb_facts", lambda want_cuda: BnbFacts("0.50.2", True, True))
    rc, out, _ = run_cli(capsys, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["GPU 0 MIG"]["status"] == "warn" and "-mig 0" in checks["GPU 0 MIG"]["hint"]
    assert checks["torch sees the cards"]["status"] == "ok"


def test_the_hardware_screen_card_says_mig() -> None:
    from homelab_dp.render.probe import gpu_card, mig_text

    (gpu,) = probe(load_recording(MIG_A100)).gpus
    assert "MIG    on, 2 slices" in gpu_card(gpu).plain
    assert mig_text(probe(load_recording(NVML / "1x4090.json")).gpus[0]) is None
    data = _recording()
    data["devices"][0].update(mig_mode=[0, 1], mig_devices=[])
    assert mig_text(probe(FakeNvml(data)).gpus[0]) == "MIG off, on after a reset"


def test_the_run_names_the_planned_slice_to_cuda(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    """The workers see exactly the planned MIG slice: CUDA_VISIBLE_DEVICES holds its MIG UUID
    (the card's GPU UUID would show CUDA no device while MIG is on)."""
    from homelab_dp.app.runs import Prepared
    from homelab_dp.runs.run_spec import Resolved
    from homelab_dp.supervise.launcher import worker_env

    planned = _plan(monkeypatch, MIG_A100)
    p = planned.plan
    resolved = Resolved(
        p.chosen.method, p.chosen.distribution, False, "cuda", 1, p.dtype, 1, 1, 1e-4
    )
    spec = Prepared(planned.preset, planned, resolved, 1).run_spec("r")
    assert spec.launch.gpu_indices == (0,) and spec.launch.gpu_uuids == (FREE_SLICE,)
    env = worker_env(spec)
    assert env["CUDA_VISIBLE_DEVICES"] == FREE_SLICE


def test_serve_puts_one_replica_on_each_slice(monkeypatch, in_repo: Path) -> None:
    """Replicas never talk to each other, so a MIG card serves one replica per slice, each
    named to CUDA by its MIG UUID and planned in the slice's memory (never the whole card's)."""
    from homelab_dp.app.serve import plan_serve

    monkeypatch.setenv(FAKE_ENV, str(MIG_A100))
    slices = probe().gpus[0].mig.slices
    planned = plan_serve("assets/models/tiny-llama")
    assert [r.cuda_visible for r in planned.replicas] == [s.uuid for s in slices]
    assert [d.memory_bytes for d in planned.plan.devices] == [s.memory_bytes for s in slices]
    assert all("MIG 3g.40gb" in r.label for r in planned.replicas)


def test_a_queued_run_waits_for_its_slice_not_the_whole_card(monkeypatch) -> None:
    """What is free for a run queued on a MIG slice is that slice's memory: another user holds
    20 GiB of slice 0 in the recording, so slice 0 has that much less free than slice 1."""
    from homelab_dp.runs.run_queue import free_memory

    monkeypatch.setenv(FAKE_ENV, str(MIG_A100))
    card = probe().gpus[0]
    first, second = card.mig.slices
    assert free_memory([0], (first.uuid,)) == {0: first.memory_free}
    assert free_memory([0], (second.uuid,)) == {0: second.memory_free}
    assert first.memory_free < second.memory_free < card.memory_free
    assert free_memory([0], ()) == {0: None}  # no slice of the run's on it: not known
