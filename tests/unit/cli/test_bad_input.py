"""Every kind of bad input, through the CLI's `run`: one clear error, nothing started or changed.

For each kind (a fixture each, most under ``tests/data/bad_input/``, see its README): exit 2,
an ``error:`` line naming the field, file or line, a ``hint:`` line, no traceback — and nothing
spawned (no child process, no run folder), nothing overwritten (every fixture file and the runs
folder hash the same before and after), no code of the input run (the marker that a preset,
remote code or a pickle payload would create never appears).

The same fixtures at the library level: `test_cli.py` (`plan` on tests/data/bad_presets/),
`test_data.py` (tests/data/bad_data/); an unknown run id through the console script:
`tests/integration/test_controller.py::test_stop_and_attach_of_unknown_runs`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import runpy
import shutil
from pathlib import Path

import psutil
import pytest

from homelab_dp.cli import main
from tests.conftest import DATA, ROOT

BAD = DATA / "bad_input"
PRESETS = BAD / "presets"
OLD = DATA / "bad_presets"  # reused from the planner's tests
MARKER_ENV = "HOMELAB_DP_TEST_MARKER"

# kind of bad input -> (argv of `homelab-dp`, what the error line must say)
CASES: dict[str, tuple[list[str], str]] = {
    "malformed TOML": (["run", str(OLD / "malformed.toml")], "malformed.toml: not valid TOML"),
    "a preset that is Python code": (["run", str(PRESETS / "python-code.toml")],
                                     "python-code.toml: not valid TOML"),
    "unknown key": (["run", str(OLD / "unknown-key.toml")], "train.micro_bach: unknown key"),
    "wrong type": (["run", str(OLD / "wrong-type.toml")],
                   "train.micro_batch: expected an integer, got 'four'"),
    "zero size": (["run", str(OLD / "zero-size.toml")], "data.seq_len: must be at least 1, got 0"),
    "negative size": (["run", str(OLD / "negative-size.toml")],
                      "train.grad_accum: must be at least 1, got -2"),
    "more CPU processes than cores": (["run", str(OLD / "too-many-cpu-procs.toml")],
                                      "hardware.nproc: 4096 processes but this machine has"),
    "missing model folder": (["run", str(OLD / "missing-model.toml")],
                             "model.path: " + str(ROOT / "no/such/model-folder") + " is not a folder"),
    "model folder without weights": (["run", str(PRESETS / "no-weights.toml")],
                                     "models/no-weights: no weights (*.safetensors)"),
    "model folder without tokenizer": (["run", str(PRESETS / "no-tokenizer.toml")],
                                       "models/no-tokenizer: no tokenizer"),
    "unknown architecture": (["run", str(OLD / "unknown-arch.toml")],
                             "unknown-arch/config.json: model_type='no_such_arch' is unknown to transformers"),
    "missing dataset": (["run", str(PRESETS / "missing-data.toml")],
                        "data.path: " + str(ROOT / "no/such/data.jsonl") + " does not exist"),
    "empty dataset": (["run", str(PRESETS / "empty-data.toml")], "empty.jsonl: the file is empty"),
    "fewer samples than world × micro-batch": (
        ["run", str(PRESETS / "too-few-samples.toml")],
        "two-records.jsonl: 2 training sequences of 32 tokens, fewer than world size × "
        "micro-batch = 8"),
    "a bad JSON line": (["run", str(PRESETS / "bad-json-line.toml")],
                        "bad-json-line.jsonl:3: not valid JSON"),
    "fields that do not match the declared format": (
        ["run", str(PRESETS / "format-mismatch.toml")],
        "text-declared-completion.jsonl:1: field 'prompt' missing (this record looks like text"),
    "chat data without assistant turns": (
        ["run", str(PRESETS / "chat-no-assistant.toml")],
        "chat-no-assistant.jsonl:2: field 'messages' has no assistant turn"),
    "seq_len beyond the model's positions": (
        ["run", str(PRESETS / "seq-len-beyond-positions.toml")],
        "data.seq_len: 1024 is beyond the model's 512 positions"),
    "remote code without trust_remote_code": (
        ["run", str(PRESETS / "remote-code.toml")],
        "remote-code/config.json: the model needs its own Python code (auto_map), and "
        "model.trust_remote_code is false"),
    "a pickle where safetensors is expected": (
        ["run", str(PRESETS / "pickle-weights.toml")],
        "pickle-weights: only pickle weights (pytorch_model.bin); refused, never loaded"),
    "an unknown run id": (["resume", "no-such-run"], "run 'no-such-run': no such run under"),
    "resuming a completed run": (["resume", "completed-run"],
                                 "run completed-run: already completed; nothing to resume"),
    "--set of an unknown key": (["run", "tiny-demo", "--set", "train.nope=1"],
                                "--set train.nope: unknown key"),
    "a bad --gpus spec": (["run", "tiny-demo", "--gpus", "cpu:x"],
                          "--gpus: cannot read the RAM size 'x' in 'cpu:x'"),
    "offload asked of DDP": (
        ["run", "tiny-demo", "--set", "train.offload=params", "--set", "train.distribution=ddp"],
        "train.offload = 'params' needs FSDP: set train.distribution = 'fsdp-grad-op', "
        "'fsdp-full' or 'auto', got 'ddp'"),
    "offload on a single device": (
        ["run", "tiny-demo", "--set", "train.offload=params", "--gpus", "cpu:1"],
        "train.offload = 'params' needs FSDP, and FSDP needs two or more devices: this plan "
        "has one"),
    "offload with an optimizer it cannot step": (
        ["run", "tiny-demo", "--set", "train.offload=optimizer", "--set",
         "train.optimizer=adamw8bit"],
        "train.offload = 'optimizer' steps AdamW in host memory: set train.optimizer = 'adamw'"),
    "a sequence split above the world size": (
        ["run", "tiny-demo", "--gpus", "cpu:2", "--set", "train.sequence_parallel=4"],
        "train.sequence_parallel = 4 is above the world size (2 processes)"),
    "a sequence split that does not divide the sequence": (
        ["run", "tiny-demo", "--gpus", "cpu:2", "--set", "train.sequence_parallel=2",
         "--set", "data.seq_len=255"],
        "train.sequence_parallel = 2 does not divide data.seq_len = 255"),
}  # fmt: skip


def _digest(*folders: Path) -> dict[str, str]:
    """Every file under the folders with the hash of its content."""
    out = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where a preset, remote code or a pickle payload would leave a mark if it ever ran."""
    path = tmp_path / "code-ran"
    monkeypatch.setenv(MARKER_ENV, str(path))
    return path


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_input_is_refused_before_anything_starts(kind, in_repo, marker, capsys) -> None:
    argv, needle = CASES[kind]
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    runs.mkdir(parents=True, exist_ok=True)
    if kind == "resuming a completed run":
        shutil.copytree(BAD / "runs" / "completed-run", runs / "completed-run")
    before = _digest(DATA, ROOT / "presets", runs)
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        rc = main([*argv, "--detach"] if argv[0] in ("run", "resume") else argv)
    except SystemExit as exc:  # argparse's own errors
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2 and out.out == "", out
    assert lines[0].startswith("error: ") and needle in lines[0], lines
    assert lines[-1].startswith("hint: ") and len(lines[-1]) > len("hint: ") + 10
    assert "Traceback" not in out.err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children, "spawned"
    assert _digest(DATA, ROOT / "presets", runs) == before, "a file was written or changed"
    assert not marker.exists(), "input was executed"


def test_the_fixtures_code_is_live(marker: Path, tmp_path: Path) -> None:
    """The payloads refused above would run if loaded: the refusals are what keeps them out."""
    data = (BAD / "models" / "pickle-weights" / "pytorch_model.bin").read_bytes()
    loaded = pickle.loads(data)  # the point: this runs the payload
    for value in loaded.values():
        value.close()
    assert marker.exists()
    marker.unlink()
    runpy.run_path(str(BAD / "models" / "remote-code" / "modeling_evil.py"))
    assert marker.exists()


def test_pickle_weights_are_refused_by_torch_too(marker: Path) -> None:
    """Were the file loaded at all, ``weights_only=True`` (torch's default) refuses it unrun."""
    torch = pytest.importorskip("torch")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(BAD / "models" / "pickle-weights" / "pytorch_model.bin", weights_only=True)
    assert not marker.exists()
