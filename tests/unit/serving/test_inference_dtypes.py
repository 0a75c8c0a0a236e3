"""16-bit inference keeps what must stay fp32 in fp32 (issue 22 point 3).

`serving.replica.result_model.load_for_inference` (chat, serve's replicas) and `serving.replica.result_model` (export) load the
weights in the compute dtype and move them with ``.to(device)`` only: the rotary ``inv_freq``
buffers and the modules a model keeps in fp32 (``_keep_in_fp32_modules_strict``) stay fp32. On
the CPU the loader picks fp32, so bf16 is what a card would get (`inference_dtype`'s answer on
an Ampere card, stood in for here); the real transformers load runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from homelab_dp.runs.model_ref import resolve_model
from homelab_dp.serving.replica import result_model as loading
from homelab_dp.serving.replica.result_model import load_for_inference, merge_to

DEMO_MODEL = Path(__file__).resolve().parents[3] / "assets" / "models" / "tiny-llama"
KEPT = "o_proj"
"""The module the tests ask transformers to keep in fp32 (a real model class's attribute)."""


@pytest.fixture
def bf16_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's dtype as on a bf16 card (the load itself is the real one, on the CPU)."""
    monkeypatch.setattr(loading, "inference_dtype", lambda device, preset="auto": torch.bfloat16)


@pytest.fixture
def keeps_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """LlamaForCausalLM asks for its o_proj weights in fp32, as T5 or Gemma3n ask for theirs."""
    from transformers import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "_keep_in_fp32_modules_strict", [KEPT])


def _rotary(model: Any) -> list[torch.Tensor]:
    buffers = [b for n, b in model.named_buffers() if n.endswith("inv_freq")]
    assert buffers, "the tiny Llama has rotary buffers"
    return buffers


def _adapter(tmp_path: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], init_lora_weights=False
    )
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(DEMO_MODEL), config)
    adapted.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def test_bf16_generation_keeps_rotary_buffers_fp32(bf16_card: None) -> None:
    loaded = load_for_inference(resolve_model(str(DEMO_MODEL)), "cpu")
    assert loaded.dtype == torch.bfloat16 and loaded.base == "bf16"
    assert loaded.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    for buffer in _rotary(loaded.model):
        assert buffer.dtype == torch.float32
    # The angles are the fp32 ones: 1 / theta^(2i/d), not their bf16 rounding.
    want = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    assert torch.equal(_rotary(loaded.model)[0], want)


def test_bf16_generation_keeps_fp32_modules_fp32(
    bf16_card: None, keeps_fp32: None, tmp_path: Path
) -> None:
    for ref in (resolve_model(str(DEMO_MODEL)), resolve_model(str(_adapter(tmp_path)))):
        model = load_for_inference(ref, "cpu").model
        kept = [p.dtype for n, p in model.named_parameters() if KEPT in n]
        assert len(kept) == 4 and set(kept) == {torch.float32}, (ref.path, kept)
        others = {p.dtype for n, p in model.named_parameters() if KEPT not in n}
        assert others == {torch.bfloat16}


def test_a_bf16_merge_writes_the_fp32_modules_in_fp32(keeps_fp32: None, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    out.mkdir()
    merge_to(DEMO_MODEL, _adapter(tmp_path), DEMO_MODEL, out, "bf16")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    kept = {k: v for k, v in dtypes.items() if KEPT in k}
    assert len(kept) == 4 and set(kept.values()) == {"F32"}, kept
    assert {v for k, v in dtypes.items() if KEPT not in k} == {"BF16"}
    # The merged o_proj is the fp32 sum, not a bf16 rounding of it.
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    weight = merged.model.layers[0].self_attn.o_proj.weight
    assert weight.dtype == torch.float32
    assert not torch.equal(weight, weight.to(torch.bfloat16).float())
