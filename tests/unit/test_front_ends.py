"""The front ends are only front ends: cli/ and tui/ import app/, render/ and the shared words.

Whatever a command or a screen reads or starts (run folders, presets, the probe, the hub, the
serving front, a chat's model or server) sits behind an `app/` function, so both front ends
show the same thing by the same path (docs/ARCHITECTURE.md, "Front ends are thin"). Every
import counts: at module level, inside functions and under ``TYPE_CHECKING`` (the import reader
of `tests/unit/test_layers.py`). The CLI may import the TUI only to open it.
"""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_layers import PACKAGE, imported, modules

SHARED = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
"""The shared words at the package root (errors, vocabulary, json_safe, …)."""

OPENS_THE_TUI = "homelab_dp.tui.tui_app"
"""What the CLI may import of the TUI: the app, to open it (`homelab-dp tui`)."""


def allowed(front: str, target: str) -> bool:
    """Whether a module of ``front`` ("cli" or "tui") may import the module ``target``."""
    parts = target.split(".")
    if len(parts) < 2:
        return False
    if parts[1] in ("app", "render", front) or parts[1] in SHARED:
        return True
    return front == "cli" and target == OPENS_THE_TUI


def test_cli_and_tui_import_only_app_render_and_the_shared_words() -> None:
    mods = modules()
    wrong = [
        f"{module} -> {target}"
        for module, path in mods.items()
        if module.split(".")[1:2] in (["cli"], ["tui"])
        for target in imported(module, path, set(mods))
        if not allowed(module.split(".")[1], target)
    ]
    assert sorted(wrong) == []


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker itself: a lazy import, one under TYPE_CHECKING, a relative one and a
    `from homelab_dp import part` are all seen, and judged by the part they name."""
    code = (
        "from typing import TYPE_CHECKING\n"
        "from homelab_dp import errors, probe\n"
        "if TYPE_CHECKING:\n"
        "    from homelab_dp.runs.run_view import RunView\n"
        "def f():\n"
        "    from homelab_dp.app.runs import make_controller\n"
        "    import homelab_dp.serving.front.openai_server\n"
        "    from ...planning import plan_reasons\n"
        "    from homelab_dp.tui.tui_app import run_tui\n"
    )
    path = tmp_path / "x.py"
    path.write_text(code)
    found = imported("homelab_dp.tui.screens.x", path, set(modules()))
    judged = {t: allowed("cli", t) for t in found}
    assert judged == {
        "homelab_dp.errors": True,
        "homelab_dp.probe": False,
        "homelab_dp.runs.run_view": False,
        "homelab_dp.app.runs": True,
        "homelab_dp.serving.front.openai_server": False,
        "homelab_dp.planning.plan_reasons": False,
        "homelab_dp.tui.tui_app": True,
    }
    assert not allowed("tui", "homelab_dp.cli.main")
    assert not allowed("tui", "homelab_dp.supervise.launcher")
