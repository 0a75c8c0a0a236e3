"""`plan --find-seq-len` and the tiled MLP in the plan: the longest data.seq_len that fits, what
limits it, what would lift it; `train.tiled_mlp` priced per tile and chosen only where it is what
makes the run fit (pure, microseconds a budget)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from homelab_dp.byte_units import GiB
from homelab_dp.planning.memory.device_memory import activation_bytes
from homelab_dp.planning.memory.mlp_tiles import mlp_tile_tokens, mlp_tiles, tiled_mlp_refusal
from homelab_dp.planning.model_spec import load_model_spec
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import evaluate, plan, train_shape
from homelab_dp.planning.seq_len_finder import PART_WORDS, search_seq_len
from homelab_dp.planning.seq_len_search import find_seq_len, tree_choice
from homelab_dp.presets.preset import Preset
from homelab_dp.presets.preset_store import open_preset
from tests.conftest import ROOT

CONFIGS = ROOT / "assets" / "configs"
ONE_24 = parse_gpus_spec("1x24GiB", 64 * GiB)


def _long(model: str, seq_len: int = 65536, **train: object) -> Preset:
    """The shipped 64K preset on another model or with other train settings."""
    sets = [f'model.path="{CONFIGS / model}"', f"data.seq_len={seq_len}"]
    sets += [f"train.{k}={json.dumps(v)}" for k, v in train.items()]
    return open_preset("llama3-8b-qlora-64k-1x24gb", sets)


def test_the_search_finds_the_exact_boundary() -> None:
    assert search_seq_len(lambda n: n <= 78_475) == 78_475
    assert search_seq_len(lambda n: n <= 78_475, granule=64) == 78_464
    assert search_seq_len(lambda n: n <= 5, high=1000) == 5
    assert search_seq_len(lambda n: True, high=1000) == 1000
    assert search_seq_len(lambda n: False) == 0
    calls: list[int] = []
    search_seq_len(lambda n: calls.append(n) or n <= 100_000)
    assert len(calls) <= 2 * 22  # doubling, then bisection


def test_tiles_follow_alsts_rule() -> None:
    assert mlp_tiles(65536, 4096) == 16 and mlp_tile_tokens(65536, 4096) == 4096
    assert mlp_tiles(100, 4096) == 1 and mlp_tile_tokens(100, 4096) == 100
    assert mlp_tiles(4097, 4096) == 2 and mlp_tile_tokens(4097, 4096) == 2049


@pytest.mark.parametrize("model", ["meta-llama-3.1-8b", "qwen3-8b-yarn-128k"])
def test_the_goal_80k_tokens_on_one_24_gib_card(model: str) -> None:
    """Llama-3.1-8B and Qwen3-8B QLoRA, rank 32, micro-batch 1: at least 80K tokens on one
    24 GiB card (docs/big-models.md), with the tiled MLP and the offloaded checkpoints the
    decision tree turns on; the answer is the boundary itself."""
    preset = _long(model)
    spec = load_model_spec(CONFIGS / model)
    found = find_seq_len(spec, preset, ONE_24)
    c = found.chosen
    assert found.max_seq_len >= 80_000 and (c.method, c.distribution) == ("qlora", "ddp")
    assert c.activation_checkpointing and c.tiled_mlp and c.offload_activations
    assert tree_choice(spec, _long(model, found.max_seq_len), ONE_24) is not None
    assert tree_choice(spec, _long(model, found.max_seq_len + 1), ONE_24) is None
    assert c.total_bytes <= c.limit_bytes == ONE_24.budget(0.95)
    assert c.limited_by in PART_WORDS and dict(c.parts)[c.limited_by] == max(dict(c.parts).values())
    doc = found.to_json()
    assert doc["max_seq_len"] == found.max_seq_len == doc["chosen"]["max_seq_len"]
    assert len(doc["candidates"]) == 12
    lora = next(x for x in found.candidates if (x.method, x.distribution) == ("lora", "ddp"))
    assert 0 < lora.max_seq_len < found.max_seq_len  # the 16-bit base leaves less room


def test_what_would_lift_it_is_computed() -> None:
    """With the tiled MLP off and nothing offloaded, the finder names both, each with its own
    longest length, longer than the preset's."""
    spec = load_model_spec(CONFIGS / "meta-llama-3.1-8b")
    preset = _long("meta-llama-3.1-8b", tiled_mlp="off", offload_activations=False)
    found = find_seq_len(spec, preset, ONE_24)
    lifts = {lift.setting.split(" ")[0]: lift.max_seq_len for lift in found.lifts}
    assert lifts["train.tiled_mlp"] > found.max_seq_len
    assert lifts["train.offload_activations"] > found.max_seq_len
    assert any("sequence_parallel" in lift.setting for lift in found.lifts)
    text = "\n".join(found.reasons())
    assert f"{found.max_seq_len:,} tokens" in text and "Would lift it" in text
    # what limits it here: the checkpointed layer inputs and the MLP intermediate are on the card
    parts = dict(found.chosen.parts)
    assert "checkpoints" in parts and "mlp" in parts


def test_tiled_mlp_is_chosen_only_where_untiled_does_not_fit() -> None:
    spec = load_model_spec(CONFIGS / "meta-llama-3.1-8b")
    short = plan(spec, _long("meta-llama-3.1-8b", 8192), ONE_24)
    assert short.fits and not short.chosen.tiled_mlp
    long = plan(spec, _long("meta-llama-3.1-8b", 98304), ONE_24)
    assert long.fits and long.chosen.tiled_mlp and long.to_json()["tiled_mlp"] is True
    untiled = plan(spec, _long("meta-llama-3.1-8b", 98304, tiled_mlp="off"), ONE_24)
    assert not untiled.fits


def test_the_budget_prices_one_tile_not_the_sequence() -> None:
    """Without checkpointing the MLP's four intermediate tensors leave every layer's saved
    activations: 32 layers × 4 × 14,336 × 2 bytes per token, in bf16."""
    spec = load_model_spec(CONFIGS / "meta-llama-3.1-8b")
    preset = _long("meta-llama-3.1-8b", 8192)
    off = evaluate(spec, preset, ONE_24, "qlora", "ddp", False, tiled_mlp=False)
    on = evaluate(spec, preset, ONE_24, "qlora", "ddp", False, tiled_mlp=True)
    assert on.tiled_mlp and not off.tiled_mlp
    shapes = [train_shape(preset, ONE_24, "qlora", "ddp", False, tiled_mlp=t) for t in (0, 1)]
    saved = activation_bytes(spec, shapes[0]) - activation_bytes(spec, shapes[1])
    mlp = 32 * 4 * 14336 * 2 * 8192
    lora_outputs = 32 * 3 * 32 * 2 * 8192  # gate, up and down's lora_A outputs, r = 32
    assert saved == mlp + lora_outputs
    # The peak falls by that less one tile's MLP in backward (4,096 tokens of 8,192).
    peak = off.budget.phases["backward"] - on.budget.phases["backward"]
    assert 0.95 * saved < peak < saved


def test_the_models_positions_cap_the_answer() -> None:
    """Qwen3-8B's published config stops at 40,960 positions: the card would hold more, but a
    run refuses a longer data.seq_len, so the finder says 40,960 and why."""
    spec = load_model_spec(CONFIGS / "qwen3-8b")
    found = find_seq_len(spec, _long("qwen3-8b"), ONE_24)
    assert found.max_seq_len == spec.max_positions == 40960
    assert found.chosen.limited_by == "positions"
    assert any("40,960 positions" in r for r in found.reasons())


def test_moe_mlps_stay_untiled() -> None:
    spec = load_model_spec(CONFIGS / "qwen3-30b-a3b")
    assert "MoE" in tiled_mlp_refusal(spec)
    preset = _long("qwen3-30b-a3b", 4096, tiled_mlp="on")
    p = plan(spec, preset, parse_gpus_spec("2x24GiB", 64 * GiB))
    assert not p.chosen.tiled_mlp and not any(c.tiled_mlp for c in p.candidates)
    assert any(r.startswith("train.tiled_mlp = 'on': a MoE model") for r in p.reasons)


def test_plan_command_finds_the_seq_len(in_repo, capsys) -> None:
    from homelab_dp.cli import main

    assert main(["plan", "tiny-demo", "--find-seq-len", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    found = doc["seq_len_finder"]
    assert found["max_seq_len"] > doc["training"]["seq_len"] and doc["micro_batch_finder"] is None
    assert {(c["method"], c["distribution"]) for c in found["candidates"]} >= {("full", "ddp")}
    assert any(r.startswith("Sequence-length finder:") for r in doc["reasons"])
    assert main(["plan", "tiny-demo", "--find-seq-len"]) == 0
    text = capsys.readouterr().out
    assert "sequence-length finder:" in text and "lora · ddp:" in text
    assert main(["plan", "tiny-demo", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_len_finder"] is None


def test_the_run_spec_records_the_decision(in_repo) -> None:
    """The worker tiles only what the planner decided (`Resolved.tiled_mlp`, read by
    `train.loop.rank_setup`): on for the demo at 2 × 512 tokens (8 tiles of 128) when asked, off when
    not, and never for a micro-batch of one tile."""
    from homelab_dp.app.runs import make_controller
    from homelab_dp.runs.run_spec import Resolved

    controller = make_controller()
    sets = ["data.seq_len=512", "train.micro_batch=2", 'train.method="lora"']
    on = controller.prepare("tiny-demo", overrides=[*sets, 'train.tiled_mlp="on"']).resolved
    off = controller.prepare("tiny-demo", overrides=[*sets, 'train.tiled_mlp="off"']).resolved
    short = controller.prepare(
        "tiny-demo", overrides=["data.seq_len=64", "train.micro_batch=1", 'train.tiled_mlp="on"']
    ).resolved
    assert on.tiled_mlp and not off.tiled_mlp and not short.tiled_mlp
    assert Resolved(**asdict(on)) == on  # spec.json's "resolved" block reads back


def test_the_time_model_prices_the_recompute() -> None:
    """A tiled MLP runs each layer's MLP forward once more (with its adapters): 2 FLOPs a
    weight of gate, up and down, and of their rank-32 adapters, per token and layer."""
    from homelab_dp.planning.time_model import step_flops_per_token

    spec = load_model_spec(CONFIGS / "meta-llama-3.1-8b")
    preset = _long("meta-llama-3.1-8b", 8192)
    flops = [step_flops_per_token(spec, train_shape(preset, ONE_24, "qlora", "ddp", True,
                                                    tiled_mlp=t)) for t in (False, True)]  # fmt: skip
    mlp = 3 * 4096 * 14336
    adapters = 3 * 32 * (4096 + 14336)
    assert flops[1] - flops[0] == pytest.approx(32 * 2 * (mlp + adapters), rel=1e-12)


def test_on_two_cards_a_split_lifts_it_to_the_models_positions() -> None:
    """Two 24 GiB cards: one card's longest (~97K for Qwen3-8B with YaRN) is lifted by
    `train.sequence_parallel = 2`, computed, up to the model's 131,072 positions; the 2-card
    preset shipped at that length plans it split and fitting."""
    two = parse_gpus_spec("2x24GiB", 64 * GiB)
    spec = load_model_spec(CONFIGS / "qwen3-8b-yarn-128k")
    found = find_seq_len(spec, _long("qwen3-8b-yarn-128k"), two)
    split = {lift.setting: lift.max_seq_len for lift in found.lifts}
    assert 80_000 <= found.max_seq_len < 131_072
    assert split["train.sequence_parallel = 2"] == 131_072 == spec.max_positions
    shipped = open_preset("llama3-8b-qlora-128k-2x24gb")
    planned = plan(load_model_spec(CONFIGS / "meta-llama-3.1-8b"), shipped, two)
    assert planned.fits and planned.sequence_parallel == 2 and planned.seq_len == 131_072
