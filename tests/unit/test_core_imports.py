"""The pure parts stay pure: presets, planning, the run contract (runs/), the data pipeline, the
Hugging Face model resolution (hub/), the serving front and what the probe reports
(probe/hardware.py) load no torch, textual, rich or pynvml when imported, so `plan` and
`probe` answer fast and the serving front never holds torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import homelab_dp

PACKAGE = Path(homelab_dp.__file__).parent
PURE_PARTS = ("presets", "planning", "runs", "data", "hub", "serving/front", "user_files")
PURE_MODULES = (
    "probe/hardware.py",
    "errors.py",
    "vocabulary.py",
    "json_safe.py",
    "safe_files.py",
    "byte_units.py",
)


def _name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = sorted(
    {_name(p) for part in PURE_PARTS for p in (PACKAGE / part).rglob("*.py")}
    | {_name(PACKAGE / m) for m in PURE_MODULES}
)
HEAVY = ("torch", "textual", "rich", "pynvml", "transformers", "peft", "bitsandbytes")


def test_the_pure_parts_have_the_expected_modules() -> None:
    for name in ("planning.model_spec", "planning.memory.device_memory", "planning.planner",
                 "presets.preset", "runs.run_spec", "runs.folder.run_state", "probe.hardware",
                 "serving.front.openai_api", "byte_units", "planning.plan_hardware"):  # fmt: skip
        assert f"homelab_dp.{name}" in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_core_module_imports_nothing_heavy(module: str) -> None:
    code = (
        f"import json, sys; import {module}; "
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_plan_command_does_not_import_torch() -> None:
    """`homelab-dp plan` answers without torch, transformers or textual."""
    code = (
        "import json, sys, io, contextlib\n"
        "from homelab_dp.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    rc = main(['plan', 'tiny-demo', '--gpus', '2x24GiB', '--json'])\n"
        f"print(json.dumps([rc] + [m for m in {HEAVY!r} if m in sys.modules and m != 'pynvml']))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert json.loads(out.stdout.splitlines()[-1]) == [0]


def test_the_cli_entry_imports_no_command_until_it_runs() -> None:
    """Why cli/ imports app/ inside its command functions: building the parser loads no app/
    module and nothing heavy, so `homelab-dp probe` or `status` never pays for the planner, the
    run controller or torch (on this machine cli.main imports in about 40 ms, app.runs alone
    in about 220 ms, app.chat in 1.5 s with torch)."""
    code = (
        "import json, sys; import homelab_dp.cli.main; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('homelab_dp.app') "
        f"or m in {HEAVY!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
