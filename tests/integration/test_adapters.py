"""LoRA under DDP and FSDP2, QLoRA (4-bit NF4 base on the CPU) under DDP: results that load.

The QLoRA run also uses bitsandbytes' 8-bit AdamW, writes the merged model (``train.merge``),
and resumes bit for bit from a checkpoint holding the adapters and the 8-bit optimizer state.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.integration.conftest import bitwise_equal, events, final_weights, make_run, run

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

    data = data_dir / "ragged-16.jsonl"
    train = {"optimizer": "adamw8bit", "merge": True, "max_steps": 4}
    full = make_run(tmp_path, tiny_model, data, name="full", method="qlora", lr=1e-2, train=train)
    assert run(full, 2) == 0
    _check_adapter(full, tiny_model)
    merged = AutoModelForCausalLM.from_pretrained(full / "final" / "merged").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((merged[q] - base[q]).abs().max()) > 0

    stopped = make_run(tmp_path, tiny_model, data, name="stop", method="qlora", lr=1e-2,
                       train=train)  # fmt: skip
    assert run(stopped, 2, stop_at=2) == 0
    assert events(stopped, "end")[-1]["reason"] == "stopped"
    assert run(stopped, 2, resume=True) == 0
    assert events(stopped, "start")[-1]["start_step"] == 2
    assert bitwise_equal(final_weights(stopped), final_weights(full))
