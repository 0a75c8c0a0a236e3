"""Sequence parallelism in the plan (`homelab_dp.planning.sequence_split`): the checks, the
per-rank memory, the all-to-all's bytes and seconds, and ``auto``'s branch of the tree."""

from __future__ import annotations

from dataclasses import replace

import pytest

from homelab_dp.byte_units import GiB
from homelab_dp.errors import PresetError
from homelab_dp.planning import sequence_split as split
from homelab_dp.planning.model_layers import LayerGroup, LayerKind, Mixer
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import plan
from homelab_dp.planning.time_model import comm_parts
from homelab_dp.presets.preset import preset_from_dict
from tests.unit.planning.test_model_spec import PUBLISHED

LLAMA3_8B = spec_from_config(PUBLISHED["Meta-Llama-3-8B"][0])  # 32 heads, 8 KV heads


def _preset(seq_len: int = 8192, sp: int | str = 2, **train):
    return preset_from_dict({
        "model": {"path": "m"},
        "data": {"path": "d", "seq_len": seq_len},
        "train": {"method": "qlora", "distribution": "ddp", "micro_batch": 1, "grad_accum": 1,
                  "sequence_parallel": sp, **train},
    })  # fmt: skip


def _hybrid(kind: str):
    """Llama-3-8B with every third layer's attention swapped for a ``kind`` mixer."""
    attention = LLAMA3_8B.layer_groups[0]
    other = LayerGroup(LayerKind((Mixer(kind, ()),), attention.kind.mlp), 10)
    return replace(LLAMA3_8B, blocks=(replace(attention, count=22), other))


@pytest.mark.parametrize(
    ("preset", "world", "needle"),
    [
        (_preset(sp=4), 2, "train.sequence_parallel = 4 is above the world size (2 processes)"),
        (_preset(sp=2), 3, "train.sequence_parallel = 2 does not divide the world size (3"),
        (_preset(seq_len=8191), 2, "does not divide data.seq_len = 8191"),
        (_preset(sp=3, seq_len=8190), 3, "does not divide the 32 attention heads of llama"),
        (_preset(objective="dpo"), 2, "splits SFT sequences only"),
    ],
)
def test_a_degree_that_cannot_split_is_refused(preset, world, needle) -> None:
    with pytest.raises(PresetError) as err:
        split.check_split(LLAMA3_8B, preset, world)
    assert needle in err.value.message and err.value.hint


@pytest.mark.parametrize("kind", ["linear_attention", "mamba2", "short_conv"])
def test_families_with_state_carrying_mixers_are_refused_with_the_reason(kind) -> None:
    spec = _hybrid(kind)
    with pytest.raises(PresetError) as err:
        split.check_split(spec, _preset(seq_len=256), 2)
    assert f"has {kind} layers, which carry a state from token to token" in err.value.message
    assert split.candidate_degrees(spec, _preset(seq_len=256, sp="auto"), 2) == [1]


def test_off_and_auto_are_never_refused() -> None:
    split.check_split(LLAMA3_8B, _preset(sp=1, seq_len=8191), 1)
    split.check_split(LLAMA3_8B, _preset(sp="auto", seq_len=8191), 3)


def test_all_to_all_bytes_count_q_k_v_and_the_output_per_layer_and_pass() -> None:
    s = LLAMA3_8B
    got = split.all_to_all_bytes(s, degree=2, micro_batch=1, local_len=4096, width=2,
                                 checkpointing=True)  # fmt: skip
    per_token = (s.heads + s.kv_heads + s.kv_heads + s.heads) * s.head_dim * 2  # bf16
    assert got == 3 * s.layers * 4096 * per_token / 2  # forward, recompute, backward; half sent
    # 1 KV head over 4 ranks: repeated ×4, so k and v travel at 4 heads each
    one_kv = spec_from_config({**PUBLISHED["Meta-Llama-3-8B"][0], "num_key_value_heads": 1})
    got = split.all_to_all_bytes(one_kv, degree=4, micro_batch=1, local_len=10, width=4,
                                 checkpointing=False)  # fmt: skip
    assert got == 2 * one_kv.layers * 10 * (32 + 4 + 4 + 32) * 128 * 4 * 3 / 4


def test_the_split_halves_per_rank_activations_and_adds_the_all_to_all() -> None:
    hw = parse_gpus_spec("2x24GiB", 64 * GiB)
    # the MLP untiled in both: the split alone halves each rank's tokens
    whole = plan(LLAMA3_8B, _preset(seq_len=32768, sp=1, tiled_mlp="off"), hw)
    halves = plan(LLAMA3_8B, _preset(seq_len=32768, sp=2, tiled_mlp="off"), hw)
    assert halves.sequence_parallel == 2 and whole.sequence_parallel == 1
    c_whole = next(c for c in whole.candidates if (c.method, c.distribution,
                   c.activation_checkpointing) == ("qlora", "ddp", True))  # fmt: skip
    c_half = next(c for c in halves.candidates if (c.method, c.distribution,
                  c.activation_checkpointing) == ("qlora", "ddp", True))  # fmt: skip
    ratio = c_half.budget.activations / c_whole.budget.activations
    assert 0.45 < ratio < 0.55, ratio  # seq_len / 2 tokens a rank
    assert c_half.budget.weights == c_whole.budget.weights
    assert halves.effective_batch == 1 and whole.effective_batch == 2  # one data rank
    doc = halves.to_json()["training"]
    assert doc["sequence_parallel"] == 2 and doc["seq_len"] == 32768
    assert any(
        r.startswith("Sequence parallelism: every sequence of 32768") for r in halves.reasons
    )


def test_the_time_model_prices_the_all_to_all_on_the_link() -> None:
    from homelab_dp.planning.planner import train_shape

    hw = parse_gpus_spec("2x24GiB", 64 * GiB)
    shape = train_shape(_preset(seq_len=32768), hw, "qlora", "ddp", True)
    assert shape.seq_len == 16384 and shape.sequence_parallel == 2
    parts = {p.name: p for p in comm_parts(LLAMA3_8B, shape)}
    a2a = parts["all-to-all (sequence)"]
    assert a2a.per_micro_step and a2a.overlaps == "none" and a2a.exposed_share == 1.0
    assert a2a.bytes_per_step == split.all_to_all_bytes(
        LLAMA3_8B, degree=2, micro_batch=1, local_len=16384, width=2, checkpointing=True
    )
    whole = train_shape(_preset(seq_len=32768, sp=1), hw, "qlora", "ddp", True)
    assert "all-to-all (sequence)" not in {p.name for p in comm_parts(LLAMA3_8B, whole)}


def test_auto_splits_only_a_sequence_that_does_not_fit_one_card() -> None:
    hw = parse_gpus_spec("2x24GiB", 64 * GiB)
    short = plan(LLAMA3_8B, _preset(seq_len=16384, sp="auto"), hw)
    assert short.sequence_parallel == 1 and short.fits
    # 128K tokens: whole, not even with the MLP tiled and the checkpoints offloaded (one card
    # holds about 100K); split over the two cards, it fits
    whole = plan(LLAMA3_8B, _preset(seq_len=131072, sp=1), hw)
    assert not whole.fits or whole.chosen.offload != "none"
    long = plan(LLAMA3_8B, _preset(seq_len=131072, sp="auto"), hw)
    assert long.sequence_parallel == 2 and long.fits and long.chosen.offload != "params"
    assert any("auto split it (before offloading the parameters)" in r for r in long.reasons)
    # one card: nothing to split over
    one = plan(LLAMA3_8B, _preset(seq_len=131072, sp="auto"), parse_gpus_spec("24GiB", 64 * GiB))
    assert one.sequence_parallel == 1


def test_calibration_keys_of_whole_sequences_stay_as_before() -> None:
    """A measurement stored before sequence parallelism existed still matches a plan without
    it; a split is its own configuration."""
    from homelab_dp.planning.memory.memory_calibration import config_key
    from homelab_dp.planning.planner import train_shape

    hw = parse_gpus_spec("2x24GiB", 64 * GiB)
    whole = config_key({}, train_shape(_preset(sp=1), hw, "qlora", "ddp", True))["shape"]
    halves = config_key({}, train_shape(_preset(sp=2), hw, "qlora", "ddp", True))["shape"]
    assert "sequence_parallel" not in whole and halves["sequence_parallel"] == 2
    assert halves["seq_len"] == whole["seq_len"] // 2


def test_the_plan_head_line_counts_the_data_ranks() -> None:
    from homelab_dp.render.plan import data_ranks, split_words

    hw = parse_gpus_spec("2x24GiB", 64 * GiB)
    t = plan(LLAMA3_8B, _preset(seq_len=32768, sp=2), hw).to_json()["training"]
    assert data_ranks(t) == "1 data rank(s) of 2 device(s)" and split_words(t) == " split over 2"
    t = plan(LLAMA3_8B, _preset(seq_len=32768, sp=1), hw).to_json()["training"]
    assert data_ranks(t) == "2 device(s)" and split_words(t) == ""


def test_the_micro_batch_finder_takes_the_degree_auto_picks() -> None:
    from homelab_dp.planning.planner import plan_largest_micro_batch

    hw = parse_gpus_spec("2x24GiB", 64 * GiB)
    found = plan_largest_micro_batch(LLAMA3_8B, _preset(seq_len=131072, sp="auto"), hw)
    assert found.sequence_parallel == 2 and found.fits and found.fit is not None
    assert found.fit.world_size == 1  # one data rank: the two cards hold one sequence


def test_the_smaller_micro_batch_advice_counts_only_the_data_ranks() -> None:
    """Two ranks on one split sequence are one data rank: the advice's effective batch is the
    plan's (micro-batch × data ranks × accumulation), not one counted over every process."""
    preset = _preset(micro_batch=4, grad_accum=2, method="qlora", distribution="ddp",
                     activation_checkpointing=False, offload="none", offload_activations=False,
                     tiled_mlp="off")  # fmt: skip
    p = plan(LLAMA3_8B, preset, parse_gpus_spec("2x40GiB", 256 * GiB))
    assert not p.fits and p.effective_batch == 4 * 1 * 2
    (advice,) = [a for a in p.advice if a.startswith("Smaller micro-batch")]
    assert advice.endswith("train.grad_accum = 8 (effective batch 8).")
