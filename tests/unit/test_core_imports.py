"""core/ stays pure, and the data pipeline, the run-folder primitives, the Hugging Face model
resolution (hub/) and the serving front stay torch-free: importing any of their modules loads no
torch, textual, rich or pynvml."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import homelab_dp.core

CORE = Path(homelab_dp.core.__file__).parent
PURE_PARTS = ("core", "data", "rundir", "serve", "hub")
MODULES = sorted(
    f"homelab_dp.{part}.{p.stem}"
    for part in PURE_PARTS
    for p in (CORE.parent / part).glob("*.py")
    if p.stem != "__init__"
)
HEAVY = ("torch", "textual", "rich", "pynvml", "transformers", "peft", "bitsandbytes")


def test_core_has_the_expected_modules() -> None:
    for name in ("hardware", "model_spec", "memory", "planner", "preset"):
        assert f"homelab_dp.core.{name}" in MODULES


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
