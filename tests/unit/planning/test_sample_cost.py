"""The time samples while training add to a run (`planning.sample_cost`): how many rounds each
``train.sample_every`` gives, and the seconds from the model's forward FLOPs and the run's
training FLOP/s."""

from __future__ import annotations

import pytest

from homelab_dp.planning.flops import causal_span, flops_per_token, linear_matmul_params
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.planning.sample_cost import (
    forward_flops_per_token,
    planned_sample_seconds,
    sample_plan,
    sample_seconds,
    sampling_rounds,
)
from homelab_dp.train.loop.sample_answers import sample_due
from tests.unit.planning.test_model_spec import PUBLISHED

LLAMA3_8B = spec_from_config(PUBLISHED["Meta-Llama-3-8B"][0])


@pytest.mark.parametrize(
    ("every", "total", "eval_every", "has_eval"),
    [(2, 7, 0, False), (3, 9, 0, False), (5, 3, 0, False), ("eval", 10, 3, True),
     ("eval", 10, 0, True), ("eval", 10, 3, False), ("off", 10, 3, True), (0, 10, 0, False)],
)  # fmt: skip
def test_rounds_are_the_steps_the_worker_samples_at(every, total, eval_every, has_eval) -> None:
    evaluated = [
        has_eval and (s == total or (eval_every > 0 and s % eval_every == 0))
        for s in range(1, total + 1)
    ]  # fmt: skip (the Validator's rule)
    worker = sum(
        sample_due(every, s, total, evaluated=evaluated[s - 1]) for s in range(1, total + 1)
    )
    assert sampling_rounds(every, total, eval_every=eval_every, has_eval=has_eval) == worker


def test_seconds_are_the_generated_tokens_forward_flops_at_the_training_flop_rate() -> None:
    fwd = forward_flops_per_token(LLAMA3_8B, 64)
    attention = 2 * 2 * 32 * 4096 * causal_span(64)
    assert fwd == 2 * linear_matmul_params(LLAMA3_8B) + attention  # ~2N: 15 GFLOP a token
    train = flops_per_token(LLAMA3_8B, method="lora", activation_checkpointing=True,
                            attention_span=causal_span(2048))  # fmt: skip
    # 3 prompts of 16 tokens and 48 new ones, 5 times, at 2,000 training tokens/s
    seconds = sample_seconds(LLAMA3_8B, rounds=5, prompts=3, prompt_tokens=16, max_tokens=48,
                             train_tokens_per_s=2000.0, train_flops_per_token=train)  # fmt: skip
    assert seconds == pytest.approx(5 * 3 * 64 * fwd / (2000.0 * train))
    assert 0.1 < seconds < 0.2  # a forward costs about a fifth of a trained LoRA token here
    zero = dict(rounds=5, prompts=3, prompt_tokens=16, max_tokens=48, train_flops_per_token=train)
    assert sample_seconds(LLAMA3_8B, train_tokens_per_s=0.0, **zero) == 0.0  # throughput unknown
    assert sample_seconds(LLAMA3_8B, train_tokens_per_s=1.0, **{**zero, "rounds": 0}) == 0.0


def test_a_presets_sample_time_counts_its_rounds_and_prompts(tmp_path) -> None:
    from homelab_dp.presets.preset import preset_from_dict

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n\nthree\nfour\n", encoding="utf-8")
    kw = {"train_tokens_per_s": 1000.0, "train_flops_per_token": 6e9}

    def preset(data: dict, train: dict):
        return preset_from_dict({"model": {"path": "m"}, "data": {"path": "d.jsonl", **data},
                                 "train": train})  # fmt: skip

    one = sample_seconds(LLAMA3_8B, rounds=1, prompts=1, prompt_tokens=64, max_tokens=48, **kw)
    p = preset({"sample_prompts": str(prompts)}, {"sample_every": 25})
    assert planned_sample_seconds(LLAMA3_8B, p, 100, **kw) == pytest.approx(4 * 4 * one)
    p = preset({"eval_fraction": 0.1}, {"eval_every": 50})  # default: with each eval, 3 prompts
    assert planned_sample_seconds(LLAMA3_8B, p, 100, **kw) == pytest.approx(2 * 3 * one)
    assert planned_sample_seconds(LLAMA3_8B, preset({}, {}), 100, **kw) == 0.0  # no eval data


def test_the_plans_samples_block_counts_rounds_and_prices_them_at_the_recorded_speed() -> None:
    """`plan --json`'s ``samples``: none when the run samples nothing; rounds and prompts from
    the preset; seconds only with the recorded tokens/s and a step count."""
    from homelab_dp.presets.preset import preset_from_dict

    def preset(data: dict, train: dict):  # type: ignore[no-untyped-def]
        return preset_from_dict({"model": {"path": "m"}, "data": {"path": "d.jsonl", **data},
                                 "train": train})  # fmt: skip

    kw = dict(method="lora", activation_checkpointing=True)
    off = preset({}, {"sample_every": "off"})
    assert sample_plan(LLAMA3_8B, off, steps=100, train_tokens_per_s=900.0, **kw) is None
    no_eval = preset({}, {})  # "eval" without eval data: nothing to sample with
    assert sample_plan(LLAMA3_8B, no_eval, steps=100, train_tokens_per_s=900.0, **kw) is None
    every = preset({"sample_prompts": ["a", "b"]}, {"sample_every": 30, "sample_max_tokens": 20})
    block = sample_plan(LLAMA3_8B, every, steps=100, train_tokens_per_s=None, **kw)
    assert block == {"rounds": 4, "prompts": 2, "max_tokens": 20, "seconds": None}  # 30,60,90,100
    priced = sample_plan(LLAMA3_8B, every, steps=100, train_tokens_per_s=900.0, **kw)
    per_token = flops_per_token(LLAMA3_8B, method="lora", activation_checkpointing=True,
                                attention_span=causal_span(256), lora_r=16)  # fmt: skip
    want = planned_sample_seconds(LLAMA3_8B, every, 100, train_tokens_per_s=900.0,
                                  train_flops_per_token=per_token)  # fmt: skip
    assert priced is not None and priced["seconds"] == pytest.approx(want) and want > 0
    epochs = sample_plan(LLAMA3_8B, every, steps=0, train_tokens_per_s=900.0, **kw)
    assert epochs == {"rounds": None, "prompts": 2, "max_tokens": 20, "seconds": None}
