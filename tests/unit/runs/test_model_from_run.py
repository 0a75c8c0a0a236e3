"""A preset's model.path naming a run (id, unique prefix or folder): the run's result is the
model to start from (`runs.model_ref.with_local_model`, `config_folder`), and a LoRA adapter
is merged into its base as the model loads (`train.model.trainable_model.merge_start_adapter`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from homelab_dp.errors import HomelabError
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.model_ref import config_folder, with_local_model
from tests.integration.conftest import DEMO_DATA, DEMO_MODEL, make_run


def dpo_preset(model: str):
    return preset_from_dict(
        {
            "model": {"path": model},
            "data": {"path": str(DEMO_DATA)},
            "train": {"method": "lora", "objective": "dpo"},
        }
    )


def _adapter(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(DEMO_MODEL), "r": 4}),
        encoding="utf-8",
    )
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """A full run, a LoRA run with its merge, a LoRA run with its adapter only."""
    root = tmp_path / "runs"
    full = make_run(root, DEMO_MODEL, DEMO_DATA, name="20260101-000000-full-aaaa")
    shutil.copytree(DEMO_MODEL, full / "final")
    merged = make_run(root, DEMO_MODEL, DEMO_DATA, name="20260102-000000-sft-bbbb", method="lora")
    _adapter(merged / "final")
    shutil.copytree(DEMO_MODEL, merged / "final" / "merged")
    lora = make_run(root, DEMO_MODEL, DEMO_DATA, name="20260103-000000-sft-cccc", method="lora")
    _adapter(lora / "final")
    return root


def test_a_run_id_or_prefix_starts_from_the_runs_merged_model(runs: Path) -> None:
    for ref in ("20260102-000000-sft-bbbb", "20260102", str(runs / "20260102-000000-sft-bbbb")):
        preset, origin = with_local_model(dpo_preset(ref), runs)
        assert Path(preset.model.path) == runs / "20260102-000000-sft-bbbb" / "final" / "merged"
        assert origin is None and preset.train.objective == "dpo"
        assert config_folder(ref, root=runs) == Path(preset.model.path)
    preset, _ = with_local_model(dpo_preset("20260101-000000-full"), runs)
    assert Path(preset.model.path) == runs / "20260101-000000-full-aaaa" / "final"


def test_a_model_folder_is_left_as_it_is(runs: Path) -> None:
    preset = dpo_preset(str(DEMO_MODEL))
    assert with_local_model(preset, runs) == (preset, None)
    assert config_folder(str(DEMO_MODEL), root=runs) == DEMO_MODEL


def test_an_ambiguous_prefix_is_refused(runs: Path) -> None:
    with pytest.raises(HomelabError, match="2026010"):
        with_local_model(dpo_preset("2026010"), runs)


def test_an_adapter_run_starts_from_its_base_with_the_adapter(runs: Path) -> None:
    preset, _ = with_local_model(dpo_preset("20260103"), runs)
    assert Path(preset.model.path) == DEMO_MODEL
    assert Path(preset.model.adapter) == runs / "20260103-000000-sft-cccc" / "final"
    assert config_folder("20260103", root=runs) == DEMO_MODEL
    # New adapters on a merged start adapter mean nothing beside the base alone: merged result.
    assert preset.train.merge is True


def test_the_start_adapter_is_merged_into_the_loaded_base(tmp_path: Path) -> None:
    """Real peft: the merged weights are base + scale · B·A, a plain model again."""
    torch = pytest.importorskip("torch")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from homelab_dp.train.model.trainable_model import merge_start_adapter

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float64)
    before = base.model.layers[0].self_attn.q_proj.weight.detach().clone()
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    layer = peft.base_model.model.model.layers[0].self_attn.q_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight)  # B starts at 0: make it count
    delta = 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    peft.save_pretrained(tmp_path / "adapter")
    fresh = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float64)
    merged = merge_start_adapter(fresh, tmp_path / "adapter")
    got = merged.model.layers[0].self_attn.q_proj.weight
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert torch.allclose(got, before + delta, atol=1e-12) and not torch.equal(got, before)
    with pytest.raises(HomelabError, match="no adapter_model.safetensors"):
        merge_start_adapter(fresh, tmp_path)
