"""LoRA under DDP and FSDP2, QLoRA (4-bit NF4 base on the CPU) under DDP: results that load.

The QLoRA run also uses bitsandbytes' 8-bit AdamW, writes the merged model (``train.merge``),
and resumes bit for bit from a checkpoint holding the adapters and the 8-bit optimizer state.
Its result, evaluated by `homelab-dp eval`, is the adapter on the NF4 base it was trained
against: the loss the run's own last evaluation gave, which its 16-bit merge does not give.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from homelab_dp.runs.folder.run_folder import read_run_spec, write_run_spec
from tests.integration.conftest import (
    bitwise_equal,
    events,
    final_weights,
    make_run,
    run,
    run_together,
)

pytestmark = pytest.mark.slow


def _check_adapter(rd: Path, base: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert events(rd, "end")[-1]["reason"] == "completed"
    start = events(rd, "start")[-1]
    assert 0 < start["trainable_params"] < start["params"]
    assert all(math.isfinite(e["loss"]) for e in events(rd, "step"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), rd / "final")
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.abs().max()) > 0 for p in lora_b)  # initialised at zero
    assert (rd / "final" / "tokenizer.json").exists()


@pytest.mark.parametrize(
    ("distribution", "ac"), [("ddp", True), ("fsdp-full", False)], ids=["ddp-ac", "fsdp-full"]
)
def test_lora(
    distribution: str, ac: bool, tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    rd = make_run(tmp_path, tiny_model, data_dir / "ragged-16.jsonl", name="lora",
                  distribution=distribution, method="lora", lr=1e-2,
                  activation_checkpointing=ac)  # fmt: skip
    assert run(rd, 2) == 0
    _check_adapter(rd, tiny_model)


def test_qlora_adamw8bit_merge_and_resume(tiny_model: Path, data_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    data, held_out = data_dir / "ragged-16.jsonl", data_dir / "ragged-12.jsonl"
    train = {"optimizer": "adamw8bit", "merge": True, "max_steps": 4}
    full = _with_eval(make_run(tmp_path, tiny_model, data, name="full", method="qlora", lr=1e-2,
                               train=train), held_out)  # fmt: skip
    stopped = _with_eval(make_run(tmp_path, tiny_model, data, name="stop", method="qlora",
                                  lr=1e-2, train=train), held_out)  # fmt: skip
    assert run_together((full, 2, {}), (stopped, 2, {"stop_at": 2})) == [0, 0]
    _check_adapter(full, tiny_model)
    _check_eval_on_nf4(full, held_out)
    merged = AutoModelForCausalLM.from_pretrained(full / "final" / "merged").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((merged[q] - base[q]).abs().max()) > 0

    assert events(stopped, "end")[-1]["reason"] == "stopped"
    assert run(stopped, 2, resume=True) == 0
    assert events(stopped, "start")[-1]["start_step"] == 2
    assert bitwise_equal(final_weights(stopped), final_weights(full))


def _with_eval(run_dir: Path, eval_path: Path) -> Path:
    """The run evaluates ``eval_path`` at its last step (data.eval_path)."""
    spec = read_run_spec(run_dir)
    data = replace(spec.preset.data, eval_path=str(eval_path))
    write_run_spec(run_dir, replace(spec, preset=replace(spec.preset, data=data)))
    return run_dir


def _eval(model: Path, data: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "homelab_dp.cli", "eval", str(model), "--data", str(data),
           "--gpus", "cpu:1", "--seq-len", "32", "--json"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _check_eval_on_nf4(run_dir: Path, held_out: Path) -> None:
    """`eval RUN` says its base is NF4 and gives the run's last eval loss; the 16-bit merge
    (what eval loaded before: final/merged) gives another."""
    in_run = events(run_dir, "eval")[-1]
    procs = (_eval(run_dir, held_out), _eval(run_dir / "final" / "merged", held_out))
    (nf4, merged) = (json.loads(p.communicate(timeout=300)[0] or "{}") for p in procs)
    assert nf4["base"] == "nf4" and merged["base"] == "fp32", (nf4, merged)
    assert nf4["tokens"] == merged["tokens"] == in_run["tokens"]
    assert math.isclose(nf4["loss"], in_run["loss"], rel_tol=1e-6), (nf4["loss"], in_run)
    # Measured: NF4 within 1e-7, the merge 3e-4 away (the base's quantization error).
    gap = abs(merged["loss"] - in_run["loss"]) / in_run["loss"]
    assert gap > 1e-4, (merged["loss"], in_run["loss"])
