"""GRPO in the plan: generation's memory in every option's budget, its time in the prediction,
the knob named when a plan does not fit, the bandwidth table (hand-computed figures)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from homelab_dp.byte_units import GiB
from homelab_dp.planning import grpo_plan
from homelab_dp.planning.batch_shape import accumulation_for
from homelab_dp.planning.flops import (
    MEMORY_BANDWIDTH_GBPS,
    PEAK_DENSE_16BIT_TFLOPS,
    memory_bandwidth,
)
from homelab_dp.planning.memory.device_memory import NF4_BYTES_PER_PARAM, layer_activation_bytes
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import evaluate, plan, plan_largest_micro_batch, train_shape
from homelab_dp.planning.speed_calibration import record_speed
from homelab_dp.presets.preset import preset_from_dict
from tests.conftest import run_cli
from tests.unit.planning.test_model_spec import PUBLISHED

LLAMA3_8B = spec_from_config(PUBLISHED["Meta-Llama-3-8B"][0])
KIB = 1024


def _preset(method: str = "lora", seq_len: int = 256, accum: int = 4, **grpo):
    g = {"generations": 8, "max_completion_tokens": 512, "rewards": ["exact_answer"], **grpo}
    return preset_from_dict({
        "model": {"path": "m"}, "data": {"path": "d", "seq_len": seq_len},
        "train": {"objective": "grpo", "micro_batch": 1, "grad_accum": accum, "method": method,
                  "activation_checkpointing": True},
        "grpo": g,
    })  # fmt: skip


def test_every_card_of_the_peak_table_has_a_published_bandwidth() -> None:
    assert set(MEMORY_BANDWIDTH_GBPS) >= set(PEAK_DENSE_16BIT_TFLOPS)
    assert memory_bandwidth("NVIDIA GeForce RTX 3090") == pytest.approx(936.2e9)
    assert memory_bandwidth("NVIDIA GeForce RTX 4090") == pytest.approx(1008e9)
    assert memory_bandwidth("NVIDIA A100-SXM4-80GB") == pytest.approx(2039e9)
    assert memory_bandwidth("NVIDIA A100-PCIE-40GB") == pytest.approx(1555e9)
    assert memory_bandwidth("NVIDIA H100 PCIe") == pytest.approx(2000e9)
    assert memory_bandwidth("NVIDIA GeForce RTX 4090 D") is None  # a variant: not the 4090's
    assert memory_bandwidth("NVIDIA H100 80GB HBM3 MIG 3g.40gb") == pytest.approx(3350e9 * 3 / 7)


def test_a_decode_step_reads_the_weights_and_the_mean_cache_at_the_cards_bandwidth() -> None:
    preset = _preset()
    hw = parse_gpus_spec("1x24GiB", 64 * GiB)
    hw = replace(hw, devices=(replace(hw.devices[0], name="NVIDIA GeForce RTX 4090"),))
    shape = train_shape(preset, hw, "lora", "ddp", True)
    # LoRA reads the bf16 base but the input embeddings: (8,030,261,248 − 525,336,576) × 2
    assert grpo_plan.decode_weight_bytes(LLAMA3_8B, shape) == 15_009_849_344
    # QLoRA: each of the 6,979,321,856 quantized weights is read packed (NF4 with its
    # quantization state), written and read again in bf16; the other 525,602,816 read in bf16
    q = train_shape(preset, hw, "qlora", "ddp", True)
    assert grpo_plan.decode_weight_bytes(LLAMA3_8B, q) == pytest.approx(
        6_979_321_856 * (NF4_BYTES_PER_PARAM + 4) + 525_602_816 * 2
    )
    t = grpo_plan.generation_time(LLAMA3_8B, preset, shape, hw, flops_per_s=1e30)
    # mean cache: 8 rows × (256 + 512 / 2) tokens × 128 KiB; 1008 GB/s × 80%; 32 layers × 1 ms
    step = (15_009_849_344 + 8 * 512 * 128 * KIB) / 806.4e9 + 0.032
    prompt = 15_009_849_344 / 806.4e9 + 0.032  # the prompt's forward: its weights' reads
    assert t.groups == 4 and t.decode_steps == 4 * 512 and t.generated_tokens == 4 * 512 * 8
    assert t.seconds == pytest.approx(4 * (prompt + 512 * step))
    assert t.seconds_per_decode_step == pytest.approx(step)


def test_the_generate_phase_holds_the_model_states_and_one_groups_cache() -> None:
    preset = _preset()
    hw = parse_gpus_spec("1x80GiB", 64 * GiB)
    shape = train_shape(preset, hw, "lora", "ddp", True)
    mem = grpo_plan.grpo_memory(LLAMA3_8B, preset, shape)
    assert mem.kv_cache_bytes == 8 * 768 * 128 * KIB  # 805,306,368
    logits = 8 * 256 * 128_256 * 2 + 8 * 128_256 * 4  # every prompt position, the last in fp32
    layer = layer_activation_bytes(LLAMA3_8B, shape) * 8 * 256
    assert mem.prompt_forward_bytes == int(max(logits, layer))
    assert mem.sampling_bytes == 8 * 128_256 * (2 + 16)  # logits row, 4 fp32 sampler copies
    # bf16 base, fp32 adapters (41,943,040 of rank 16) and their AdamW state; one process
    states = 8_030_261_248 * 2 + 41_943_040 * 4 + 41_943_040 * 8
    extra = max(
        8 * 256 * 128 * KIB + mem.prompt_forward_bytes, mem.kv_cache_bytes + mem.sampling_bytes
    )
    assert mem.generate_phase_bytes == states + extra
    c = evaluate(LLAMA3_8B, preset, hw, "lora", "ddp", True)
    assert c.budget.phases["generate"] == mem.generate_phase_bytes
    assert mem.reference_bytes == 0 and mem.old_logps_bytes == 0


def test_generation_is_the_peak_when_its_cache_outgrows_the_training_on_the_card() -> None:
    # Multi-head attention (a 512 KiB cache a token), a small vocabulary, activations offloaded
    # to host RAM: the generation's cache is more than what training keeps on the card.
    spec = replace(LLAMA3_8B, kv_heads=32, vocab=512)
    preset = _preset(max_completion_tokens=4096, generations=16, accum=1)
    hw = parse_gpus_spec("1x200GiB", 512 * GiB)
    c = evaluate(spec, preset, hw, "lora", "ddp", True, offload_activations=True)
    assert c.budget.peak_phase == "generate"
    assert c.budget.tensors == c.budget.phases["generate"] > c.budget.phases["backward"]
    assert c.budget.activations == 16 * (256 + 4096) * 512 * KIB  # the whole cache
    smaller = evaluate(spec, _preset(max_completion_tokens=2048, generations=16, accum=1), hw,
                       "lora", "ddp", True, offload_activations=True)  # fmt: skip
    assert smaller.budget.total < c.budget.total


def test_the_reference_and_old_log_probs_raise_the_training_phases() -> None:
    hw = parse_gpus_spec("1x80GiB", 64 * GiB)
    base = evaluate(LLAMA3_8B, _preset(), hw, "lora", "ddp", True).budget
    ref = evaluate(LLAMA3_8B, _preset(beta=0.04), hw, "lora", "ddp", True).budget
    kept = 8 * 512 * 4  # the reference's fp32 log-probabilities of a micro-batch's completions
    assert ref.phases["backward"] == base.phases["backward"] + kept
    assert ref.phases["forward"] > base.phases["forward"]  # its no-grad forward after the policy's
    # iterations > 1 is refused by this version's presets; the planner prices it already
    twice = replace(_preset(), grpo=replace(_preset().grpo, iterations=2))
    shape = train_shape(twice, hw, "lora", "ddp", True)
    # the old policy's fp32 log-probabilities of the 4 prompts × 8 completions × 512 tokens
    old = 4 * 8 * 512 * 4
    assert grpo_plan.grpo_memory(LLAMA3_8B, twice, shape).old_logps_bytes == old
    again = evaluate(LLAMA3_8B, twice, hw, "lora", "ddp", True).budget
    assert again.phases["backward"] == base.phases["backward"] + old
    assert again.logits == base.logits + old


def test_a_grpo_plan_that_does_not_fit_names_the_knob_that_helps() -> None:
    hw = parse_gpus_spec("1x24GiB", 64 * GiB)
    preset = _preset(method="lora", generations=16, max_completion_tokens=1024)
    p = plan(LLAMA3_8B, preset, hw)
    assert not p.fits
    knobs = [a for a in p.advice if a.startswith("GRPO:")]
    assert [k.split(" ")[1] for k in knobs if "fits." in k] == ["grpo.max_completion_tokens"]
    assert any(k.startswith("GRPO: grpo.generations = 2 ") for k in knobs)  # halved to 2
    assert any(k.startswith("GRPO: train.method = 'qlora'") for k in knobs)
    # the knob that fits is planned: that preset fits when planned itself; twice the value,
    # the last one tried before it, does not (same option, nothing offloaded)
    value = int(knobs[0].split("grpo.max_completion_tokens = ")[1].split(" ")[0])
    fitted = replace(preset, grpo=replace(preset.grpo, max_completion_tokens=value))
    assert plan(LLAMA3_8B, fitted, hw).fits and value < 1024
    doubled = replace(preset, grpo=replace(preset.grpo, max_completion_tokens=2 * value))
    assert not evaluate(LLAMA3_8B, doubled, hw, "lora", "ddp", True).fits
    # QLoRA chosen by "auto": the knobs are the generations and the completions
    auto = plan(LLAMA3_8B, _preset(method="auto", generations=16, max_completion_tokens=1024), hw)
    assert auto.chosen.method == "qlora" and not auto.fits
    named = [a.split(" ")[1] for a in auto.advice if a.startswith("GRPO:")]
    assert named == ["grpo.generations", "grpo.max_completion_tokens"]


def test_the_micro_batch_finder_budgets_generation_too() -> None:
    hw = parse_gpus_spec("1x24GiB", 64 * GiB)
    preset = _preset(method="qlora", accum=8)
    p = plan_largest_micro_batch(LLAMA3_8B, preset, hw)
    assert p.fit is not None
    for micro, total, _ in p.fit.tried:
        c = evaluate(LLAMA3_8B, preset, hw, p.chosen.method, p.chosen.distribution,
                     p.chosen.activation_checkpointing, micro_batch=micro,
                     grad_accum=accumulation_for(8, micro, 1))  # fmt: skip
        assert "generate" in c.budget.phases and total == c.budget.total


def test_a_grpo_run_records_no_compute_speed(tmp_path) -> None:
    doc = {"calibration": {"fingerprint": "f"}, "hardware": {"kind": "cpu"},
           "training": {"world_size": 1},
           "predicted": {"flops_per_token": 1e6, "generation_engine": "transformers"}}  # fmt: skip
    assert record_speed(doc, tokens_per_s=100.0, path=tmp_path / "s.json") is None
    doc["predicted"]["generation_engine"] = None
    assert record_speed(doc, tokens_per_s=100.0, path=tmp_path / "s.json") is not None


def test_the_plan_says_generations_share_and_engine_in_text_and_json(
    in_repo: object, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_cli(capsys, "plan", "qwen3-8b-grpo-qlora-2x24gb", "--gpus", "2x24GiB",
                           "--json")  # fmt: skip
    assert rc == 0, err
    doc = json.loads(out)
    pred, grpo = doc["predicted"], doc["grpo"]
    assert pred["generation_engine"] == grpo["engine"] == "transformers"
    assert 0 < pred["generation_share"] < 1
    assert pred["generation_seconds"] == pytest.approx(
        pred["step_seconds"] * pred["generation_share"]
    )
    assert grpo["kv_cache_bytes"] == 8 * 768 * 144 * KIB  # Qwen3-8B: 144 KiB a token
    assert doc["phase_tensor_bytes"]["generate"] == grpo["generate_phase_bytes"]
    assert any(a.startswith("GRPO generation ≈ ") and "by transformers" in a
               for a in doc["advice"])  # fmt: skip
    for c in doc["candidates"]:  # every candidate is priced with its generation
        assert "generate" in c["phase_tensor_bytes"]
        if c["predicted"]:
            assert c["predicted"]["generation_seconds"] > 0
    rc, text, err = run_cli(capsys, "plan", "qwen3-8b-grpo-qlora-2x24gb", "--gpus", "2x24GiB")
    assert rc == 0, err
    assert "GRPO generation ≈" in text and "generation peaks at" in " ".join(text.split())


def test_a_cpu_decode_step_costs_its_layers_at_the_measured_rate_scaled_by_threads() -> None:
    assert grpo_plan.decode_layer_seconds("cpu", 2) == pytest.approx(1.8e-3)
    assert grpo_plan.decode_layer_seconds("cpu", 1) == pytest.approx(1.8e-3 * 2**0.5)
    assert grpo_plan.decode_layer_seconds("cuda", None) == pytest.approx(1e-3)
    tiny = replace(LLAMA3_8B, layers=4)
    preset = _preset(generations=4, max_completion_tokens=16, seq_len=32, accum=1)
    hw = parse_gpus_spec("cpu:2", 64 * GiB)
    shape = train_shape(preset, hw, "lora", "ddp", False)
    t = grpo_plan.generation_time(tiny, preset, shape, hw, flops_per_s=1e30, threads=1)
    # fp32 weights read at 10 GB/s shared by 2 processes, plus 4 layers × 1.8 ms × √2
    weights = grpo_plan.decode_weight_bytes(tiny, shape)
    kv = 4 * (32 + 8) * 4 * 8 * 128 * 2 * 4  # 4 rows × 40 tokens × 4 layers × K,V fp32
    assert t.seconds_per_decode_step == pytest.approx((weights + kv) / 5e9 + 4 * 1.8e-3 * 2**0.5)


def test_with_several_iterations_a_step_carries_its_share_of_one_generation(
    in_repo: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """grpo.iterations = 2 generates once every two steps: the mean step holds half the
    generation, while the decode rate (tokens/s while generating) stays."""
    preds = {}
    for mu in (1, 2):
        rc, out, err = run_cli(capsys, "plan", "qwen3-8b-grpo-qlora-2x24gb", "--gpus", "2x24GiB",
                               "--set", f"grpo.iterations={mu}", "--json")  # fmt: skip
        assert rc == 0, err
        preds[mu] = json.loads(out)["predicted"]
    assert preds[2]["generation_seconds"] == pytest.approx(preds[1]["generation_seconds"] / 2)
    assert preds[2]["generated_tokens_per_s"] == pytest.approx(preds[1]["generated_tokens_per_s"])
    assert preds[2]["generation_share"] < preds[1]["generation_share"]
