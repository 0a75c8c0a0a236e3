"""The command line: JSON contracts, presets, and one clear error per kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from homelab_dp.presets.preset_store import SHIPPED_PRESETS, load_preset
from tests.conftest import DATA, ROOT, run_cli

PLAN_FIELDS = {
    "model",
    "hardware",
    "training",
    "method",
    "distribution",
    "fits",
    "per_device_bytes",
    "comm_bytes_per_step",
    "candidates",
    "reasons",
}
BUDGET_FIELDS = {
    "weights",
    "gradients",
    "optimizer",
    "activations",
    "logits",
    "buffers",
    "overhead",
    "total",
}
TARGETS = {  # the hardware each shipped preset's header names
    "llama3-8b-qlora-2x24gb": "2x24GiB",
    "qwen2-0.5b-full-ddp": "2x24GiB",
    "mistral-7b-full-fsdp-4x80gb": "4x80GiB",
    "smollm2-135m-lora-2x12gb": "2x12GiB",
    "tiny-demo": None,
    "qwen3-30b-a3b-qlora-2x24gb": "2x24GiB",
    "gpt-oss-20b-lora-2x24gb": "2x24GiB",
    "tiny-dpo": None,
    "tiny-grpo": None,
    "qwen3-8b-grpo-qlora-2x24gb": "2x24GiB",
    "llama3-8b-dpo-qlora-2x24gb": "2x24GiB",
    "qwen3.5-27b-qlora-2x24gb": "2x24GiB",
    "qwen3.5-35b-a3b-qlora-2x24gb": "2x24GiB",
    "llama3-8b-qlora-64k-1x24gb": "1x24GiB",
    "llama3-8b-qlora-128k-2x24gb": "2x24GiB",
}


def test_plan_json_has_the_contract_fields(in_repo, capsys) -> None:
    rc, out, _ = run_cli(capsys, "plan", "tiny-demo", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert set(doc) >= PLAN_FIELDS
    assert set(doc["model"]) >= {"params", "trainable_params", "layers", "hidden", "vocab"}
    assert set(doc["training"]) >= {
        "micro_batch",
        "grad_accum",
        "world_size",
        "effective_batch",
        "seq_len",
        "activation_checkpointing",
    }
    assert set(doc["per_device_bytes"]) == BUDGET_FIELDS
    assert doc["per_device_bytes"]["total"] == sum(
        v for k, v in doc["per_device_bytes"].items() if k != "total"
    )
    assert doc["hardware"]["kind"] == "cpu" and len(doc["hardware"]["devices"]) == 2
    assert len(doc["candidates"]) == 12
    for cand in doc["candidates"]:
        assert {"method", "distribution", "fits", "per_device_bytes", "comm_bytes_per_step"} <= set(
            cand
        )
    assert doc["training"]["effective_batch"] == 4 * 2 * 2
    assert doc["samples"] is None  # the demo evaluates nothing, so it samples nothing


def test_plan_json_says_what_samples_add(in_repo, capsys) -> None:
    rc, out, _ = run_cli(capsys, "plan", "tiny-demo", "--json", "--set", "train.max_steps=20",
                         "--set", "train.sample_every=5")  # fmt: skip
    samples = json.loads(out)["samples"]
    assert rc == 0 and {k: samples[k] for k in ("rounds", "prompts", "max_tokens")} == {
        "rounds": 4,
        "prompts": 3,
        "max_tokens": 48,
    }


def test_plan_exits_0_when_it_does_not_fit(in_repo, capsys) -> None:
    rc, out, _ = run_cli(capsys, "plan", "llama3-8b-qlora-2x24gb", "--gpus", "8GiB", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["fits"] is False and doc["advice"]


def test_plan_for_people_shows_bars_and_reasons(in_repo, capsys) -> None:
    rc, out, _ = run_cli(capsys, "plan", "qwen2-0.5b-full-ddp", "--gpus", "24GiB,12GiB")
    assert rc == 0
    assert "█" in out and "Every candidate" in out and "Mixed cards" in out


@pytest.mark.parametrize("name", sorted(p.stem for p in SHIPPED_PRESETS.glob("*.toml")))
def test_every_shipped_preset_validates_and_plans(name: str, in_repo, capsys) -> None:
    path = SHIPPED_PRESETS / f"{name}.toml"
    load_preset(path)
    header = path.read_text().splitlines()[0]
    assert header.startswith("# homelab-dp run "), "a preset starts with the command that runs it"
    gpus = TARGETS[name]
    rc, out, err = run_cli(capsys, "plan", name, "--json", *(["--gpus", gpus] if gpus else []))
    assert rc == 0, err
    assert json.loads(out)["fits"] is True, f"{name} must fit the hardware its header names"


def test_probe_json_with_recorded_hardware(monkeypatch, capsys) -> None:
    monkeypatch.setenv("HOMELAB_DP_FAKE_NVML", str(DATA / "nvml" / "2x3090-nvlink.json"))
    rc, out, _ = run_cli(capsys, "probe", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["kind"] == "cuda" and len(doc["gpus"]) == 2
    assert doc["links"][0]["kind"] == "nvlink"


def test_plan_auto_devices_use_the_probed_cards(in_repo, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HOMELAB_DP_FAKE_NVML", str(DATA / "nvml" / "3090+3060.json"))
    rc, out, _ = run_cli(capsys, "plan", "smollm2-135m-lora-2x12gb", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["hardware"]["kind"] == "cuda"
    assert [d["memory_bytes"] for d in doc["hardware"]["devices"]] == [24576 * 2**20, 12288 * 2**20]


def test_probe_without_driver_describes_the_host(capsys) -> None:
    rc, out, _ = run_cli(capsys, "probe", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["host"]["logical_cores"] >= 1


def test_presets_list_show_and_save(in_repo, capsys, tmp_path) -> None:
    rc, out, _ = run_cli(capsys, "presets", "list")
    assert rc == 0 and "tiny-demo" in out and "llama3-8b-qlora-2x24gb" in out
    rc, out, _ = run_cli(capsys, "presets", "show", "tiny-demo")
    assert rc == 0 and "[train]" in out
    rc, out, _ = run_cli(
        capsys,
        "presets",
        "save",
        "my-demo",
        "--from",
        "tiny-demo",
        "--set",
        "train.micro_batch=2",
        "--set",
        "lora.r=4",
    )
    assert rc == 0
    saved = Path(out.split()[1])
    text = saved.read_text()
    assert text.startswith("# homelab-dp run my-demo")
    preset = load_preset(saved)
    assert preset.train.micro_batch == 2 and preset.lora.r == 4
    assert Path(preset.model.path).is_absolute() and Path(preset.model.path).is_dir()
    rc, out, _ = run_cli(capsys, "plan", "my-demo", "--json")
    assert rc == 0 and json.loads(out)["training"]["micro_batch"] == 2
    # Saving again under the same name never overwrites.
    rc, _, err = run_cli(capsys, "presets", "save", "my-demo", "--from", "tiny-demo")
    assert rc == 2 and "already exists" in err and saved.read_text() == text


BAD_PRESETS = {
    "malformed": "not valid TOML",
    "unknown-key": "train.micro_bach: unknown key",
    "unknown-section": "unknown section [optimiser]",
    "wrong-type": "train.micro_batch: expected an integer",
    "zero-size": "data.seq_len: must be at least 1",
    "negative-size": "train.grad_accum: must be at least 1",
    "missing-model": "model.path",
    "unknown-arch": "model_type='no_such_arch' is unknown to transformers",
    "too-many-cpu-procs": "hardware.nproc: 4096 processes",
}


@pytest.mark.parametrize("name", sorted(BAD_PRESETS))
def test_bad_preset_gives_one_clear_error(name: str, in_repo, capsys) -> None:
    path = DATA / "bad_presets" / f"{name}.toml"
    rc, out, err = run_cli(capsys, "plan", str(path))
    lines = err.strip().splitlines()
    assert rc == 2 and out == ""
    assert lines[0].startswith("error: ") and BAD_PRESETS[name] in lines[0]
    assert lines[-1].startswith("hint: ")
    assert "Traceback" not in err


def test_every_problem_is_reported_in_one_answer(in_repo, capsys) -> None:
    rc, _, err = run_cli(capsys, "plan", str(DATA / "bad_presets" / "many-problems.toml"))
    assert rc == 2
    for key in ("model.dtype", "data.seq_len", "train.lr", "train.warmup"):
        assert f"{key}:" in err
    assert err.count("error: ") == 4 and err.count("hint: ") == 1


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "tiny-demo", "--gpus", "2xlots"], "--gpus: cannot read the memory size"),
        (["plan", "tiny-demo", "--set", "train.nope=1"], "--set train.nope: unknown key"),
        (
            ["plan", "tiny-demo", "--set", "train.micro_batch=0"],
            "train.micro_batch: must be at least 1",
        ),
        (["plan", "tiny-demo", "--set", "micro_batch"], "--set micro_batch: expected KEY=VALUE"),
        (["plan", "no-such-preset"], "preset 'no-such-preset'"),
        (["presets", "show", "nope"], "preset 'nope'"),
        (["plan"], "give a preset (PRESET) or a model (--model ID_OR_FOLDER)"),
    ],
)
def test_bad_arguments(argv, needle, in_repo, capsys) -> None:
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and needle in err and "hint: " in err and "Traceback" not in err


def test_console_script_runs_plan(in_repo) -> None:
    """The installed entry point works end to end in a fresh process."""
    exe = Path(sys.executable).with_name("homelab-dp")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "homelab_dp.cli"]
    out = subprocess.run(
        [*cmd, "plan", "tiny-demo", "--json"], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert json.loads(out.stdout)["fits"] is True
