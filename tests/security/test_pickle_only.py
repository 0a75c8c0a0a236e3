"""Pickle-only weights are refused by every command that loads, serves or exports a model
(issue 28 point 9): the README promises safetensors only, and ``torch.load`` of a pickle can
run code. Through the real CLI: an ``error:`` naming the pickle file, a ``hint:`` to convert
to safetensors, exit 2, no traceback, nothing written, nothing started.

The class: a model folder with ``pytorch_model.bin`` only, an adapter with
``adapter_model.bin`` only, an adapter whose base is pickle only, and runs whose result or
base is pickle only, each given to eval, chat, serve and export (every format that reads
weights) — and to `run`, whose preflight refuses the same folder as model.path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from homelab_dp.cli import main
from tests.conftest import write_preset
from tests.integration.conftest import DEMO_DATA, DEMO_MODEL, make_run

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker

# A pickle whose load would run code: it must never reach torch.load (nor does this test).
PAYLOAD = b"\x80\x04cos\nsystem\n(S'touch /tmp/homelab-dp-pickle-ran'\ntR."


def _pickle_model(folder: Path) -> Path:
    """A model folder (config, tokenizer) whose weights are pytorch_model.bin alone."""
    folder.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / name, folder / name)
    (folder / "pytorch_model.bin").write_bytes(PAYLOAD)
    return folder


def _adapter(folder: Path, base: Path, weights: str) -> Path:
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "base_model_name_or_path": str(base), "r": 4}
    (folder / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / weights).write_bytes(PAYLOAD)
    return folder


@pytest.fixture
def models(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each MODEL shape → (the MODEL argument, the pickle file the error must name)."""
    pk = _pickle_model(tmp_path / "pickle-model")
    adapter = _adapter(tmp_path / "bin-adapter", DEMO_MODEL, "adapter_model.bin")
    on_pickle = _adapter(tmp_path / "adapter-on-pickle", pk, "adapter_model.safetensors")
    runs = tmp_path / "runs"
    full = make_run(runs, DEMO_MODEL, DEMO_DATA, name="20260101-000000-full-aaaa")
    _pickle_model(full / "final")
    lora = make_run(runs, pk, DEMO_DATA, name="20260101-000000-lora-bbbb", method="lora")
    _adapter(lora / "final", pk, "adapter_model.safetensors")
    qlora = make_run(runs, DEMO_MODEL, DEMO_DATA, name="20260101-000000-qlora-cccc", method="qlora")
    _adapter(qlora / "final", DEMO_MODEL, "adapter_model.bin")
    return {
        "model": (pk, str(pk / "pytorch_model.bin")),
        "adapter": (adapter, str(adapter / "adapter_model.bin")),
        "adapter-base": (on_pickle, str(pk / "pytorch_model.bin")),
        "run-full": (full, str(full / "final" / "pytorch_model.bin")),
        "run-lora-base": (lora, str(pk / "pytorch_model.bin")),
        "run-qlora": (qlora, str(qlora / "final" / "adapter_model.bin")),
    }


def _tree(root: Path) -> list[str]:
    return sorted(str(Path(d) / n) for d, ds, fs in os.walk(root) for n in ds + fs)


COMMANDS = ("eval", "chat", "serve", "export-hf", "export-merged", "export-ollama",
            "export-adapter")  # fmt: skip


def _argv(command: str, model: str, tmp: Path) -> list[str]:
    """The command line of ``command`` on ``model``."""
    if command.startswith("export-"):
        return ["export", model, "--format", command[7:], "--out", str(tmp / "out")]
    return {"eval": ["eval", model, "--data", str(DEMO_DATA), "--gpus", "cpu:1"],
            "chat": ["chat", model, "--gpus", "cpu"],
            "serve": ["serve", model, "--gpus", "cpu:1"]}[command]  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "shape", ["model", "adapter", "adapter-base", "run-full", "run-lora-base", "run-qlora"]
)
def test_pickle_weights_are_refused(
    command: str, shape: str, models, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, pickle_file = models[shape]
    before = _tree(tmp_path)
    rc = main(_argv(command, str(model), tmp_path))
    err = capsys.readouterr().err
    assert rc == 2, err
    folder, name = str(Path(pickle_file).parent), Path(pickle_file).name
    assert err.startswith(f"error: {folder}: only pickle weights ({name}); refused"), err
    assert "\nhint: " in err and "safetensors" in err.split("hint:")[1] and "Traceback" not in err
    assert _tree(tmp_path) == before  # nothing exported, no run, no cache beside them
    assert not Path("/tmp/homelab-dp-pickle-ran").exists()


def test_run_refuses_a_pickle_model_path(tmp_path: Path, capsys) -> None:
    pk = _pickle_model(tmp_path / "pickle-model")
    preset = write_preset(tmp_path, "p", pk, DEMO_DATA)
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    before = _tree(runs) if runs.exists() else []
    assert main(["run", str(preset), "--detach"]) == 2
    err = capsys.readouterr().err
    assert "pytorch_model.bin" in err and "pickle" in err and "\nhint: " in err, err
    assert (_tree(runs) if runs.exists() else []) == before
