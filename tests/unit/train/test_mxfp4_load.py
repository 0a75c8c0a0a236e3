"""A pre-quantized MXFP4 checkpoint (gpt-oss ships its experts so) loads as the plan says:
full and LoRA train on the experts dequantized to the compute dtype (transformers'
``Mxfp4Config(dequantize=True)``), QLoRA's streamed reader dequantizes the same blocks and
scales before it re-quantizes them to NF4.

The checkpoint is a tiny random gpt-oss whose expert weights are written here as MXFP4 blocks
(two FP4 values a byte, 32 a block) and scales (a power of two a block), as gpt-oss stores them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from homelab_dp.app.model_specs import model_spec
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.model.quantized_load import _Checkpoint
from homelab_dp.train.model.trainable_model import load_model

E, H, W = 4, 64, 32  # experts, hidden, expert width (both multiples of the 32-value block)
PROJ = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tf.GptOssConfig(vocab_size=128, hidden_size=H, intermediate_size=W, head_dim=16,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             num_local_experts=E, num_experts_per_tok=2,
                             layer_types=["full_attention"])  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    for proj in PROJ:
        weight = state.pop(f"model.layers.0.mlp.experts.{proj}")  # [E, in, out]
        rows, inputs = weight.shape[2], weight.shape[1]
        blocks = torch.randint(
            0, 256, (E, rows, inputs // 32, 16), generator=gen, dtype=torch.uint8
        )
        scales = torch.randint(124, 130, (E, rows, inputs // 32), generator=gen, dtype=torch.uint8)
        state[f"model.layers.0.mlp.experts.{proj}_blocks"] = blocks
        state[f"model.layers.0.mlp.experts.{proj}_scales"] = scales
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    doc = config.to_dict()
    doc["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(doc))
    return path


def _expected(folder: Path, proj: str) -> torch.Tensor:
    """transformers' own dequantization of the stored blocks and scales."""
    source = _Checkpoint(folder)
    name = f"model.layers.0.mlp.experts.{proj}"
    return convert_moe_packed_tensors(
        source.get(f"{name}_blocks"), source.get(f"{name}_scales"), dtype=torch.float32
    )


def test_the_plan_names_the_checkpoints_quantization(folder: Path) -> None:
    assert model_spec(folder).quantization == "mxfp4"


def test_lora_loads_the_experts_dequantized(folder: Path) -> None:
    preset = preset_from_dict({"model": {"path": str(folder)}, "data": {"path": "unused.jsonl"}})
    resolved = Resolved(method="lora", distribution="ddp", activation_checkpointing=False,  # type: ignore[arg-type]
                        device="cpu", world_size=1, dtype="fp32", micro_batch=1, grad_accum=1,
                        lr=1e-3)  # fmt: skip
    loaded = load_model(preset, resolved, torch.device("cpu"))
    experts = loaded.model.get_base_model().model.layers[0].mlp.experts
    for proj in PROJ:
        got = getattr(experts, proj)
        assert got.dtype == torch.float32 and not got.requires_grad
        assert torch.equal(got, _expected(folder, proj)), proj


def test_qloras_streamed_reader_dequantizes_the_same_values(folder: Path) -> None:
    for proj in PROJ:
        got = _Checkpoint(folder).experts(f"model.layers.0.mlp.experts.{proj}", "model", E)
        assert got is not None and torch.equal(got, _expected(folder, proj)), proj
        assert got.shape == ((E, H, 2 * W) if proj == "gate_up_proj" else (E, W, H))
