"""The families table (`benchmarks/families.py` → docs/models.md) on the families it used to
leave "not checked" (issue 36): each now builds from a tiny config that sets what transformers
leaves unset, and the plan's count equals transformers' meta instantiation. Three of them
found census bugs, fixed: DBRX's top-k in ``ffn_config`` and its experts stacked in 2-D
parameters inside ``norm_attn_norm``/``ffn``; Qwen4-Exp's residual gates named after attention
(``attn_hyper_connection``) taken for attention mixers; Gemma 4's assistant refused for its
``vocab_size_per_layer_input`` of 0."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from homelab_dp.train.model import model_census  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "families_bench", Path(__file__).resolve().parents[3] / "benchmarks" / "families.py"
)
assert _spec and _spec.loader
families = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(families)

MIXERS = {
    "dbrx": {"attention": 2},
    "qwen4_exp_text": {"linear_attention": 3, "gated_attention": 1},
    "gemma4_assistant": {"sliding_attention": 3, "attention": 1},
    "dots1": {"attention": 4},
}


@pytest.mark.parametrize("model_type", sorted(MIXERS))
def test_a_family_once_not_checked_is_planned_exactly(model_type: str) -> None:
    row = families.check(model_type, **families.OVERRIDES[model_type])
    assert row["status"] == "derived", row
    assert row["params"] == row["meta"] and 0 < row["active"] <= row["params"]
    assert row["mixers"] == MIXERS[model_type]
    if model_type == "dbrx":  # 4 experts, top-2: two of each layer's experts skipped per token
        assert row["active"] < row["params"]


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm is installed here")
def test_a_family_whose_library_is_missing_is_named_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    families.CONFIG_MAPPING["gemma3n"]().save_pretrained(tmp_path)
    assert model_census.main([str(tmp_path)]) == 2
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert answer["missing_library"] and "timm" in answer["error"]
    assert "config.json" in answer["error"] and answer["hint"]
