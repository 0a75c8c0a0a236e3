"""`homelab-dp doctor`: the checks over recorded facts (NVML recordings, torch as it would answer
on those machines), the command's JSON and exit codes, and this machine as it is."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from homelab_dp.app import doctor
from homelab_dp.app.doctor import Check, install_hint, wheel_tag
from homelab_dp.byte_units import GiB
from homelab_dp.probe.fake_nvml import load_recording
from homelab_dp.probe.hardware import HardwareReport
from homelab_dp.probe.machine_facts import BnbFacts, DiskFacts, Facts, TorchDevice, TorchFacts
from homelab_dp.probe.nvml import probe
from homelab_dp.render.doctor import checks_panel, render_doctor, summary
from tests.conftest import DATA, run_cli

NVML = DATA / "nvml"
GPU_CHECKS = (
    "nvml driver",
    "torch build",
    "torch sees the cards",
    "compute capability",
    "nccl",
    "peer-to-peer",
    "bitsandbytes",
    "state-space kernels",
)
HOST_CHECKS = ("disk", "host RAM", "/dev/shm", "open files")
CPU_TORCH = TorchFacts("2.13.0+cpu")
BNB_OK = BnbFacts("0.50.2", imported=True, cuda_kernels=True)


def recorded(name: str) -> HardwareReport:
    return probe(load_recording(NVML / f"{name}.json"))


def cuda_torch(*devices: TorchDevice, cuda: str = "12.6", **kw) -> TorchFacts:
    """torch as a CUDA build answers on a machine where CUDA starts."""
    return TorchFacts("2.13.0+cu" + cuda.replace(".", ""), cuda=cuda, cuda_available=True,
                      devices=devices, nccl=True, **kw)  # fmt: skip


def facts(report: HardwareReport, torch: TorchFacts, bnb: BnbFacts = BNB_OK, **kw) -> Facts:
    """A healthy host (disk, shm, open files) unless ``kw`` says otherwise."""
    host = {
        "disk": DiskFacts("/srv/runs", 500 * GiB, 2000 * GiB),
        "shm_bytes": 16 * GiB,
        "nofile": (1048576, 1048576),
    }
    return Facts(report, torch, bnb, **{**host, **kw})


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def statuses(checks: list[Check]) -> dict[str, str]:
    return {c.name: c.status for c in checks}


# ---------------------------------------------------------------------- recorded machines
RTX_2080TI = TorchDevice("NVIDIA GeForce RTX 2080 Ti", 11_552_096_256, (7, 5))
A6000 = TorchDevice("NVIDIA RTX A6000", 51_039_567_872, (8, 6))
P40 = TorchDevice("Tesla P40", 25_637_748_736, (6, 1))
RTX_3090 = TorchDevice("NVIDIA GeForce RTX 3090", 25_447_170_048, (8, 6))


def test_turing_pair_trains_in_fp16_and_warns_about_peer_to_peer() -> None:
    report = recorded("2x2080ti")
    checks = doctor.run_checks(facts(report, cuda_torch(RTX_2080TI, RTX_2080TI)))
    assert statuses(checks) == {
        "nvml driver": "ok",
        "torch build": "ok",
        "torch sees the cards": "ok",
        "GPU 0 compute": "warn",
        "GPU 1 compute": "warn",
        "nccl": "ok",
        "GPU 0↔1 link": "warn",
        "bitsandbytes": "ok",
        "state-space kernels": "ok",
        "disk": "ok",
        "host RAM": "ok",
        "/dev/shm": "ok",
        "open files": "ok",
    }
    found = by_name(checks)
    assert found["nvml driver"].detail == "driver 535.183.01, CUDA 12.2, 2 GPUs"
    assert found["GPU 0 compute"].detail == (
        "RTX 2080 Ti: compute capability 7.5, no bf16 (needs 8.0): fp16 will be used"
    )
    # torch built for CUDA 12.6 on a CUDA 12.2 driver: minor-version compatibility
    assert "minor-version compatibility" in found["torch build"].detail
    link = found["GPU 0↔1 link"]
    assert "no peer-to-peer (host bridge)" in link.detail
    assert "GeForce" in link.detail
    assert "NCCL_P2P_DISABLE=1" in link.hint
    assert not doctor.failed(checks)


def test_ampere_pair_on_nvlink_is_all_ok() -> None:
    report = recorded("2xa6000-nvlink")
    checks = doctor.run_checks(facts(report, cuda_torch(A6000, A6000, cuda="12.4")))
    assert {c.status for c in checks} == {"ok"}
    found = by_name(checks)
    assert found["GPU 0↔1 link"].detail == "NVLink ×4 (same CPU)"
    assert found["GPU 1 compute"].detail == "RTX A6000: compute capability 8.6, bf16 supported"
    assert found["torch sees the cards"].detail == "2 GPUs: RTX A6000, RTX A6000"
    assert summary(checks) == "13 ok: ready"


def test_mixed_pair_fp16_for_both_and_torch_numbering_fastest_first_is_still_the_same_cards() -> (
    None
):
    report = recorded("p40+3090")
    # CUDA's default order puts the 3090 first; NVML's bus order puts the P40 first
    checks = doctor.run_checks(facts(report, cuda_torch(RTX_3090, P40, cuda="12.4")))
    found = by_name(checks)
    assert found["torch sees the cards"].status == "ok"
    assert found["GPU 0 compute"].status == "warn"
    assert found["GPU 0 compute"].detail.startswith("Tesla P40: compute capability 6.1, no bf16")
    assert found["GPU 1 compute"].status == "ok"
    assert found["GPU 1 compute"].detail == (
        "RTX 3090: compute capability 8.6, bf16 supported; with GPU 0 in the run, fp16"
    )
    assert found["GPU 0↔1 link"].status == "warn"
    assert not doctor.failed(checks)


def test_cpu_only_torch_on_a_gpu_box_fails_with_the_cuda_build_to_install() -> None:
    report = recorded("2x3090-nvlink")
    checks = doctor.run_checks(facts(report, CPU_TORCH, BnbFacts("0.50.2", imported=True)))
    found = by_name(checks)
    build = found["torch build"]
    assert build.status == "fail"
    assert (
        build.detail == "the installed torch 2.13.0+cpu is a CPU-only build: it cannot use the GPUs"
    )
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu126" in build.hint
    assert "pip uninstall -y torch" in build.hint  # else pip keeps the CPU build it has
    assert "the driver supports CUDA 12.4" in build.hint
    # what depends on a working CUDA torch is not checked twice
    for name in ("torch sees the cards", "nccl", "bitsandbytes"):
        assert found[name].status == "skip", name
    assert found["GPU 0↔1 link"].status == "ok"  # from NVML alone
    assert doctor.failed(checks)
    assert summary(checks).startswith("1 fail · ")


def test_no_gpu_every_gpu_check_skips_and_says_why() -> None:
    report = recorded("no-driver")
    checks = doctor.run_checks(facts(report, CPU_TORCH, BnbFacts("0.50.2", imported=True)))
    assert [c.name for c in checks] == [*GPU_CHECKS, *HOST_CHECKS]
    for c in checks[: len(GPU_CHECKS)]:
        assert c.status == "skip", c
    assert checks[0].detail.startswith("No NVIDIA driver found")
    assert "Install the NVIDIA driver" in checks[0].hint
    for c in checks[2 : len(GPU_CHECKS)]:
        assert c.detail.startswith("no GPU: no NVIDIA driver found"), c
    assert "torch 2.13.0+cpu is a CPU build" in checks[1].detail
    assert checks[-1].status == "ok"
    assert "bitsandbytes 0.50.2 imports" in by_name(checks)["bitsandbytes"].detail
    assert not doctor.failed(checks)


# ---------------------------------------------------------------------- torch against the driver
def test_torch_built_for_a_newer_cuda_major_than_the_driver() -> None:
    report = recorded("2xa6000-nvlink")  # driver 550: CUDA 12.4
    torch = TorchFacts(
        "2.13.0+cu130",
        cuda="13.0",
        nccl=True,
        error="The NVIDIA driver on your system is too old (found version 12040).",
    )
    build = by_name(doctor.run_checks(facts(report, torch)))["torch build"]
    assert build.status == "fail"
    assert "cannot start CUDA: The NVIDIA driver on your system is too old" in build.detail
    assert "update the driver (CUDA 13 needs 580 or newer)" in build.hint
    assert "whl/cu126" in build.hint


@pytest.mark.parametrize(
    ("driver", "said"),
    [
        ("11.4", "the driver supports CUDA 11.4, older than any current torch build"),
        (None, "`nvidia-smi` shows its CUDA version"),
    ],
)
def test_install_hint_for_an_old_or_unknown_driver(driver: str | None, said: str) -> None:
    report = replace(recorded("2x2080ti"), cuda_driver_version=driver)
    assert said in install_hint(report, CPU_TORCH)


def test_torch_that_sees_fewer_cards_names_both_lists() -> None:
    report = recorded("2xa6000-nvlink")
    check = by_name(doctor.run_checks(facts(report, cuda_torch(A6000))))["torch sees the cards"]
    assert check.status == "fail"
    assert check.detail == "torch sees 1 GPU (RTX A6000) but NVML lists 2 (RTX A6000, RTX A6000)"
    assert "`nvidia-smi` and torch should list the same cards" in check.hint
    assert "CUDA_VISIBLE_DEVICES" not in check.hint


def test_cuda_visible_devices_read_fastest_first_picks_another_card(monkeypatch) -> None:
    """CUDA_VISIBLE_DEVICES=0 on the P40 + 3090: the probe reads 0 in bus order (the P40),
    torch in CUDA's default order, fastest first (the 3090)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    report = recorded("p40+3090")
    assert [g.name for g in report.gpus] == ["Tesla P40"]
    torch = cuda_torch(RTX_3090, cuda="12.4", visible_devices="0")
    check = by_name(doctor.run_checks(facts(report, torch)))["torch sees the cards"]
    assert check.status == "fail"
    assert check.detail == "torch sees 1 GPU (RTX 3090) but NVML lists 1 (Tesla P40)"
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in check.hint


def test_memory_far_from_nvml_warns() -> None:
    report = recorded("2xa6000-nvlink")
    slice_ = replace(A6000, memory_total=24 * GiB)  # a MIG or vGPU slice
    check = by_name(doctor.run_checks(facts(report, cuda_torch(A6000, slice_))))
    assert check["torch sees the cards"].status == "warn"
    assert "GPU 1: torch 24.0 GiB, NVML 48.0 GiB" in check["torch sees the cards"].detail


def test_no_nccl_fails() -> None:
    report = recorded("2xa6000-nvlink")
    torch = replace(cuda_torch(A6000, A6000), nccl=False)
    assert by_name(doctor.run_checks(facts(report, torch)))["nccl"].status == "fail"


@pytest.mark.parametrize(
    ("bnb", "status", "said"),
    [
        (BnbFacts(None), "fail", "not installed"),
        (BnbFacts("0.50.2", error="OSError: libcudart.so.12"), "fail", "does not import"),
        (BnbFacts("0.50.2", imported=True, error="no CUDA binary"), "fail", "did not load"),
        (BNB_OK, "ok", "CUDA kernels loaded"),
    ],
)
def test_bitsandbytes_on_a_gpu_box(bnb: BnbFacts, status: str, said: str) -> None:
    report = recorded("2xa6000-nvlink")
    check = by_name(doctor.run_checks(facts(report, cuda_torch(A6000, A6000), bnb)))
    assert check["bitsandbytes"].status == status
    assert said in check["bitsandbytes"].detail


@pytest.mark.parametrize(
    ("driver", "caps", "tag"),
    [
        ("12.4", [(8, 6)], "cu126"),
        ("12.2", [(7, 5), (7, 5)], "cu126"),
        ("12.4", [(6, 1), (8, 6)], "cu126"),
        ("12.8", [(12, 0)], "cu128"),  # Blackwell needs a cu128 build
        ("13.0", [(8, 9)], "cu130"),
        ("13.0", [(6, 1)], "cu126"),  # CUDA 13 builds have no Pascal kernels
        ("11.8", [(7, 5)], "cu118"),
        ("11.4", [(7, 5)], None),
        (None, [], None),
    ],
)
def test_wheel_for_the_driver(driver: str | None, caps: list, tag: str | None) -> None:
    assert wheel_tag(driver, caps) == tag


# ---------------------------------------------------------------------- the host
@pytest.mark.parametrize(
    ("free", "status"), [(100 * GiB, "ok"), (10 * GiB, "warn"), (1 * GiB, "fail")]
)
def test_disk_thresholds(free: int, status: str) -> None:
    f = facts(recorded("no-driver"), CPU_TORCH, disk=DiskFacts("/r/runs", free, 200 * GiB))
    check = doctor.check_disk(f)
    assert check.status == status
    assert check.detail.endswith("for /r/runs")
    assert bool(check.hint) == (status != "ok")


@pytest.mark.parametrize(("size", "status"), [(64 * 1024**2, "warn"), (8 * GiB, "ok")])
def test_shm_under_a_gib_warns_with_the_docker_flag(size: int, status: str) -> None:
    check = doctor.check_shm(facts(recorded("no-driver"), CPU_TORCH, shm_bytes=size))
    assert check.status == status
    if status == "warn":
        assert check.detail.startswith("64.0 MiB")
        assert "--shm-size" in check.hint


@pytest.mark.parametrize(
    ("nofile", "status", "hint"),
    [((1024, 4096), "warn", "ulimit -n 4096"), ((1024, -1), "warn", "ulimit -n 65536"),
     ((65536, 65536), "ok", ""), ((-1, -1), "ok", "")],
)  # fmt: skip
def test_open_file_limit(nofile: tuple[int, int], status: str, hint: str) -> None:
    check = doctor.check_nofile(facts(recorded("no-driver"), CPU_TORCH, nofile=nofile))
    assert (check.status, check.hint.removeprefix("raise it before running: ")) == (status, hint)


def test_little_ram_available_warns() -> None:
    report = recorded("no-driver")
    low = replace(report, host=replace(report.host, ram_available=2 * GiB))
    assert doctor.check_ram(facts(low, CPU_TORCH)).status == "warn"
    assert doctor.check_ram(facts(report, CPU_TORCH)).status == "ok"


# ---------------------------------------------------------------------- rendering
def test_the_table_and_the_panel_show_every_check_and_hint() -> None:
    checks = doctor.run_checks(facts(recorded("2x2080ti"), CPU_TORCH))
    from rich.console import Console

    def shown(renderable) -> str:
        console = Console(width=400, record=True)
        console.print(renderable)
        return console.export_text()

    for text in (shown(render_doctor(checks)), shown(checks_panel(checks))):
        for c in checks:
            assert c.name in text and c.detail in text
            if c.hint:
                assert f"→ {c.hint}" in text
        assert summary(checks) in text


# ---------------------------------------------------------------------- the command
@pytest.fixture
def gpu_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 3090 pair, as NVML and bitsandbytes would answer; torch as each test says."""
    monkeypatch.setenv("HOMELAB_DP_FAKE_NVML", str(NVML / "2x3090-nvlink.json"))
    monkeypatch.setattr(doctor, "bnb_facts", lambda want_cuda: BNB_OK)


@pytest.mark.usefixtures("gpu_box")
def test_doctor_json_exits_1_when_torch_is_the_cpu_build(monkeypatch, capsys) -> None:
    monkeypatch.setattr(doctor, "torch_facts", lambda: CPU_TORCH)
    rc, out, _ = run_cli(capsys, "doctor", "--json")
    assert rc == 1
    doc = json.loads(out)
    assert list(doc) == ["checks"]
    assert all(set(c) == {"name", "status", "detail", "hint"} for c in doc["checks"])
    assert {c["name"]: c["status"] for c in doc["checks"]}["torch build"] == "fail"


@pytest.mark.usefixtures("gpu_box")
def test_doctor_exits_0_when_nothing_fails(monkeypatch, capsys) -> None:
    monkeypatch.setattr(doctor, "torch_facts", lambda: cuda_torch(RTX_3090, RTX_3090))
    rc, out, err = run_cli(capsys, "doctor")
    assert rc == 0, out
    assert "homelab-dp doctor" in out and "torch sees the cards" in out
    assert err == ""


def test_doctor_refuses_bad_arguments(capsys) -> None:
    rc, out, err = run_cli(capsys, "doctor", "--jsn")
    assert rc == 2
    assert out == ""
    assert err.splitlines()[0].startswith("error: ")
    assert err.splitlines()[-1].startswith("hint: ")


def test_this_machine_without_a_gpu(monkeypatch, capsys) -> None:
    """Real torch, bitsandbytes, disk and limits; NVML as on a machine without a driver."""
    monkeypatch.setenv("HOMELAB_DP_FAKE_NVML", str(NVML / "no-driver.json"))
    rc, out, _ = run_cli(capsys, "doctor", "--json")
    checks = json.loads(out)["checks"]
    assert rc == 0
    assert [c["name"] for c in checks] == [*GPU_CHECKS, *HOST_CHECKS]
    assert {c["status"] for c in checks[: len(GPU_CHECKS)]} == {"skip"}
    assert all(c["status"] != "fail" for c in checks)


def test_torch_is_asked_in_a_child_so_the_front_end_never_holds_cuda() -> None:
    """The TUI and the CLI stay up while a run trains: asking torch in-process would initialise
    CUDA there and hold a context's memory on every card."""
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from homelab_dp.app import doctor\n"
        "f = doctor.gather()\n"
        "print(json.dumps([f.torch.version is not None, 'torch' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [True, False]


def test_state_space_kernels_say_which_are_missing_and_how_much_slower() -> None:
    """On a GPU machine without flash-linear-attention and mamba-ssm, doctor says that hybrid
    models' layers run the reference path and how much slower, without failing the machine."""
    report = recorded("2x2080ti")
    torch = cuda_torch(RTX_2080TI, RTX_2080TI)
    none = by_name(doctor.run_checks(replace(facts(report, torch), kernels=frozenset())))
    check = none["state-space kernels"]
    assert check.status == "ok" and "not installed" in check.detail
    assert "linear attention about 8x" in check.detail and "mamba2 about 10x" in check.detail
    assert "homelab-dp[kernels]" in check.hint
    every = frozenset({"fla", "mamba_ssm", "causal_conv1d"})
    full = by_name(doctor.run_checks(replace(facts(report, torch), kernels=every)))
    assert (
        "installed" in full["state-space kernels"].detail and not full["state-space kernels"].hint
    )
