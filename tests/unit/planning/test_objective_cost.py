"""What the objective costs in time and words: the resolved reference, the extra no-grad
forwards' share of a step, the precompute pass, the JSON block and the plan's reasons."""

from __future__ import annotations

import pytest

from homelab_dp.byte_units import GiB, format_bytes
from homelab_dp.planning.flops import (
    causal_span,
    flops_per_token,
    no_grad_forward_flops_per_token,
    objective_flops_factor,
)
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.planning.objective_cost import (
    precompute_seconds,
    resolve_reference,
    sequence_len,
    shape_flops_factor,
)
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import plan, plan_objective, train_shape
from homelab_dp.presets.preset import preset_from_dict
from tests.unit.planning.test_model_spec import PUBLISHED

SMOL = spec_from_config(PUBLISHED["SmolLM-135M"][0])
TWO_24 = parse_gpus_spec("2x24GiB", 64 * GiB)


def _preset(pack: bool = True, **train):
    base = {"micro_batch": 4, "grad_accum": 2, "method": "lora", "distribution": "ddp",
            "activation_checkpointing": False}  # fmt: skip
    return preset_from_dict({"model": {"path": "m"}, "data": {"path": "d", "seq_len": 512, "pack": pack},
                             "train": {**base, **train}})  # fmt: skip


def _cost(**train):
    p = _preset(**train)
    chosen = plan(SMOL, p, TWO_24).chosen
    return plan_objective(SMOL, p, TWO_24, chosen), chosen


def test_reference_auto_resolves_by_method() -> None:
    assert resolve_reference("dpo", "auto", "lora") == "adapters"
    assert resolve_reference("kto", "auto", "qlora") == "adapters"
    assert resolve_reference("dpo", "auto", "full") == "precompute"
    assert resolve_reference("dpo", "copy", "full") == "copy"
    assert resolve_reference("dpo", "precompute", "qlora") == "precompute"
    # What a method cannot have (a what-if of another method) resolves as auto would.
    assert resolve_reference("dpo", "copy", "qlora") == "adapters"
    assert resolve_reference("kto", "adapters", "full") == "precompute"
    assert resolve_reference("orpo", "adapters", "lora") == "none"
    assert resolve_reference("sft", "auto", "full") == "none"


def test_flops_factor_counts_the_no_grad_forwards() -> None:
    span = causal_span(512)
    kw = {"method": "lora", "activation_checkpointing": False, "attention_span": span}
    train = flops_per_token(SMOL, **kw)
    fwd = no_grad_forward_flops_per_token(SMOL, attention_span=span)
    assert objective_flops_factor(
        SMOL, objective="dpo", reference="adapters", **kw
    ) == pytest.approx(1 + fwd / train)
    assert objective_flops_factor(
        SMOL, objective="kto", reference="adapters", **kw
    ) == pytest.approx(1 + 2 * fwd / train)
    for objective, reference in (("sft", "none"), ("orpo", "none"), ("dpo", "precompute")):
        assert objective_flops_factor(SMOL, objective=objective, reference=reference, **kw) == 1.0
    # LoRA's step is forward + input gradients (~2 forwards): the reference adds about half.
    assert 1.4 < objective_flops_factor(SMOL, objective="dpo", reference="adapters", **kw) < 1.55


def test_objective_json_block() -> None:
    cost, _ = _cost(objective="dpo")
    doc = cost.to_json()
    assert set(doc) == {
        "name", "reference", "sequences_per_sample", "rows_per_micro_batch", "row_len",
        "no_grad_forwards_per_micro_batch", "step_flops_factor", "reference_weight_bytes",
        "precompute_share_of_epoch", "precompute_seconds",
    }  # fmt: skip
    assert doc["name"] == "dpo" and doc["reference"] == "adapters"
    assert doc["sequences_per_sample"] == 2 and doc["no_grad_forwards_per_micro_batch"] == 1
    assert (doc["rows_per_micro_batch"], doc["row_len"]) == (4, 1024)  # packed pairs
    assert doc["precompute_share_of_epoch"] is None and doc["precompute_seconds"] is None
    sft, _ = _cost()
    assert sft.to_json()["sequences_per_sample"] == 1 and sft.step_flops_factor == 1.0


def test_precompute_is_a_forward_only_share_of_an_epoch() -> None:
    cost, chosen = _cost(objective="dpo", method="full")
    assert cost.reference == "precompute" and cost.step_flops_factor == 1.0
    # Full fine-tune, no recomputation: a forward is a third of a trained token.
    assert cost.precompute_share == pytest.approx(1 / 3, rel=0.01)
    # 3.6M tokens trained at 10k tokens/s: a 360 s epoch; the pass about 120 s.
    assert precompute_seconds(cost, epoch_tokens=3_600_000, tokens_per_s=10_000) == pytest.approx(
        120, rel=0.01
    )
    adapters, _ = _cost(objective="dpo")
    assert precompute_seconds(adapters, epoch_tokens=3_600_000, tokens_per_s=10_000) is None


def test_reasons_say_what_the_objective_costs() -> None:
    p = plan(SMOL, _preset(objective="dpo"), TWO_24)
    cost = plan_objective(SMOL, _preset(objective="dpo"), TWO_24, p.chosen)
    pct = round(100 * (cost.step_flops_factor - 1))
    line = next(r for r in p.reasons if r.startswith("DPO:"))
    assert "2 sequences per pair, so a micro-batch is 4 rows of 1024 tokens" in line
    assert "full logits of both sequences" in line
    assert (
        f"reference = the base with the adapters disabled: one extra no-grad forward per "
        f"micro-batch (+{pct}% step compute)" in line
    )
    full = plan(SMOL, _preset(objective="dpo", method="full"), TWO_24)
    line = next(r for r in full.reasons if r.startswith("DPO:"))
    assert "reference = precomputed: one no-grad pass over the data before step 1" in line
    assert "33% of an epoch's training compute" in line
    copy = plan(SMOL, _preset(objective="dpo", method="full", reference="copy"), TWO_24)
    line = next(r for r in copy.reasons if r.startswith("DPO:"))
    assert (
        "a frozen copy of the starting model on every device" in line and "MiB per device" in line
    )
    orpo = plan(SMOL, _preset(objective="orpo", pack=False), TWO_24)
    line = next(r for r in orpo.reasons if r.startswith("ORPO:"))
    assert "a micro-batch is 8 rows of 512 tokens" in line  # unpacked: two rows per pair
    assert line.endswith("no reference model.")
    kto = plan(SMOL, _preset(objective="kto"), TWO_24)
    line = next(r for r in kto.reasons if r.startswith("KTO:"))
    assert "two extra no-grad forwards (the reference's and the KL's)" in line
    assert "Effective batch 16 completions per optimizer step." in kto.reasons
    assert "Effective batch 16 pairs per optimizer step." in p.reasons
    assert not any(
        r.startswith(("DPO", "ORPO", "KTO")) for r in plan(SMOL, _preset(), TWO_24).reasons
    )


def test_the_time_models_factor_of_a_shape() -> None:
    p = _preset(objective="dpo")
    shape = train_shape(p, TWO_24, "lora", "ddp", False)
    assert (shape.seq_len, sequence_len(shape)) == (1024, 512)  # a packed pair: 2 × 512
    cost = plan_objective(SMOL, p, TWO_24, plan(SMOL, p, TWO_24).chosen)
    assert shape_flops_factor(SMOL, shape) == cost.step_flops_factor > 1.4
    unpacked = train_shape(_preset(pack=False, objective="dpo"), TWO_24, "lora", "ddp", False)
    assert (unpacked.micro_batch, sequence_len(unpacked)) == (8, 512)
    sft = train_shape(_preset(), TWO_24, "lora", "ddp", False)
    assert sequence_len(sft) == 512 and shape_flops_factor(SMOL, sft) == 1.0


def test_a_copy_that_does_not_fit_is_told_precompute_would() -> None:
    # Qwen2-0.5B, full DPO under DDP on 2 × 14 GiB: the frozen fp32 copy (2 GB) tips it over.
    qwen = spec_from_config(PUBLISHED["Qwen2-0.5B"][0])
    cards = parse_gpus_spec("2x14GiB", 64 * GiB)

    def planned(reference: str):
        return plan(qwen, _preset(objective="dpo", method="full", reference=reference,
                                  micro_batch=1, activation_checkpointing=True), cards)  # fmt: skip

    copy, pre = planned("copy"), planned("precompute")
    assert not copy.fits and pre.fits
    line = next(a for a in copy.advice if a.startswith("Precomputed reference:"))
    assert f"({format_bytes(pre.chosen.budget.total)} per device)" in line
    assert not any(a.startswith("Precomputed reference:") for a in pre.advice)
