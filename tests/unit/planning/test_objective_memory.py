"""The memory a preference objective adds: two sequences per pair, the plain logits path of
both (checked against live tensor bytes), and the reference model's three modes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from homelab_dp.byte_units import GiB
from homelab_dp.planning.memory.device_memory import (
    TrainShape,
    activation_bytes,
    budget,
    loss_head_bytes,
)
from homelab_dp.planning.memory.objective_memory import (
    forward_rows,
    preference_head_bytes,
    reference_forward_bytes,
)
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import plan, train_shape
from homelab_dp.presets.preset import preset_from_dict
from tests.unit.planning.test_model_spec import PUBLISHED

LLAMA3_8B = spec_from_config(PUBLISHED["Meta-Llama-3-8B"][0])
TWO_24 = parse_gpus_spec("2x24GiB", 64 * GiB)


def _preset(pack: bool = True, seq_len: int = 1024, **train):
    base = {"micro_batch": 2, "grad_accum": 8, "method": "qlora", "distribution": "ddp",
            "activation_checkpointing": True}  # fmt: skip
    return preset_from_dict({"model": {"path": "m"},
                             "data": {"path": "d", "seq_len": seq_len, "pack": pack},
                             "train": {**base, **train}})  # fmt: skip


def _shape(pack: bool = True, **train) -> TrainShape:
    p = _preset(pack, **train)
    t = p.train
    return train_shape(p, TWO_24, t.method, t.distribution, bool(t.activation_checkpointing))


def test_forward_rows_are_two_sequences_per_pair() -> None:
    assert forward_rows(4, 512, packed=True, objective="sft") == (4, 512)
    assert forward_rows(4, 512, packed=True, objective="dpo") == (4, 1024)
    assert forward_rows(4, 512, packed=False, objective="orpo") == (8, 512)
    assert forward_rows(3, 100, packed=False, objective="kto") == (6, 100)


@pytest.mark.parametrize("ckpt", [False, True])
def test_dpo_activations_are_those_of_twice_the_sequences(ckpt: bool) -> None:
    # Unpacked: a micro-batch of 2 pairs is SFT's activations of 4 rows, exactly.
    sft = _shape(pack=False, activation_checkpointing=ckpt)
    dpo = _shape(pack=False, objective="dpo", activation_checkpointing=ckpt)
    assert (dpo.micro_batch, dpo.seq_len) == (4, 1024) and (sft.micro_batch, sft.seq_len) == (
        2,
        1024,
    )
    assert activation_bytes(LLAMA3_8B, dpo) == activation_bytes(
        LLAMA3_8B, replace(sft, micro_batch=4)
    )
    assert activation_bytes(LLAMA3_8B, dpo) > 1.9 * activation_bytes(LLAMA3_8B, sft)
    # Packed: rows of 2 × seq_len (SDPA's mask grows with the row: a bit more than twice).
    sft, dpo = (
        _shape(activation_checkpointing=ckpt),
        _shape(objective="dpo", activation_checkpointing=ckpt),
    )
    assert (dpo.micro_batch, dpo.seq_len) == (2, 2048)
    assert activation_bytes(LLAMA3_8B, dpo) == activation_bytes(
        LLAMA3_8B, replace(sft, seq_len=2048)
    )
    assert activation_bytes(LLAMA3_8B, dpo) >= 2 * activation_bytes(LLAMA3_8B, sft)


def test_dpo_reads_the_full_logits_of_both_sequences() -> None:
    sft, dpo = _shape(), _shape(objective="dpo")
    n, v = 2 * 2 * 1024, LLAMA3_8B.vocab  # tokens of 2 pairs; bf16 logits, fp32 target rows
    head = loss_head_bytes(LLAMA3_8B, dpo)
    assert head == {"forward": n * v * (2 + 4 + 2), "backward": 3 * n * v * 4 + n * v * 2}
    # SFT's chunked loss head holds a few chunks of logits: a small fraction of that.
    assert loss_head_bytes(LLAMA3_8B, sft)["backward"] < head["backward"] / 20
    # The data's target share (prompts are no targets) shrinks the fp32 rows only.
    half = preference_head_bytes(LLAMA3_8B, replace(dpo, target_share=0.5))
    assert half["backward"] == 3 * (n // 2) * v * 4 + n * v * 2


def test_measured_head_bytes_of_sequence_log_probs_match_the_model() -> None:
    """The plain logits path on the CPU (fp32): live tensor bytes at the loss and during its
    backward, beyond the hidden states and lm_head's weight."""
    torch = pytest.importorskip("torch")
    from homelab_dp.train.loop.memtrack import LiveTensors
    from homelab_dp.train.objectives.preference_losses import sequence_log_probs

    spec = spec_from_config({**PUBLISHED["SmolLM-135M"][0], "vocab_size": 2048})
    rows, length, vocab = 4, 64, spec.vocab
    for share in (1.0, 0.5):
        shape = TrainShape(method="lora", distribution="ddp", world_size=1, device="cpu",
                           dtype="fp32", micro_batch=rows, seq_len=length, objective="dpo",
                           target_share=share)  # fmt: skip
        model = preference_head_bytes(spec, shape)
        hidden = torch.randn(rows * length, 64, requires_grad=True)
        weight = torch.randn(vocab, 64)
        labels = torch.randint(0, vocab, (rows, length))
        labels[:, : int(length * (1 - share))] = -100
        sequence = torch.arange(rows)[:, None].expand(rows, length).clone()
        with LiveTensors() as live:
            live.track([hidden, weight], "weights")
            base = live.current
            logits = (hidden @ weight.t()).reshape(rows, length, vocab)
            sums, _ = sequence_log_probs(logits, labels, sequence, rows)
            forward = live.peak - base
            live.reset_peak()
            del logits  # `forward_logps` returns the sums alone: the logits die with it
            sums.sum().backward()
            backward = live.peak - base - hidden.numel() * 4  # the hidden-state gradient
        assert abs(forward - model["forward"]) / model["forward"] < 0.02, (share, forward)
        assert abs(backward - model["backward"]) / model["backward"] < 0.02, (share, backward)


def test_reference_modes() -> None:
    spec = LLAMA3_8B
    # adapters: no second copy; its no-grad forward runs before the policy's and stays below
    # the backward's peak, so the budget is ORPO's (no reference) but for the forward phase.
    adapters = budget(spec, _shape(objective="dpo"))
    orpo = budget(spec, _shape(objective="orpo"))
    assert adapters.total == orpo.total and adapters.weights == orpo.weights
    ref = reference_forward_bytes(spec, _shape(objective="dpo"), 0.0)
    assert ref == preference_head_bytes(spec, _shape(objective="dpo"))["forward"] > 0
    assert reference_forward_bytes(spec, _shape(objective="orpo"), 1e9) == 0
    # copy: the full fine-tune's fp32 weights once more on every device (DDP on 4 × 80 GiB).
    full = {"method": "full", "distribution": "ddp", "activation_checkpointing": True}
    copy = budget(spec, _shape(objective="dpo", reference="copy", **full))
    pre = budget(spec, _shape(objective="dpo", reference="precompute", **full))
    assert copy.weights - pre.weights == spec.params * 4
    assert copy.phases["load"] - pre.phases["load"] == spec.params * 4
    # precompute: nothing but the cached log-probabilities, i.e. ORPO's budget.
    assert pre.total == budget(spec, _shape(objective="orpo", **full)).total
    assert _shape(objective="dpo", **full).reference == "precompute"  # auto, full
    assert _shape(objective="kto").reference == "adapters"  # auto, qlora
    assert _shape(objective="orpo").reference == "none"


def test_kto_forward_phase_counts_its_kl_forward() -> None:
    kto = _shape(
        objective="kto", reference="precompute", method="full", activation_checkpointing=False
    )
    dpo = replace(kto, objective="dpo")
    assert reference_forward_bytes(LLAMA3_8B, kto, 0.0) > 0  # the KL forward, no grad
    assert reference_forward_bytes(LLAMA3_8B, dpo, 0.0) == 0  # precomputed: no forward


def test_the_planner_keeps_to_what_the_reference_allows() -> None:
    small = spec_from_config(PUBLISHED["SmolLM-135M"][0])
    auto = {"method": "auto", "distribution": "auto", "activation_checkpointing": "auto"}
    p = plan(small, _preset(objective="dpo", **auto), TWO_24)
    assert (p.chosen.method, p.chosen.distribution) == ("full", "ddp")  # auto: precompute
    p = plan(small, _preset(objective="dpo", reference="adapters", **auto), TWO_24)
    assert p.chosen.method == "lora" and p.fits  # adapters need adapters
    p = plan(LLAMA3_8B, _preset(objective="dpo", reference="copy", **auto),
             parse_gpus_spec("4x80GiB", 512 * GiB))  # fmt: skip
    assert p.chosen.method == "full" and p.chosen.distribution in ("ddp", "zero1")
