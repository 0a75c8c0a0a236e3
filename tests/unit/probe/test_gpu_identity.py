"""GPU readiness: which cards (CUDA_VISIBLE_DEVICES, UUIDs, PCI bus order), what they compute in
(compute capability -> bf16 or fp16), on recorded NVML answers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from homelab_dp.app.plan import make_plan
from homelab_dp.app.runs import Prepared
from homelab_dp.errors import HardwareSpecError, PresetError
from homelab_dp.presets.preset_store import open_preset
from homelab_dp.probe.fake_nvml import FAKE_ENV, load_recording
from homelab_dp.probe.hardware import GpuLink
from homelab_dp.probe.nvml import probe
from homelab_dp.probe.visible_gpus import cuda_device_env, visibility
from homelab_dp.runs.run_spec import Launch, Rendezvous, Resolved, RunSpec
from homelab_dp.supervise.launcher import worker_env
from tests.conftest import DATA

NVML = DATA / "nvml"
RECORDINGS = sorted(p.name for p in NVML.glob("*.json"))
UUID_2080TI = (
    "GPU-cc7d1c37-5a10-4cb6-aa10-4799eb04ec9c",
    "GPU-08cf169d-b781-4c75-a5c2-f615877b8361",
)
UUID_P40 = "GPU-9878e0e8-9077-43d2-a814-e0e5dd998c9c"
UUID_3090 = "GPU-cfa3be33-503e-45f8-ad7f-95fb9d03649e"


@pytest.fixture(autouse=True)
def _no_visibility_from_the_test_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recordings describe other machines: this one's CUDA variables must not apply."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


def _recorded(monkeypatch: pytest.MonkeyPatch, name: str, visible: str | None = None) -> None:
    monkeypatch.setenv(FAKE_ENV, str(NVML / name))
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def _plan(monkeypatch: pytest.MonkeyPatch, recording: str, *overrides: str, visible=None):
    _recorded(monkeypatch, recording, visible)
    preset = open_preset("tiny-demo", ["hardware.devices=auto", *overrides])
    return make_plan(preset)


# -- the recordings -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in RECORDINGS if n != "no-driver.json"])
def test_every_recorded_card_has_a_compute_capability(name: str) -> None:
    recording = json.loads((NVML / name).read_text())
    assert all(len(d["compute_capability"]) == 2 for d in recording["devices"])
    report = probe(load_recording(NVML / name))
    assert all(g.compute_capability for g in report.gpus)
    document = json.loads(json.dumps(report.to_json()))  # what `probe --json` prints
    assert all(isinstance(g["compute_capability"], list) for g in document["gpus"])
    assert document["visible_devices"] is None and document["hidden_gpus"] == []


def test_turing_pair_without_a_bridge_or_peer_to_peer() -> None:
    report = probe(load_recording(NVML / "2x2080ti.json"))
    assert [g.name for g in report.gpus] == ["NVIDIA GeForce RTX 2080 Ti"] * 2
    assert [g.compute_capability for g in report.gpus] == [(7, 5), (7, 5)]
    assert [g.uuid for g in report.gpus] == list(UUID_2080TI)
    assert all(g.memory_total == 11264 * 1024**2 for g in report.gpus)
    assert all((g.pcie_gen, g.pcie_width) == (3, 8) for g in report.gpus)
    # The NVLink ports exist but no bridge joins them: down links count for nothing
    assert report.links == (
        GpuLink(a=0, b=1, kind="pcie", nvlink_links=0, topology="host bridge", p2p=False),
    )
    assert report.notice is None


def test_ampere_workstation_pair_with_nvlink() -> None:
    report = probe(load_recording(NVML / "2xa6000-nvlink.json"))
    assert [g.name for g in report.gpus] == ["NVIDIA RTX A6000"] * 2
    assert [g.compute_capability for g in report.gpus] == [(8, 6), (8, 6)]
    assert all(g.memory_total == 49140 * 1024**2 for g in report.gpus)
    assert report.links == (
        GpuLink(a=0, b=1, kind="nvlink", nvlink_links=4, topology="same CPU", p2p=True),
    )


def test_mixed_architectures_numbered_by_pci_bus() -> None:
    report = probe(load_recording(NVML / "p40+3090.json"))
    p40, rtx = report.gpus
    # NVML numbers by PCI bus: the slow card on bus 01 is GPU 0 (CUDA would count it second)
    assert (p40.index, p40.name, p40.pci_bus_id) == (0, "Tesla P40", "00000000:01:00.0")
    assert (rtx.index, rtx.name, rtx.pci_bus_id) == (
        1,
        "NVIDIA GeForce RTX 3090",
        "00000000:02:00.0",
    )
    assert (p40.compute_capability, rtx.compute_capability) == ((6, 1), (8, 6))
    assert p40.energy_mj is None and rtx.energy_mj == 4418820911  # Pascal has no energy counter
    assert report.links[0].kind == "pcie" and report.links[0].p2p is False


# -- dtype from the probed cards ------------------------------------------------------------------


def test_turing_plans_fp16_with_loss_scaling(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    planned = _plan(monkeypatch, "2x2080ti.json")
    p = planned.plan
    assert p.dtype == "fp16" and p.chosen.distribution in ("ddp", "zero1")
    assert (
        "fp16 with loss scaling: NVIDIA GeForce RTX 2080 Ti is compute capability 7.5, which has "
        "no bf16." in p.reasons
    )
    j = p.to_json()
    assert j["training"]["dtype"] == "fp16"
    assert [d["compute_capability"] for d in j["hardware"]["devices"]] == [[7, 5], [7, 5]]


def test_ampere_plans_bf16(monkeypatch: pytest.MonkeyPatch, in_repo: Path) -> None:
    p = _plan(monkeypatch, "2xa6000-nvlink.json").plan
    assert p.dtype == "bf16"
    assert "bf16: every card is compute capability >= 8.0." in p.reasons


def test_one_pascal_card_makes_the_pair_fp16_and_is_named(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    p = _plan(monkeypatch, "p40+3090.json").plan
    assert p.dtype == "fp16"
    assert (
        "fp16 with loss scaling: GPU 0 (Tesla P40) is compute capability 6.1, which has no bf16."
        in p.reasons
    )


def test_bf16_pinned_on_turing_is_refused_with_a_hint(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    with pytest.raises(PresetError) as err:
        _plan(monkeypatch, "2x2080ti.json", "model.dtype=bf16")
    message = err.value.message
    assert message.startswith("model.dtype = 'bf16':") and err.value.exit_code == 2
    assert "GPU 0 (NVIDIA GeForce RTX 2080 Ti)" in message and "7.5" in message
    assert '"auto"' in err.value.hint and '"fp16"' in err.value.hint
    # Hide the Pascal card and bf16 is fine on the 3090 that is left
    p = _plan(monkeypatch, "p40+3090.json", "model.dtype=bf16", visible="1").plan
    assert p.dtype == "bf16" and [d.name for d in p.hardware.devices] == ["NVIDIA GeForce RTX 3090"]


# -- CUDA_VISIBLE_DEVICES -------------------------------------------------------------------------

UUIDS = {0: UUID_P40, 1: UUID_3090}
NAMES = {0: "Tesla P40", 1: "NVIDIA GeForce RTX 3090"}


def _visible(value: str | None, **env: str):
    if value is not None:
        env["CUDA_VISIBLE_DEVICES"] = value
    return visibility(env, 2, UUIDS, NAMES)


@pytest.mark.parametrize(
    ("value", "indices"),
    [
        ("0", (0,)),
        ("1", (1,)),
        ("1,0", (0, 1)),  # the order is CUDA's business; homelab-dp numbers by NVML index
        (" 1 ", (1,)),
        ("0,-1,1", (0,)),  # reading stops at the first entry that names no GPU
        ("1,7", (1,)),
        ("-1", ()),
        ("", ()),
        ("0,0", ()),  # a GPU named twice: CUDA refuses the list
        ("x", ()),
        (UUID_3090, (1,)),
        ("GPU-cfa3", (1,)),  # a unique prefix is enough
        (f"{UUID_3090},{UUID_P40}", (0, 1)),
        ("GPU-", ()),  # a prefix of both: ambiguous
        (f"GPU-cfa3,{UUID_3090}", ()),  # the same card twice
        ("GPU-cfa3,0", (1,)),  # one form per list
        ("GPU-ffff", ()),
    ],
)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(value: str, indices: tuple) -> None:
    seen = _visible(value)
    assert seen.value == value and seen.indices == indices
    assert (seen.notice is None) == (indices == (0, 1))


def test_unset_or_mig_leaves_every_card() -> None:
    assert _visible(None).indices is None and _visible(None).notice is None
    mig = _visible("MIG-4a2f")
    assert mig.indices is None and "not applied" in mig.notice


def test_the_notice_says_what_is_hidden_and_how_numbers_are_read() -> None:
    notice = _visible("1").notice
    assert (
        "hides GPU 0 (Tesla P40)" in notice and "use GPU 1 (NVIDIA GeForce RTX 3090) only" in notice
    )
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in notice  # mixed cards, CUDA counts fastest first
    assert "CUDA_DEVICE_ORDER" not in _visible("1", CUDA_DEVICE_ORDER="PCI_BUS_ID").notice
    assert "CUDA_DEVICE_ORDER" not in _visible("GPU-cfa3").notice  # a UUID has no order
    same = visibility({"CUDA_VISIBLE_DEVICES": "1"}, 2, {}, {0: "A", 1: "A"})
    assert "CUDA_DEVICE_ORDER" not in same.notice  # identical cards: both orders agree
    assert "stops reading it at '7'" in _visible("1,7").notice
    assert "twice" in _visible("0,0").notice


def test_the_probe_keeps_only_the_visible_cards(monkeypatch: pytest.MonkeyPatch) -> None:
    _recorded(monkeypatch, "p40+3090.json", visible="GPU-cfa3")
    report = probe()
    assert [(g.index, g.name) for g in report.gpus] == [(1, "NVIDIA GeForce RTX 3090")]
    assert report.links == ()  # no pair left
    assert report.visible_devices == "GPU-cfa3" and report.hidden_gpus == (0,)
    assert "hides GPU 0 (Tesla P40)" in report.notice
    document = report.to_json()
    assert document["visible_devices"] == "GPU-cfa3" and list(document["hidden_gpus"]) == [0]


def test_hiding_every_card_plans_for_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _recorded(monkeypatch, "2x3090-nvlink.json", visible="")
    report = probe()
    assert report.kind == "cpu" and report.gpus == () and report.hidden_gpus == (0, 1)
    assert "hides every GPU" in report.notice and "CPU host" in report.notice


def test_a_hidden_card_that_cannot_be_opened_is_not_warned_about(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = json.loads((NVML / "p40+3090.json").read_text())
    data["devices"][0]["handle"] = "ERROR:GPU_IS_LOST"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    from homelab_dp.probe.fake_nvml import FakeNvml

    report = probe(FakeNvml(data))
    assert [g.index for g in report.gpus] == [1]
    assert "could not be opened" not in report.notice


def test_the_plan_uses_the_visible_cards_by_nvml_index(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    planned = _plan(monkeypatch, "p40+3090.json", visible="1")
    hw = planned.hardware
    assert hw.indices == (1,) and hw.uuids == (UUID_3090,)
    assert planned.plan.dtype == "bf16"  # the P40 is hidden, so it does not decide the dtype
    # hardware.devices names NVML indices, as `probe` shows them; a hidden one is an error
    chosen = _plan(monkeypatch, "p40+3090.json", "hardware.devices=[1]", visible="1")
    assert chosen.hardware.indices == (1,)
    with pytest.raises(HardwareSpecError) as err:
        _plan(monkeypatch, "p40+3090.json", "hardware.devices=[0,1]", visible="1")
    assert "GPU [0] hidden by CUDA_VISIBLE_DEVICES='1'" in err.value.message
    assert "unset CUDA_VISIBLE_DEVICES" in err.value.hint


def test_every_card_hidden_and_devices_named_is_an_error(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    with pytest.raises(HardwareSpecError) as err:
        _plan(monkeypatch, "2x3090-nvlink.json", "hardware.devices=[0]", visible="-1")
    assert "no GPU was found" in err.value.message and "hides every GPU" in err.value.hint


# -- the run sees exactly the planned cards -------------------------------------------------------


def _spec(launch: Launch) -> RunSpec:
    preset = open_preset("tiny-demo", ["hardware.devices=auto"])
    resolved = Resolved("full", "ddp", False, "cuda", 2, "fp16", 1, 1, 1e-4)
    return RunSpec("r", preset, resolved, launch)


def test_the_run_names_the_planned_cards_by_uuid_in_pci_bus_order(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    planned = _plan(monkeypatch, "p40+3090.json")
    p = planned.plan
    resolved = Resolved(
        p.chosen.method, p.chosen.distribution, False, "cuda", 2, p.dtype, 1, 1, 1e-4
    )
    spec = Prepared(planned.preset, planned, resolved, 1).run_spec("r")
    assert spec.launch.gpu_indices == (0, 1)
    assert spec.launch.gpu_uuids == (UUID_P40, UUID_3090)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the user's own, overwritten with the same
    env = worker_env(spec)
    assert env["CUDA_VISIBLE_DEVICES"] == f"{UUID_P40},{UUID_3090}"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # Through spec.json and back: the UUIDs stay; a spec written before them reads as none
    document = spec.to_json()
    assert RunSpec.from_json(document).launch.gpu_uuids == (UUID_P40, UUID_3090)
    del document["gpu_uuids"]
    assert RunSpec.from_json(document).launch.gpu_uuids == ()


def test_a_user_restriction_survives_into_the_run(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    planned = _plan(monkeypatch, "2x2080ti.json", visible="1")
    p = planned.plan
    resolved = Resolved("full", "ddp", False, "cuda", 1, p.dtype, 1, 1, 1e-4)
    env = worker_env(Prepared(planned.preset, planned, resolved, 1).run_spec("r"))
    assert env["CUDA_VISIBLE_DEVICES"] == UUID_2080TI[1]


def test_without_uuids_or_on_several_nodes_the_run_names_nvml_indices(in_repo: Path) -> None:
    old = worker_env(_spec(Launch(2, gpu_indices=(0, 1))))
    assert old["CUDA_VISIBLE_DEVICES"] == "0,1" and old["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    nodes = Launch(
        2, gpu_indices=(0, 1), rendezvous=Rendezvous(2, 1, "10.0.0.1", 29500), gpu_uuids=UUID_2080TI
    )
    assert worker_env(_spec(nodes))["CUDA_VISIBLE_DEVICES"] == "0,1"
    partial = Launch(2, gpu_indices=(0, 1), gpu_uuids=UUID_2080TI[:1])
    assert worker_env(_spec(partial))["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_a_cpu_run_leaves_the_cuda_variables_alone(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    spec = _spec(Launch(2))
    spec = replace(spec, resolved=replace(spec.resolved, device="cpu", dtype="fp32"))
    env = worker_env(spec)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and "CUDA_DEVICE_ORDER" not in env


def test_the_probe_table_names_each_cards_capability_and_precision() -> None:
    from homelab_dp.probe.hardware import GpuInfo
    from homelab_dp.render.probe import compute_text

    assert (
        compute_text(GpuInfo(0, "RTX 2080 Ti", 11 * 2**30, compute_capability=(7, 5))) == "7.5 fp16"
    )
    assert compute_text(GpuInfo(1, "RTX 3090", 24 * 2**30, compute_capability=(8, 6))) == "8.6 bf16"
    assert compute_text(GpuInfo(2, "unknown", 24 * 2**30)) == "n/a"


def test_every_cuda_child_gets_cards_in_pci_bus_order() -> None:
    """One rule for every child that may touch CUDA: an NVML index or UUID in
    CUDA_VISIBLE_DEVICES always goes with CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA's default order,
    fastest first, would give index 0 to the other card of a mixed pair)."""

    env = cuda_device_env({"PATH": "/bin"}, ["1"])
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert cuda_device_env({}, ["GPU-a", "GPU-b"])["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    hidden = cuda_device_env({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, [])
    assert hidden["CUDA_VISIBLE_DEVICES"] == "" and hidden["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # None keeps the user's own list, now read in PCI bus order as the probe read it.
    kept = cuda_device_env({"CUDA_VISIBLE_DEVICES": "0"}, None)
    assert kept == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert cuda_device_env({"HOME": "/h"}, None) == {"HOME": "/h"}
