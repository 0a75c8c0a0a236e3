"""Screen 1, Hardware, against recorded probes."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Static

from homelab_dp.app import doctor
from homelab_dp.app.runs import RunController
from homelab_dp.probe.machine_facts import BnbFacts, TorchDevice, TorchFacts
from homelab_dp.tui.screens.hardware import HardwareScreen
from homelab_dp.tui.tui_app import HomelabApp
from tests.tui.conftest import open_app, plain, use_gpus, wait_for


async def _probed(app: HomelabApp, pilot) -> HardwareScreen:
    screen = app.screen
    assert isinstance(screen, HardwareScreen)
    await wait_for(pilot, lambda: screen.report is not None, what="the probe")
    return screen


def _cards(app: HomelabApp) -> list[Static]:
    return list(app.screen.query(".gpu-card").results(Static))


@pytest.mark.usefixtures("in_repo")
async def test_nvlink_pair_shows_two_cards_and_what_nvlink_means(
    monkeypatch: pytest.MonkeyPatch, controller: RunController
) -> None:
    use_gpus(monkeypatch, "2x3090-nvlink")
    async with open_app(controller) as (app, pilot, _):
        await _probed(app, pilot)
        cards = _cards(app)
        assert [c.border_title for c in cards] == ["GPU 0 · RTX 3090", "GPU 1 · RTX 3090"]
        assert "24.0 GiB" in plain(app, ".gpu-card")
        assert "gen4 x16" in plain(app, ".gpu-card")
        topology = plain(app, "#topology")
        assert "GPU 0 ↔ GPU 1  NVLink ×4" in topology
        assert "Every pair is on NVLink" in topology
        assert not app.screen.query_one("#hw-notice").display
        assert "2 GPUs, 48.0 GiB in all" in plain(app, "#hw-summary")


@pytest.mark.usefixtures("in_repo")
async def test_mixed_cards_over_host_memory_say_sync_is_slow(
    monkeypatch: pytest.MonkeyPatch, controller: RunController
) -> None:
    use_gpus(monkeypatch, "3090+3060")
    async with open_app(controller) as (app, pilot, _):
        await _probed(app, pilot)
        assert len(_cards(app)) == 2
        assert "(card max gen4 x16)" in plain(app, "#gpu-cards > .gpu-card:last-child")
        topology = plain(app, "#topology")
        assert "pcie · host bridge · peer-to-peer no" in topology
        assert "through host memory" in topology


@pytest.mark.usefixtures("in_repo")
async def test_no_driver_shows_the_notice_and_the_cpu_host(
    monkeypatch: pytest.MonkeyPatch, controller: RunController
) -> None:
    use_gpus(monkeypatch, "no-driver")
    async with open_app(controller) as (app, pilot, _):
        await _probed(app, pilot)
        notice = app.screen.query_one("#hw-notice", Static)
        assert notice.display
        assert "No NVIDIA driver found" in plain(app, "#hw-notice")
        assert _cards(app) == []
        assert not app.screen.query_one("#topology").display
        assert "No GPU: plans and runs use the CPU host." in plain(app, "#hw-summary")
        assert "logical cores" in plain(app, "#host")


@pytest.mark.usefixtures("in_repo")
async def test_refresh_probes_again(
    monkeypatch: pytest.MonkeyPatch, controller: RunController, tmp_path: Path
) -> None:
    use_gpus(monkeypatch, "2x3090-nvlink")
    async with open_app(controller) as (app, pilot, _):
        screen = await _probed(app, pilot)
        first = screen.report
        use_gpus(monkeypatch, "1x4090")  # the machine changed under us
        await pilot.press("r")
        await wait_for(pilot, lambda: screen.report is not first, what="the second probe")
        assert [c.border_title for c in _cards(app)] == ["GPU 0 · RTX 4090"]
        assert (
            "One card" in plain(app, "#topology") or not app.screen.query_one("#topology").display
        )


# ---------------------------------------------------------------------- the readiness checks
RTX_3090 = TorchDevice("NVIDIA GeForce RTX 3090", 25_447_170_048, (8, 6))


def stand_in(monkeypatch: pytest.MonkeyPatch, torch: TorchFacts) -> None:
    """torch and bitsandbytes as they would answer on the recorded machine."""
    monkeypatch.setattr(doctor, "torch_facts", lambda: torch)
    monkeypatch.setattr(doctor, "bnb_facts", lambda want_cuda: BnbFacts("0.50.2", True, True))


async def _checked(app: HomelabApp, pilot) -> HardwareScreen:
    screen = await _probed(app, pilot)
    await wait_for(pilot, lambda: screen.checks is not None, what="the readiness checks")
    return screen


@pytest.mark.usefixtures("in_repo")
async def test_checks_appear_below_the_probe_and_it_does_not_move(
    monkeypatch: pytest.MonkeyPatch, controller: RunController
) -> None:
    use_gpus(monkeypatch, "2x3090-nvlink")
    stand_in(monkeypatch, TorchFacts("2.13.0+cu126", cuda="12.6", cuda_available=True,
                                     devices=(RTX_3090, RTX_3090), nccl=True))  # fmt: skip
    async with open_app(controller) as (app, pilot, _):
        body = app.screen.query_one("#hw-body")
        await _probed(app, pilot)
        before = (app.screen.query_one("#hw-checks").region, body.virtual_size)
        screen = await _checked(app, pilot)
        assert (app.screen.query_one("#hw-checks").region, body.virtual_size) == before
        assert app.screen.query_one("#hw-checks").border_title == "readiness · homelab-dp doctor"
        text = plain(app, "#hw-checks-text")
        assert "✓ nvml driver" in text
        assert "✓ torch sees the cards" in text and "2 GPUs: RTX 3090, RTX 3090" in text
        assert "NVLink ×4 (same CPU)" in text
        assert [c.name for c in screen.checks][:3] == [
            "nvml driver",
            "torch build",
            "torch sees the cards",
        ]
        assert "fail" not in {c.status for c in screen.checks}


@pytest.mark.usefixtures("in_repo")
async def test_cpu_torch_with_gpus_shows_the_failure_and_how_to_fix_it(
    monkeypatch: pytest.MonkeyPatch, controller: RunController
) -> None:
    use_gpus(monkeypatch, "2x3090-nvlink")
    stand_in(monkeypatch, TorchFacts("2.13.0+cpu"))
    async with open_app(controller) as (app, pilot, _):
        await _checked(app, pilot)
        text = plain(app, "#hw-checks-text", width=400)
        assert "✗ torch build" in text
        assert (
            "→ install the CUDA build of torch: pip uninstall -y torch && pip install torch "
            in text
        )
        assert "--index-url https://download.pytorch.org/whl/cu126" in text
        assert "1 fail · " in text


@pytest.mark.usefixtures("in_repo")
async def test_no_gpu_skips_every_gpu_check(
    monkeypatch: pytest.MonkeyPatch, controller: RunController
) -> None:
    use_gpus(monkeypatch, "no-driver")
    stand_in(monkeypatch, TorchFacts("2.13.0+cpu"))
    async with open_app(controller) as (app, pilot, _):
        screen = await _checked(app, pilot)
        gpu = [
            c for c in screen.checks if c.name not in ("disk", "host RAM", "/dev/shm", "open files")
        ]
        assert {c.status for c in gpu} == {"skip"}
        (line,) = [
            ln for ln in plain(app, "#hw-checks-text").splitlines() if "compute capability" in ln
        ]
        assert line.startswith("– compute capability ")
        assert "no GPU: no NVIDIA driver found" in line
