"""Every child that may touch CUDA gets its cards by the launcher's one rule (issue 22 point 7).

`probe.visible_gpus.cuda_device_env`: ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` whenever
``CUDA_VISIBLE_DEVICES`` is set, so that an NVML index (what `homelab-dp probe` shows and what
the user types) names the same card for CUDA on a rig of mixed cards. Checked here on the
function that builds each child's environment: eval's workers, the TUI's chat server, `chat`'s
own process, and export's merge and gguf children.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from homelab_dp.app.chat_server import ChatServer
from homelab_dp.app.chat_session import device_env
from homelab_dp.app.evaluate import Devices, eval_env
from homelab_dp.app.export import cpu_child_env

MIXED = {"PATH": "/usr/bin", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
"""A user's environment that would number a 3090 + 2080 Ti pair fastest first."""
VISIBLE, ORDER = "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"


def _cards(env: dict[str, str]) -> tuple[str | None, str | None]:
    return env.get(VISIBLE), env.get(ORDER)


@pytest.mark.parametrize(
    ("devices", "want"),
    [
        (Devices("cuda", 1, (1,)), ("1", "PCI_BUS_ID")),
        (Devices("cuda", 2, (0, 2)), ("0,2", "PCI_BUS_ID")),
        (Devices("cuda", 1, (1,), ("GPU-b",)), ("GPU-b", "PCI_BUS_ID")),
        (Devices("cpu", 2), ("", "PCI_BUS_ID")),
    ],
    ids=["one-index", "two-indices", "uuid", "cpu"],
)
def test_eval_workers(devices: Devices, want: tuple[str, str], monkeypatch) -> None:
    monkeypatch.setattr("os.environ", dict(MIXED))
    env = eval_env(devices)
    assert _cards(env) == want
    assert env["PATH"] == "/usr/bin" and env["HOMELAB_DP_LOOPBACK"] == "1"


@pytest.mark.parametrize(
    ("cpu", "card", "base", "want"),
    [
        (False, "1", MIXED, ("1", "PCI_BUS_ID")),
        (False, "GPU-b", MIXED, ("GPU-b", "PCI_BUS_ID")),
        (True, None, MIXED, ("", "PCI_BUS_ID")),
        (False, None, {**MIXED, VISIBLE: "1"}, ("1", "PCI_BUS_ID")),  # the user's own choice
        (False, None, {"PATH": "/usr/bin"}, (None, None)),  # every card, nothing to order
    ],
    ids=["index", "uuid", "cpu", "user-visible", "unset"],
)
def test_the_tui_chat_server(cpu, card, base, want, tmp_path: Path) -> None:
    server = ChatServer("run-1", log=tmp_path / "log", cpu=cpu, cuda_visible=card)
    assert _cards(server.environment(base)) == want


@pytest.mark.parametrize(
    ("gpus", "base", "want", "device"),
    [
        ("1", MIXED, ("1", "PCI_BUS_ID"), "cuda:0"),
        (" 0 ", MIXED, ("0", "PCI_BUS_ID"), "cuda:0"),
        ("cpu", MIXED, ("", "PCI_BUS_ID"), "cpu"),
        (None, {**MIXED, VISIBLE: "1,0"}, ("1,0", "PCI_BUS_ID"), None),
        (None, {"PATH": "/usr/bin"}, (None, None), None),
    ],
    ids=["index", "spaces", "cpu", "user-visible", "unset"],
)
def test_chat_in_its_own_process(gpus, base, want, device) -> None:
    env, where = device_env(base, gpus)
    assert _cards(env) == want and where == device


@pytest.mark.parametrize("device", ["cuda:1", "cuda", " CUDA:0"])
def test_chat_on_a_cuda_device_counts_cards_in_pci_bus_order(device) -> None:
    """``chat --device cuda:N`` without CUDA_VISIBLE_DEVICES: every card stays visible, counted
    as NVML and `probe` count them (PCI bus order), not fastest first."""
    env, where = device_env({"PATH": "/usr/bin"}, None, device)
    assert _cards(env) == (None, "PCI_BUS_ID") and where is None
    env, _ = device_env({**MIXED, VISIBLE: "1,0"}, None, device)
    assert _cards(env) == ("1,0", "PCI_BUS_ID")
    assert _cards(device_env({"PATH": "/usr/bin"}, None, "cpu")[0]) == (None, None)


def test_export_children_hide_every_card(monkeypatch) -> None:
    monkeypatch.setattr("os.environ", {**MIXED, VISIBLE: "0,1"})
    assert _cards(cpu_child_env()) == ("", "PCI_BUS_ID")
