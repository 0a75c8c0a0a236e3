"""Planner decisions on fixtures, and the memory model's arithmetic."""

from __future__ import annotations

from dataclasses import replace

import pytest

from homelab_dp.byte_units import GiB
from homelab_dp.errors import HardwareSpecError, PresetError
from homelab_dp.planning.memory.device_memory import (
    NF4_BYTES_PER_PARAM,
    TrainShape,
    budget,
    chunk_peak_bytes,
)
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import plan, plan_largest_micro_batch
from homelab_dp.presets.preset import preset_from_dict
from tests.unit.planning.test_model_spec import FAMILY_CONFIGS as PUBLISHED_SMALL
from tests.unit.planning.test_model_spec import PUBLISHED

# Published architectures, shared with the parameter-count tests.
SMOLLM_135M = PUBLISHED["SmolLM-135M"][0]
LLAMA3_8B = PUBLISHED["Meta-Llama-3-8B"][0]


def _preset(**train):
    seq_len = train.pop("seq_len", 1024)
    base = {"micro_batch": 2, "grad_accum": 8}
    return preset_from_dict(
        {
            "model": {"path": "m"},
            "data": {"path": "d", "seq_len": seq_len},
            "train": {**base, **train},
        }
    )


def _plan(cfg, gpus, **train):
    return plan(spec_from_config(cfg), _preset(**train), parse_gpus_spec(gpus, 64 * GiB))


def test_small_model_on_two_24gb_cards_is_full_ddp() -> None:
    p = _plan(SMOLLM_135M, "2x24GiB")
    assert (p.chosen.method, p.chosen.distribution, p.fits) == ("full", "ddp", True)
    assert p.effective_batch == 2 * 2 * 8
    j = p.to_json()
    assert j["training"]["world_size"] == 2 and j["training"]["effective_batch"] == 32


def test_8b_full_on_two_24gb_cards_is_never_ddp() -> None:
    p = _plan(LLAMA3_8B, "2x24GiB", method="full")
    assert p.chosen.distribution != "ddp"
    assert not p.fits  # 16 bytes/param of model state is 128 GB: not on 48 GB in total
    ddp = [c for c in p.candidates if (c.method, c.distribution) == ("full", "ddp")][0]
    assert not ddp.fits and ddp.budget.weights == 8_030_261_248 * 4


def test_8b_auto_on_one_24gb_card_is_lora_with_checkpointing() -> None:
    # Chunked cross-entropy and 16-bit frozen embeddings: 8B LoRA at 2 × 2048 tokens fits
    # a 24 GiB card (torchtune publishes a 16.2 GiB peak for it on a 4090).
    p = _plan(LLAMA3_8B, "24GiB", micro_batch=2, grad_accum=8, seq_len=2048)
    assert (p.chosen.method, p.chosen.distribution, p.fits) == ("lora", "ddp", True)
    assert p.chosen.activation_checkpointing
    assert any("Too big: full fine-tune" in r for r in p.reasons)
    assert 16 * GiB < p.chosen.budget.tensors < 20 * GiB


def test_8b_auto_on_one_12gb_card_falls_back_to_qlora() -> None:
    p = _plan(LLAMA3_8B, "12GiB", micro_batch=2, grad_accum=8, seq_len=2048)
    assert (p.chosen.method, p.chosen.distribution, p.fits) == ("qlora", "ddp", True)
    assert any("Too big: full fine-tune" in r for r in p.reasons)
    assert any("Too big: LoRA" in r for r in p.reasons)
    assert p.chosen.budget.total < 12 * GiB


def test_8b_auto_on_two_24gb_cards_is_lora_ddp() -> None:
    p = _plan(LLAMA3_8B, "2x24GiB", micro_batch=2, grad_accum=8, seq_len=2048)
    assert (p.chosen.method, p.chosen.distribution, p.fits) == ("lora", "ddp", True)


def test_8b_lora_with_long_sequences_on_two_24gb_cards_shards_before_quantizing() -> None:
    p = _plan(LLAMA3_8B, "2x24GiB", micro_batch=8, grad_accum=2, seq_len=2048)
    assert (p.chosen.method, p.fits) == ("lora", True)
    assert p.chosen.distribution in ("fsdp-grad-op", "fsdp-full")


def test_8b_on_four_80gb_cards_is_full_and_sharded() -> None:
    p = _plan(LLAMA3_8B, "4x80GiB")
    assert p.chosen.method == "full" and p.fits
    assert p.chosen.distribution in ("zero1", "fsdp-grad-op", "fsdp-full")


def test_8b_on_one_8gb_card_does_not_fit_and_says_what_would() -> None:
    p = _plan(LLAMA3_8B, "8GiB")
    assert not p.fits
    j = p.to_json()
    assert j["fits"] is False and j["advice"]
    assert any("Larger cards" in a for a in j["advice"])
    assert any("GiB per device" in a for a in j["advice"])


def test_advice_for_micro_batch_keeps_the_effective_batch() -> None:
    # QLoRA under DDP without offload (QLoRA-FSDP full offloading its parameters fits this batch).
    p = _plan(LLAMA3_8B, "2x24GiB", method="qlora", distribution="ddp", micro_batch=16,
              grad_accum=2, seq_len=2048, offload="none", offload_activations=False)  # fmt: skip
    assert not p.fits
    line = [a for a in p.advice if "Smaller micro-batch" in a][0]
    # effective batch 16 × 2 × 2 = 64 stays 64 with the proposed micro-batch and accumulation
    assert "(effective batch 64)" in line


def test_pinned_method_and_distribution_are_respected() -> None:
    p = _plan(SMOLLM_135M, "2x24GiB", method="lora", distribution="fsdp-full")
    assert (p.chosen.method, p.chosen.distribution) == ("lora", "fsdp-full")
    assert any("pins" in r for r in p.reasons)


def test_mixed_cards_are_limited_by_the_smallest() -> None:
    # 135M full fine-tune with long sequences: fits 24 GiB but not 6 GiB (without offloading
    # the activations, which would make it fit).
    big = _plan(
        SMOLLM_135M,
        "2x24GiB",
        method="full",
        distribution="ddp",
        activation_checkpointing=False,
        offload_activations=False,
        seq_len=2048,
        micro_batch=4,
    )
    mixed = _plan(
        SMOLLM_135M,
        "24GiB,6GiB",
        method="full",
        distribution="ddp",
        activation_checkpointing=False,
        offload_activations=False,
        seq_len=2048,
        micro_batch=4,
    )
    assert big.fits and not mixed.fits
    assert any("smallest" in r for r in mixed.reasons)


def test_activation_checkpointing_is_turned_on_only_when_it_makes_the_run_fit() -> None:
    roomy = _plan(SMOLLM_135M, "2x80GiB", micro_batch=2)
    assert not roomy.chosen.activation_checkpointing
    tight = _plan(
        SMOLLM_135M, "2x12GiB", method="full", distribution="ddp", micro_batch=4, seq_len=2048
    )
    off = [c for c in tight.candidates if (c.method, c.distribution) == ("full", "ddp")]
    assert tight.fits and tight.chosen.activation_checkpointing
    assert off[0].activation_checkpointing  # the candidate listed is the fitting one


def test_lr_scaling_when_the_effective_batch_differs_from_the_reference() -> None:
    p = _plan(
        SMOLLM_135M,
        "4x24GiB",
        lr=1e-4,
        reference_batch=16,
        lr_scaling="sqrt",
        micro_batch=2,
        grad_accum=8,
    )
    assert p.effective_batch == 64
    assert p.lr.linear == pytest.approx(4e-4) and p.lr.sqrt == pytest.approx(2e-4)
    assert p.lr.applied == pytest.approx(2e-4)
    assert any("square-root rule" in r for r in p.reasons)


def test_cpu_plan_uses_fp32_and_host_ram() -> None:
    p = _plan(SMOLLM_135M, "cpu:2:32GiB")
    assert p.dtype == "fp32" and p.hardware.kind == "cpu"
    assert [d.memory_bytes for d in p.hardware.devices] == [16 * GiB, 16 * GiB]
    assert p.chosen.budget.weights == 134_515_008 * 4


def _shape(**kw) -> TrainShape:
    base = dict(
        method="full",
        distribution="ddp",
        world_size=4,
        device="cuda",
        dtype="bf16",
        micro_batch=1,
        seq_len=512,
        grad_accum=2,
    )
    return TrainShape(**{**base, **kw})


def test_zero_and_fsdp_shard_the_model_states() -> None:
    spec = spec_from_config(LLAMA3_8B)
    psi = spec.params
    ddp = budget(spec, _shape())
    zero1 = budget(spec, _shape(distribution="zero1"))
    grad_op = budget(spec, _shape(distribution="fsdp-grad-op"))
    full = budget(spec, _shape(distribution="fsdp-full"))
    # Weights and optimizer state are alive at every moment, sharded as ZeRO says.
    assert (ddp.weights, ddp.optimizer) == (4 * psi, 8 * psi)
    assert (zero1.weights, zero1.optimizer) == (4 * psi, 8 * psi // 4)
    assert (grad_op.weights, grad_op.optimizer) == (psi, 2 * psi)
    assert full.weights == psi and full.buffers < grad_op.buffers
    # DDP's fp32 gradients are its buckets (no other copy) beside autocast's bf16 weights;
    # with accumulation (grad_accum 2) its bucket rebuild after the first step holds a second
    # copy while the optimizer state exists. FSDP2 keeps unsharded gradients while sync is off.
    assert ddp.peak_phase == "forward" and ddp.gradients == 8 * psi and ddp.buffers == 2 * psi
    assert ddp.phases["load"] == 8 * psi  # the buckets exist from the wrap on
    steady = budget(spec, _shape(grad_accum=1))
    assert steady.phases["forward"] < ddp.phases["forward"] and steady.peak_phase == "backward"
    assert steady.gradients == 4 * psi and steady.buffers == 2 * psi
    assert grad_op.gradients == 4 * psi
    # The optimizer step sees sharded gradients: ZeRO-2-like grad-op holds 4 bytes/param there.
    step = budget(spec, _shape(distribution="fsdp-grad-op", grad_accum=1)).phases["optimizer"]
    assert step == psi + psi + 2 * psi
    assert ddp.total > zero1.total > grad_op.total > full.total


def test_qlora_weights_are_4bit_linears_and_compute_dtype_rest() -> None:
    spec = spec_from_config(LLAMA3_8B)
    other = spec.params - spec.quantizable_params  # embeddings, lm_head, norms
    adapters = spec.lora_params(16)
    for device, dtype, width in (("cuda", "bf16", 2), ("cuda", "fp32", 4), ("cpu", "fp32", 4)):
        shape = _shape(method="qlora", world_size=1, device=device, dtype=dtype)
        b = budget(spec, shape)
        assert b.weights == int(
            spec.quantizable_params * NF4_BYTES_PER_PARAM + other * width + adapters * 4
        ), device
        assert b.phases["optimizer"] >= b.weights + adapters * 4 + adapters * 8


def test_communication_bytes_follow_the_ring_formulas() -> None:
    spec = spec_from_config(SMOLLM_135M)
    g = spec.params * 4
    assert budget(spec, _shape(world_size=1)).comm_bytes_per_step == 0
    assert budget(spec, _shape()).comm_bytes_per_step == int(2 * 3 / 4 * g)
    lora = budget(spec, _shape(method="lora"))
    assert lora.comm_bytes_per_step == int(2 * 3 / 4 * spec.lora_params(16) * 4)


def test_the_logits_term_follows_the_loss_path() -> None:
    # SmolLM (LLaMA): the chunked loss head; its figure is train.loss's arithmetic.
    spec = spec_from_config(SMOLLM_135M)
    b = budget(spec, _shape(micro_batch=8, seq_len=2048, world_size=1))
    n = 8 * 2048
    head = chunk_peak_bytes(spec.vocab, spec.hidden, n, 2, weight_bytes=4, hidden_bytes=4)
    assert b.logits == head["saved"] + head["backward"]
    assert b.logits < n * spec.vocab * 12 / 10  # the full path: log-softmax and two gradients
    # Gemma-2 softcaps its logits after lm_head: the full fp32 logits path stays.
    gemma2 = spec_from_config(PUBLISHED_SMALL["gemma2"])
    g = budget(gemma2, _shape(micro_batch=8, seq_len=2048, world_size=1))
    assert g.logits == n * gemma2.vocab * 12 and g.peak_phase == "backward"
    lora = budget(spec, _shape(method="lora", micro_batch=8, seq_len=2048, world_size=1))
    frozen = chunk_peak_bytes(spec.vocab, spec.hidden, n, 2, weight_grad=False)
    assert lora.logits == frozen["saved"] + frozen["backward"]


@pytest.mark.parametrize("spec", ["", "x24GiB", "2x", "2xlots", "0x24GiB", "cpu:two", "24GiB,,"])
def test_bad_gpus_specs(spec: str) -> None:
    with pytest.raises(HardwareSpecError) as err:
        parse_gpus_spec(spec, 64 * GiB)
    assert "--gpus" in err.value.message and err.value.hint


def test_gpus_specs() -> None:
    assert [d.memory_bytes for d in parse_gpus_spec("24GiB,12GiB", 0).devices] == [
        24 * GiB,
        12 * GiB,
    ]
    assert parse_gpus_spec("4x80GiB", 0).world_size == 4
    assert parse_gpus_spec("cpu:3", 30 * GiB).devices[0].memory_bytes == 10 * GiB


# -- compute dtype from the planned cards' compute capability -------------------------------------


def _dtype_plan(gpus: str, dtype: str = "auto", cfg=SMOLLM_135M, **train):
    preset = _preset(**train)
    preset = replace(preset, model=replace(preset.model, dtype=dtype))
    return plan(spec_from_config(cfg), preset, parse_gpus_spec(gpus, 64 * GiB))


def test_gpus_spec_names_a_compute_capability() -> None:
    hw = parse_gpus_spec("2x11GiB@7.5,24GiB@8.6,24GiB", 0)
    assert [d.compute_capability for d in hw.devices] == [(7, 5), (7, 5), (8, 6), None]
    assert [d.memory_bytes for d in hw.devices] == [11 * GiB, 11 * GiB, 24 * GiB, 24 * GiB]
    assert hw.below_capability((8, 0)) == (0, 1) and hw.unknown_capability() == (3,)


@pytest.mark.parametrize("spec", ["2x11GiB@7", "2x11GiB@", "11GiB@x.5", "11GiB@0.5", "@7.5"])
def test_bad_compute_capabilities_in_gpus_specs(spec: str) -> None:
    with pytest.raises(HardwareSpecError) as err:
        parse_gpus_spec(spec, 64 * GiB)
    assert "--gpus" in err.value.message and "@7.5" in err.value.hint


def test_auto_dtype_is_bf16_when_every_card_is_ampere_or_newer() -> None:
    p = _dtype_plan("24GiB@8.6,24GiB@8.9")
    assert p.dtype == "bf16"
    assert "bf16: every card is compute capability >= 8.0." in p.reasons
    j = p.to_json()
    assert j["training"]["dtype"] == "bf16"
    assert [d["compute_capability"] for d in j["hardware"]["devices"]] == [[8, 6], [8, 9]]


def test_auto_dtype_on_turing_is_fp16_with_loss_scaling_and_no_fsdp() -> None:
    p = _dtype_plan("2x11GiB@7.5", cfg=LLAMA3_8B, seq_len=2048)
    assert p.dtype == "fp16"
    assert (
        "fp16 with loss scaling: what-if 11.0 GiB is compute capability 7.5, which has no bf16."
        in p.reasons
    )
    assert any(r.startswith("FSDP is left out") for r in p.reasons)
    # The worker refuses fp16 under FSDP2: those candidates are not options, the rest still are
    assert p.chosen.distribution == "ddp" and p.chosen.method == "qlora"
    fsdp = [c for c in p.candidates if c.distribution.startswith("fsdp") and c.method != "qlora"]
    assert fsdp and all(not c.supported and "bf16" in c.note for c in fsdp)
    assert not any("FSDP" in a for a in p.advice)


def test_one_older_card_makes_the_whole_plan_fp16() -> None:
    p = _dtype_plan("24GiB@8.6,24GiB@6.1")
    assert p.dtype == "fp16"
    assert any("is compute capability 6.1, which has no bf16" in r for r in p.reasons)


def test_what_if_cards_of_unknown_capability_keep_bf16_and_say_so() -> None:
    p = _dtype_plan("2x24GiB")
    assert p.dtype == "bf16"
    (line,) = [r for r in p.reasons if r.startswith("bf16:")]
    assert "not known" in line and "--gpus 2x11GiB@7.5" in line


def test_a_pinned_bf16_on_a_card_without_bf16_is_refused() -> None:
    with pytest.raises(PresetError) as err:
        _dtype_plan("2x11GiB@7.5", dtype="bf16")
    assert err.value.exit_code == 2
    assert "model.dtype" in err.value.message and "what-if 11.0 GiB" in err.value.message
    assert "7.5" in err.value.message
    assert '"auto"' in err.value.hint and '"fp16"' in err.value.hint


def test_a_pinned_fsdp_distribution_that_would_compute_in_fp16_is_refused() -> None:
    with pytest.raises(PresetError) as err:
        _dtype_plan("2x11GiB@7.5", distribution="fsdp-full")
    assert "train.distribution = 'fsdp-full'" in err.value.message
    assert "'ddp'" in err.value.hint
    with pytest.raises(PresetError) as err:
        _dtype_plan("2x24GiB@8.6", dtype="fp16", distribution="fsdp-grad-op")
    assert "model.dtype = 'bf16'" in err.value.hint


def test_pinned_dtypes_are_kept_and_the_cpu_computes_in_fp32() -> None:
    fp16 = _dtype_plan("2x24GiB@8.6", dtype="fp16")
    assert fp16.dtype == "fp16" and fp16.chosen.distribution in ("ddp", "zero1")
    assert not any(r.startswith(("bf16:", "fp16 with")) for r in fp16.reasons)
    assert any(r.startswith("FSDP is left out") for r in fp16.reasons)
    assert _dtype_plan("2x11GiB@7.5", dtype="fp32").dtype == "fp32"
    cpu = _dtype_plan("cpu:2", dtype="bf16")
    assert cpu.dtype == "fp32" and not any("bf16" in r for r in cpu.reasons)


def test_the_micro_batch_finder_skips_fsdp_in_fp16() -> None:
    spec, preset = spec_from_config(LLAMA3_8B), _preset(seq_len=2048)
    p = plan_largest_micro_batch(spec, preset, parse_gpus_spec("2x24GiB@7.5", 64 * GiB))
    assert p.dtype == "fp16" and not p.chosen.distribution.startswith("fsdp")
