"""GRPO's memory and generation time against figures known independently of the model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from homelab_dp.byte_units import GiB
from homelab_dp.planning.memory.device_memory import loss_head_bytes
from homelab_dp.planning.memory.grpo_memory import (
    completion_logits_bytes,
    generation_seconds,
    grpo_cost,
    grpo_knobs,
    kv_cache_bytes,
)
from homelab_dp.planning.memory.train_shape import plain_logits
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import train_shape
from homelab_dp.presets.preset import preset_from_dict
from tests.conftest import run_cli
from tests.unit.planning.test_model_spec import PUBLISHED

LLAMA3_8B = spec_from_config(PUBLISHED["Meta-Llama-3-8B"][0])
KIB = 1024


def _cost(**kw):
    settings = dict(generations=8, prompt_tokens=256, max_completion_tokens=512,
                    prompts_per_micro=1, prompts_per_rank=4, width=2, beta=0.0, iterations=1,
                    weight_bytes=16e9, bandwidth=1e12, train_s=10.0)  # fmt: skip
    settings.update(kw)
    return grpo_cost(LLAMA3_8B, **settings)


def test_the_kv_cache_is_llama3_8bs_128_kib_a_token_for_every_generation() -> None:
    # 32 layers × 8 KV heads × 128 dims × (K, V) × 2 bytes = 128 KiB per token in bf16
    assert kv_cache_bytes(LLAMA3_8B, 1, 1, 2) == 128 * KIB
    assert kv_cache_bytes(LLAMA3_8B, 8, 256 + 512, 2) == 8 * 768 * 128 * KIB
    assert _cost().kv_cache == 8 * 768 * 128 * KIB
    windowed = replace(LLAMA3_8B, sliding_window=128, sliding_layers=16)  # half the layers
    assert kv_cache_bytes(windowed, 1, 768, 2) == (16 * 768 + 16 * 128) * 4 * KIB


def test_the_completions_logits_grow_with_generations_and_length() -> None:
    v = LLAMA3_8B.vocab
    got = completion_logits_bytes(LLAMA3_8B, 8, 768, 512, 2)
    # forward: bf16 logits of every token, the completion rows in fp32 and their bf16 gather
    assert got["forward"] == 8 * 768 * v * 2 + 8 * 512 * v * 4 + 8 * 512 * v * 2
    assert got["backward"] == 3 * 8 * 512 * v * 4 + 8 * 768 * v * 2
    assert _cost(generations=4).completion_logits * 2 == _cost().completion_logits


def test_reference_and_old_log_probs_only_when_asked() -> None:
    plain = _cost()
    assert plain.reference == 0 and plain.old_logps == 0
    with_ref = _cost(beta=0.04)
    head = completion_logits_bytes(LLAMA3_8B, 8, 768, 512, 2)["forward"]
    assert with_ref.reference == head + 8 * 512 * 4  # its logits head, then fp32 log-probs
    again = _cost(iterations=2)
    # fp32 per completion token, for every prompt the rank generates for in the step
    assert again.old_logps == 4 * 8 * 512 * 4
    assert again.peak_extra == again.completion_logits + again.old_logps


def test_generation_is_bandwidth_bound_and_its_share_is_reported() -> None:
    cost = _cost()
    # each of 4 groups × 512 tokens reads the 16 GB of weights and the mean cache at 1 TB/s
    mean_cache = kv_cache_bytes(LLAMA3_8B, 8, 256 + 256, 2)
    assert cost.generation_s == pytest.approx(4 * 512 * (16e9 + mean_cache) / 1e12)
    assert cost.generation_share == pytest.approx(cost.generation_s / (cost.generation_s + 10))
    faster = _cost(bandwidth=2e12)
    assert faster.generation_s == pytest.approx(cost.generation_s / 2)
    assert generation_seconds(LLAMA3_8B, weight_bytes=5e9, groups=1, generations=1,
                              prompt_tokens=0, completion_tokens=1, width=2,
                              bandwidth=1e9) == pytest.approx(5.0)  # fmt: skip
    assert cost.to_json()["engine"] == "transformers"


def test_the_knobs_of_a_plan_that_does_not_fit() -> None:
    cost = _cost()
    knobs = grpo_knobs(LLAMA3_8B, cost, 2**30, generations=8, max_completion_tokens=512,
                       method="lora")  # fmt: skip
    assert [k.split(" ")[0] for k in knobs] == ["grpo.generations", "grpo.max_completion_tokens",
                                                "train.method"]  # fmt: skip
    assert "grpo.generations = 4" in knobs[0]
    assert grpo_knobs(LLAMA3_8B, cost, 0, generations=8, max_completion_tokens=512,
                      method="lora") == []  # fmt: skip
    qlora = grpo_knobs(LLAMA3_8B, cost, 1, generations=2, max_completion_tokens=32,
                       method="qlora")  # fmt: skip
    assert qlora == []


def test_the_planner_budgets_a_prompts_completions_as_rows_of_full_logits() -> None:
    preset = preset_from_dict({
        "model": {"path": "m"}, "data": {"path": "d", "seq_len": 256},
        "train": {"objective": "grpo", "micro_batch": 2},
        "grpo": {"generations": 8, "max_completion_tokens": 512, "rewards": ["exact_answer"]},
    })  # fmt: skip
    hw = parse_gpus_spec("2x24GiB", 64 * GiB)
    shape = train_shape(preset, hw, "qlora", "ddp", True)
    assert (shape.micro_batch, shape.seq_len) == (16, 768)  # 2 prompts × 8 rows of 256 + 512
    assert shape.target_share == pytest.approx(512 / 768)  # only completion tokens normalised
    assert plain_logits(shape)
    head = loss_head_bytes(LLAMA3_8B, shape)
    n, t, v = 16 * 768, 16 * 512, LLAMA3_8B.vocab
    assert head["forward"] == n * v * 2 + t * v * 4 + t * v * 2  # logits, fp32 rows, bf16 gather


def test_the_plan_names_the_engine_and_the_generation_cache(
    in_repo: object, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_cli(capsys, "plan", "qwen3-8b-grpo-qlora-2x24gb", "--gpus", "2x24GiB",
                           "--json")  # fmt: skip
    assert rc == 0, err
    reasons = " ".join(json.loads(out)["reasons"])
    # Qwen3-8B: 36 layers × 8 KV heads × 128 dims × (K, V) × 2 bytes = 144 KiB a token
    assert "with transformers (the weights being trained, adapters on)" in reasons
    assert f"8 × (256 + 512) tokens = {8 * 768 * 144 // 1024:,} MiB" in reasons
    assert "Effective batch 8 prompts" in reasons
