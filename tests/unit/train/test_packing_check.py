"""data.pack's check on the real model (`homelab_dp.train.model.packing_check`): a packed block of
three samples against the same samples one by one.

The demo model (LLaMA, sdpa and eager) passes; a model whose forward drops ``position_ids`` — as
a family with its own mask code or a model's own code may — lets samples attend to each other
and is refused with an ``error:`` naming the model type and ``data.pack = false``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from homelab_dp.errors import HomelabError
from homelab_dp.train.model.packing_check import (
    SAMPLE_LENGTHS,
    check_model,
    check_packing,
    require_exact_packing,
)

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "assets" / "models" / "tiny-llama"


class PositionsDroppedLlama(LlamaForCausalLM):
    """A stand-in for a family that builds its own plain causal mask: its forward never hands
    ``position_ids`` on, so a packed block is one sequence of positions 0..n-1."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):  # noqa: D102
        return super().forward(input_ids=input_ids, **kwargs)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_demo_model_packs_exactly(attn, dtype):
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype, attn_implementation=attn)
    model.train()  # as the worker holds it: the check turns dropout off and back
    name = "fp32" if dtype == torch.float32 else "bf16"
    check = check_model(model, device=torch.device("cpu"), dtype=name, fsdp=False)
    assert check.exact and check.model_type == "llama"
    assert check.max_diff <= check.tolerance
    if dtype == torch.float32:
        assert check.max_diff < 1e-4
    assert model.training  # its mode back


def test_a_model_that_drops_position_ids_is_refused():
    model = PositionsDroppedLlama.from_pretrained(
        MODEL, dtype=torch.float32, attn_implementation="eager"
    )
    check = check_packing(model, device="cpu", dtype="fp32", model_type="llama", vocab_size=256)
    assert check.verdict == "differs"
    # Far beyond rounding: the later samples see the earlier ones.
    assert check.max_diff > 100 * check.tolerance
    with pytest.raises(HomelabError) as err:
        check_model(model, device=torch.device("cpu"), dtype="fp32", fsdp=False)
    assert "model_type 'llama'" in err.value.message
    assert "data.pack = false" in err.value.hint


def test_only_the_later_samples_differ_when_attention_crosses():
    """The check sees attention across samples, not a difference of kernels: the first sample
    is alone in its prefix either way, so its logits agree even in the contaminated model."""
    from homelab_dp.train.model.packing_check import _logits, sample_ids

    model = PositionsDroppedLlama.from_pretrained(MODEL, dtype=torch.float32).eval()
    samples = sample_ids(256)
    ids = [t for s in samples for t in s]
    with torch.no_grad():
        packed = _logits(model, ids, list(range(len(ids))), "cpu", contextlib.nullcontext)
        first = _logits(
            model, samples[0], list(range(len(samples[0]))), "cpu", contextlib.nullcontext
        )
    n = SAMPLE_LENGTHS[0]
    assert torch.allclose(packed[:n], first, atol=1e-5)


def test_nan_logits_never_pass():
    from homelab_dp.train.model.packing_check import PackingCheck

    with pytest.raises(HomelabError):
        require_exact_packing(PackingCheck("differs", float("nan"), 1e-4, "llama"))


def test_the_plan_warns_when_packing_cannot_be_proven_ahead(in_repo):
    from homelab_dp.planning.attention_rule import packing_reasons
    from homelab_dp.presets.preset_store import open_preset

    assert packing_reasons(open_preset("tiny-demo", ["data.pack=true"]), "llama") == []
    assert packing_reasons(open_preset("tiny-demo", ["data.pack=false"]), "falcon") == []
    (remote,) = packing_reasons(
        open_preset("tiny-demo", ["data.pack=true", "model.trust_remote_code=true"]), "llama"
    )
    assert "model.trust_remote_code = true" in remote and "data.pack = false" in remote
    (other,) = packing_reasons(open_preset("tiny-demo", ["data.pack=true"]), "falcon")
    assert "model_type 'falcon'" in other
