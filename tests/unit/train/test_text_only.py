"""`model.text_only`: a multimodal wrapper's language model loads alone, with the wrapper's
weights, and the plan counts exactly what loads (a tiny random Gemma 3 wrapper built here).

Without it the whole wrapper loads and its vision tower is frozen, as the plan says too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf

from homelab_dp.app.model_specs import model_spec
from homelab_dp.errors import HomelabError
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.model.quantized_load import build_on_meta
from homelab_dp.train.model.trainable_model import load_model


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random Gemma 3 (vision tower, projector, language model) in safetensors."""
    text = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=64,
                max_position_embeddings=128)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, image_size=28, patch_size=14)  # fmt: skip
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gemma3") / "wrapper"
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    return path


def _load(folder: Path, text_only: bool, method: str = "full") -> torch.nn.Module:
    preset = preset_from_dict({"model": {"path": str(folder), "text_only": text_only},
                               "data": {"path": "unused.jsonl"}})  # fmt: skip
    resolved = Resolved(method=method, distribution="ddp", activation_checkpointing=False,  # type: ignore[arg-type]
                        device="cpu", world_size=1, dtype="fp32", micro_batch=1, grad_accum=1,
                        lr=1e-3)  # fmt: skip
    return load_model(preset, resolved, torch.device("cpu"))


def test_text_only_loads_the_language_model_alone_with_the_wrappers_weights(
    wrapper: Path,
) -> None:
    whole, alone = _load(wrapper, False), _load(wrapper, True)
    assert type(alone.model).__name__ == "Gemma3ForCausalLM"
    assert not any("vision" in n or "projector" in n for n, _ in alone.model.named_parameters())
    theirs = {n.replace("model.language_model.", "model."): p
              for n, p in whole.model.named_parameters()}  # fmt: skip
    for name, param in alone.model.named_parameters():
        assert torch.equal(param, theirs[name]), name
    # The plan counts what loads: the whole wrapper (tower frozen), or the language model.
    assert whole.params == model_spec(wrapper).params
    assert alone.params == model_spec(wrapper, text_only=True).params < whole.params
    assert whole.trainable_params == alone.params  # the tower is frozen in the whole wrapper


def test_text_only_is_refused_by_qloras_streamed_load(wrapper: Path) -> None:
    preset = preset_from_dict({"model": {"path": str(wrapper), "text_only": True},
                               "data": {"path": "unused.jsonl"}})  # fmt: skip
    resolved = Resolved(method="qlora", distribution="fsdp-full", activation_checkpointing=False,  # type: ignore[arg-type]
                        device="cpu", world_size=2, dtype="fp32", micro_batch=1, grad_accum=1,
                        lr=1e-3)  # fmt: skip
    with pytest.raises(HomelabError, match="model.text_only"):
        build_on_meta(preset, resolved, torch.float32)
