"""The preflight's CUDA cross-check: a plan on probed GPUs starts only when the installed torch
sees those cards. torch is stood in for at its one boundary, `doctor.torch_facts`; NVML answers
from a recording with GPUs."""

from __future__ import annotations

import pytest

from homelab_dp.app import doctor
from homelab_dp.app.runs import make_controller
from homelab_dp.cli import main
from homelab_dp.errors import HomelabError
from homelab_dp.probe.machine_facts import TorchDevice, TorchFacts
from tests.conftest import DATA

ON_GPUS = ["hardware.devices=auto"]  # tiny-demo on the probed cards instead of the CPU
RTX_3090 = TorchDevice("NVIDIA GeForce RTX 3090", 25_447_170_048, (8, 6))
CUDA_TORCH = TorchFacts(
    "2.13.0+cu126", cuda="12.6", cuda_available=True, devices=(RTX_3090, RTX_3090), nccl=True
)


@pytest.fixture
def two_3090(in_repo, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOMELAB_DP_FAKE_NVML", str(DATA / "nvml" / "2x3090-nvlink.json"))


def torch_is(monkeypatch: pytest.MonkeyPatch, facts: TorchFacts) -> None:
    monkeypatch.setattr(doctor, "torch_facts", lambda: facts)


@pytest.mark.usefixtures("two_3090")
def test_cpu_build_of_torch_refuses_a_gpu_plan_with_the_install_command(monkeypatch) -> None:
    torch_is(monkeypatch, TorchFacts("2.13.0+cpu"))
    with pytest.raises(HomelabError) as caught:
        make_controller().prepare("tiny-demo", overrides=ON_GPUS)
    err = caught.value
    assert err.exit_code == 2
    assert err.message == (
        "the plan uses GPUs 0, 1: the installed torch 2.13.0+cpu is a CPU-only build: it "
        "cannot use the GPUs; NVML lists 2 (RTX 3090, RTX 3090)"
    )
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu126" in err.hint
    assert "--gpus cpu:N" in err.hint


@pytest.mark.usefixtures("two_3090")
def test_torch_seeing_other_cards_names_both_lists(monkeypatch) -> None:
    other = TorchDevice("NVIDIA GeForce RTX 3060", 12_481_724_416, (8, 6))
    torch_is(monkeypatch, TorchFacts("2.13.0+cu126", cuda="12.6", cuda_available=True,
                                     devices=(RTX_3090, other), nccl=True))  # fmt: skip
    with pytest.raises(HomelabError, match=r"torch sees 2 GPUs \(RTX 3090, RTX 3060\) but NVML "
                       r"lists 2 \(RTX 3090, RTX 3090\)"):  # fmt: skip
        make_controller().prepare("tiny-demo", overrides=ON_GPUS)


@pytest.mark.usefixtures("two_3090")
def test_torch_seeing_fewer_cards_is_refused(monkeypatch) -> None:
    """One card held by another container or VM: torch lists the other only."""
    torch_is(monkeypatch, TorchFacts("2.13.0+cu126", cuda="12.6", cuda_available=True,
                                     devices=(RTX_3090,), nccl=True))  # fmt: skip
    with pytest.raises(HomelabError) as caught:
        make_controller().prepare("tiny-demo", overrides=ON_GPUS + ["hardware.devices=[1]"])
    assert caught.value.message == (
        "the plan uses GPU 1: torch sees 1 GPU (RTX 3090) but NVML lists 2 (RTX 3090, RTX 3090)"
    )
    assert "`nvidia-smi` and torch should list the same cards" in caught.value.hint


@pytest.mark.usefixtures("two_3090")
def test_torch_that_sees_the_planned_cards_prepares(monkeypatch) -> None:
    torch_is(monkeypatch, CUDA_TORCH)
    prepared = make_controller().prepare("tiny-demo", overrides=ON_GPUS)
    assert prepared.resolved.device == "cuda"
    assert prepared.planned.hardware.indices == (0, 1)


@pytest.mark.usefixtures("two_3090")
def test_cpu_plans_never_ask_torch(monkeypatch) -> None:
    def never() -> TorchFacts:
        raise AssertionError("a CPU plan asked torch about CUDA")

    monkeypatch.setattr(doctor, "torch_facts", never)
    assert make_controller().prepare("tiny-demo").resolved.device == "cpu"


@pytest.mark.usefixtures("two_3090")
def test_run_exits_2_before_creating_anything(monkeypatch, capsys, tmp_path) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv("HOMELAB_DP_RUNS", str(runs))
    torch_is(monkeypatch, TorchFacts("2.13.0+cpu"))
    rc = main(["run", "tiny-demo", "--detach", "--set", "hardware.devices=auto"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2
    assert err[0].startswith("error: the plan uses GPUs 0, 1: the installed torch")
    assert err[1].startswith("hint: install the CUDA build of torch")
    assert len(err) == 2
    assert not runs.exists()
