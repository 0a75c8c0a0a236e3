"""The NVML probe against recorded NVML answers, and once against the real pynvml."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from homelab_dp.errors import HomelabError
from homelab_dp.probe.fake_nvml import FAKE_ENV, FakeNvml, load_recording
from homelab_dp.probe.hardware import GpuInfo, GpuLink, HostInfo
from homelab_dp.probe.nvml import NvmlSession, host_info, probe, sample

NVML_DATA = Path(__file__).resolve().parents[2] / "data" / "nvml"
PROBE_LIVENESS_S = 2.5
"""Liveness guard on one real probe without a driver: it must not wait for one. Not a latency
target: the typical figure is 0.025 s, a hundredth of this (`python benchmarks/plan_latency.py`,
its last row)."""


def recording(name: str) -> dict:
    return json.loads((NVML_DATA / name).read_text())


def test_1x4090_probes_every_field() -> None:
    fake = load_recording(NVML_DATA / "1x4090.json")
    report = probe(fake)
    assert report.kind == "cuda"
    assert report.notice is None
    assert report.driver_version == "560.35.03"
    assert report.cuda_driver_version == "12.6"
    assert report.source == f"recording {NVML_DATA / '1x4090.json'}"
    assert report.gpus == (
        GpuInfo(
            index=0,
            name="NVIDIA GeForce RTX 4090",
            memory_total=25757220864,
            uuid="GPU-5f3c1a2e-8d4b-7c9e-a1f0-2b6d4e8c9a71",
            memory_free=25128075264,
            memory_used=629145600,
            utilization_pct=3,
            memory_utilization_pct=1,
            temperature_c=36,
            power_w=21.534,
            power_limit_w=450.0,
            energy_mj=918273645,
            pcie_gen=4,
            pcie_width=16,
            pcie_gen_max=4,
            pcie_width_max=16,
            pci_bus_id="00000000:01:00.0",
            compute_capability=(8, 9),
        ),
    )
    assert report.links == ()
    assert report.to_json()["gpus"][0]["compute_capability"] == (8, 9)  # [8, 9] in JSON
    assert report.host == HostInfo(
        cpu_model="AMD Ryzen 9 7950X 16-Core Processor",
        logical_cores=32,
        physical_cores=16,
        ram_total=66487697408,
        ram_available=58612461568,
    )
    # One init, one shutdown: the probe leaves NVML as it found it
    assert (fake.init_count, fake.shutdown_count) == (1, 1)
    json.dumps(report.to_json())  # the `probe --json` document is plain JSON


def test_2x3090_nvlink_pair_detected() -> None:
    report = probe(load_recording(NVML_DATA / "2x3090-nvlink.json"))
    assert report.kind == "cuda"
    assert [g.name for g in report.gpus] == ["NVIDIA GeForce RTX 3090"] * 2
    assert all(g.memory_total == 24576 * 1024**2 for g in report.gpus)
    assert all(g.power_limit_w == 350.0 for g in report.gpus)
    assert report.links == (
        GpuLink(a=0, b=1, kind="nvlink", nvlink_links=4, topology="same CPU", p2p=True),
    )


def test_nvlink_seen_only_through_p2p_status_still_counts() -> None:
    # e.g. an NVSwitch system: the remote end of each link is the switch, not the other GPU
    data = recording("2x3090-nvlink.json")
    for device in data["devices"]:
        device["nvlink"] = "NOT_SUPPORTED"
    (link,) = probe(FakeNvml(data)).links
    assert (link.kind, link.nvlink_links) == ("nvlink", 0)


def test_mixed_3090_3060_pcie_only_and_unsupported_energy() -> None:
    report = probe(load_recording(NVML_DATA / "3090+3060.json"))
    big, small = report.gpus
    assert (big.name, small.name) == ("NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3060")
    assert (big.memory_total, small.memory_total) == (24576 * 1024**2, 12288 * 1024**2)
    assert small.power_limit_w == 170.0
    # The card runs below its maximum link: gen 3 x8 in a gen 4 x16 capable card
    assert (small.pcie_gen, small.pcie_width) == (3, 8)
    assert (small.pcie_gen_max, small.pcie_width_max) == (4, 16)
    # "Not supported" became None, the rest of the card is still there
    assert small.energy_mj is None
    assert big.energy_mj == 2747105532
    assert big.compute_capability == small.compute_capability == (8, 6)
    assert report.links == (
        GpuLink(a=0, b=1, kind="pcie", nvlink_links=0, topology="host bridge", p2p=False),
    )
    assert report.notice is None


def test_every_field_not_supported_never_crashes() -> None:
    data = recording("3090+3060.json")
    data["devices"] = [{"pci_bus_id": d["pci_bus_id"]} for d in data["devices"]]
    data["pairs"] = {}
    del data["driver_version"]
    data["cuda_driver_version"] = "ERROR:UNKNOWN"
    report = probe(FakeNvml(data))
    assert report.kind == "cuda"
    assert [g.name for g in report.gpus] == ["GPU 0", "GPU 1"]
    gpu = report.gpus[0]
    assert gpu.uuid is gpu.temperature_c is gpu.power_w is gpu.energy_mj is gpu.pcie_gen is None
    assert gpu.compute_capability is None
    assert gpu.memory_total == 0
    assert "did not report its memory size" in report.notice
    assert report.driver_version is report.cuda_driver_version is None
    assert report.links == (GpuLink(a=0, b=1, kind="unknown", nvlink_links=0),)


def test_a_gpu_that_cannot_be_opened_is_left_out_with_a_warning() -> None:
    data = recording("3090+3060.json")
    data["devices"][1]["handle"] = "ERROR:GPU_IS_LOST"
    report = probe(FakeNvml(data))
    assert [g.index for g in report.gpus] == [0]
    assert report.links == ()
    assert "GPU 1 could not be opened" in report.notice


def test_no_driver_gives_the_cpu_host_and_a_hint() -> None:
    fake = load_recording(NVML_DATA / "no-driver.json")
    report = probe(fake)
    assert report.kind == "cpu"
    assert report.gpus == () and report.links == ()
    assert report.notice.startswith("No NVIDIA driver found")
    assert "--gpus 2x24GiB" in report.notice
    assert report.host.cpu_model == "Intel(R) Core(TM) i5-8500 CPU @ 3.00GHz"
    assert report.host.ram_total == 16647962624
    assert fake.shutdown_count == 0  # nothing to shut down when init failed


def test_driver_not_loaded_and_zero_gpus_are_cpu_reports() -> None:
    not_loaded = recording("no-driver.json") | {"error": "DriverNotLoaded"}
    report = probe(FakeNvml(not_loaded))
    assert report.kind == "cpu"
    assert "not loaded" in report.notice

    no_gpu = recording("1x4090.json") | {"devices": []}
    fake = FakeNvml(no_gpu)
    report = probe(fake)
    assert report.kind == "cpu"
    assert "reports no GPU" in report.notice
    assert fake.shutdown_count == 1


def test_sample_reads_each_gpu() -> None:
    fake = load_recording(NVML_DATA / "3090+3060.json")
    readings = sample(fake)
    assert readings[1] == {
        "index": 1,
        "utilization_pct": 0,
        "memory_utilization_pct": 0,
        "memory_used": 197132288,
        "memory_total": 12884901888,
        "temperature_c": 33,
        "power_w": 14.12,
        "energy_mj": None,
    }
    assert readings[0]["energy_mj"] == 2747105532
    assert [r["index"] for r in sample(fake, indices=[1])] == [1]
    assert sample(load_recording(NVML_DATA / "no-driver.json")) == []


def test_session_samples_without_reinitialising() -> None:
    fake = load_recording(NVML_DATA / "2x3090-nvlink.json")
    with NvmlSession(fake) as session:
        assert session.available
        first, second = session.sample(), session.sample([0, 7])
    assert len(first) == 2
    # An index that does not exist reads as unknown rather than failing the monitor
    assert second[1]["index"] == 7 and second[1]["power_w"] is None
    assert (fake.init_count, fake.shutdown_count) == (1, 1)
    # Sampling stays cheap: no topology or NVLink queries
    assert not any("P2P" in c or "NvLink" in c or "Topology" in c for c in fake.calls)


def test_env_var_selects_a_recording(monkeypatch: pytest.MonkeyPatch) -> None:
    path = NVML_DATA / "2x3090-nvlink.json"
    monkeypatch.setenv(FAKE_ENV, str(path))
    report = probe()
    assert report.source == f"recording {path}"
    assert [link.kind for link in report.links] == ["nvlink"]
    assert len(sample()) == 2
    assert host_info().cpu_model == "AMD Ryzen Threadripper 3960X 24-Core Processor"


def test_env_var_naming_a_missing_file_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(FAKE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(HomelabError) as caught:
        probe()
    assert "missing.json" in caught.value.message
    assert FAKE_ENV in caught.value.hint


def test_host_info_of_this_machine() -> None:
    host = host_info(FakeNvml({"error": "LibraryNotFound"}))  # no recorded host: the real one
    assert host.cpu_model
    assert host.logical_cores >= 1
    assert host.ram_total > 0
    assert host.ram_available is None or 0 < host.ram_available <= host.ram_total


def _nvml_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_real_pynvml_without_a_driver_answers_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(FAKE_ENV, raising=False)
    started = time.perf_counter()
    report = probe()
    elapsed = time.perf_counter() - started
    assert elapsed < PROBE_LIVENESS_S, f"{elapsed:.2f} s"  # liveness guard, not a latency target
    assert report.source == "nvml"
    if _nvml_library_present():  # a machine with a driver: it must find its GPUs or say why
        assert report.gpus or report.notice
        return
    assert report.kind == "cpu"
    assert report.notice.startswith("No NVIDIA driver found")
    assert report.host.logical_cores >= 1
    assert sample() == []


def test_importing_the_probe_does_not_import_pynvml() -> None:
    code = "import sys, homelab_dp.probe.nvml; print('pynvml' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"
