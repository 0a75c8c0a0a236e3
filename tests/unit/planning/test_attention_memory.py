"""The plan counts the attention that runs (issue 32, point 1): where ``homelab_packed`` repeats
grouped-query key/value heads per sample (fp32 or a card below 8.0 on CUDA, so that SDPA's
memory-efficient kernel runs instead of the math one), the saved key/value are query-wide."""

from __future__ import annotations

from homelab_dp.byte_units import GiB
from homelab_dp.planning.memory.device_memory import TrainShape, activation_bytes, kv_repeated
from homelab_dp.planning.model_spec import load_model_spec
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import train_shape
from homelab_dp.presets.preset import preset_from_dict
from tests.conftest import ROOT

LLAMA3_8B = load_model_spec(ROOT / "assets/configs/meta-llama-3-8b")  # 32 query, 8 kv heads


def _shape(**kw) -> TrainShape:
    base = dict(method="lora", distribution="ddp", world_size=1, device="cuda", dtype="fp16",
                micro_batch=2, seq_len=1024, attention="homelab_packed")  # fmt: skip
    return TrainShape(**{**base, **kw})  # type: ignore[arg-type]


def test_repeated_key_value_heads_are_counted_where_they_run() -> None:
    spec = LLAMA3_8B
    assert spec.heads == 32 and spec.kv_heads == 8 and spec.head_dim == 128
    ampere, turing = _shape(), _shape(old_cards=True)
    fp32 = _shape(dtype="fp32")
    assert not kv_repeated(spec, ampere)
    assert kv_repeated(spec, turing) and kv_repeated(spec, fp32)
    assert not kv_repeated(spec, _shape(device="cpu", dtype="fp32"))  # CPU flash takes GQA
    assert not kv_repeated(spec, _shape(old_cards=True, attention="flash_attention_2"))
    tokens = 2 * 1024
    extra = spec.layers * tokens * 2 * (32 - 8) * 128 * 2  # k and v, 24 more heads, fp16
    assert activation_bytes(spec, turing) - activation_bytes(spec, ampere) == extra


def test_the_planner_marks_a_plan_with_cards_below_8_0() -> None:
    preset = preset_from_dict({"model": {"path": "m"}, "data": {"path": "d", "seq_len": 512},
                               "train": {"micro_batch": 1}})  # fmt: skip
    turing = train_shape(preset, parse_gpus_spec("2x11GiB@7.5", 64 * GiB), "lora", "ddp", False)
    ampere = train_shape(preset, parse_gpus_spec("2x24GiB@8.6", 64 * GiB), "lora", "ddp", False)
    unknown = train_shape(preset, parse_gpus_spec("2x24GiB", 64 * GiB), "lora", "ddp", False)
    assert turing.old_cards and not ampere.old_cards and not unknown.old_cards


def test_attention_dropout_scores_are_counted_per_sample_once_the_data_is_read() -> None:
    """GPT-2's attention dropout runs SDPA's math kernel on the CPU, which keeps heads × keys
    scores per token: the whole row under SDPA's mask, each sample's own under homelab_packed
    (issue 33 point 5: counting the row over-estimated packed GPT-2 by 22-24%)."""
    from homelab_dp.data.blocks import Block, attention_span
    from homelab_dp.planning.memory.device_memory import layer_activation_bytes
    from homelab_dp.planning.model_spec import spec_from_config

    spec = spec_from_config({"model_type": "gpt2", "vocab_size": 1200, "n_embd": 96,
                             "n_layer": 4, "n_head": 4, "n_positions": 512})  # fmt: skip
    assert spec.attention_dropout > 0
    # One row of 256: samples of 100, 60 and 64 tokens, then a padding run of 32.
    row = Block(
        [1] * 256,
        [1] * 224 + [-100] * 32,
        [1] * 224 + [0] * 32,
        [*range(100), *range(60), *range(64), *range(32)],
    )
    padded = Block([1] * 256, [1] * 256, [1] * 200 + [0] * 56, list(range(256)))
    span = attention_span([row])
    assert span == (100**2 + 60**2 + 64**2 + 32**2) / 256
    assert attention_span([row, padded]) == (200**2 + 56**2) / 256  # the fuller row
    base = dict(method="full", distribution="ddp", world_size=1, device="cpu", dtype="fp32",
                micro_batch=2, seq_len=256)  # fmt: skip
    unread = TrainShape(**base, attention="homelab_packed")  # type: ignore[arg-type]
    read = TrainShape(**base, attention="homelab_packed", attention_span=span)  # type: ignore[arg-type]
    masked = TrainShape(**base, attention="sdpa", attention_span=span)  # type: ignore[arg-type]
    saved = layer_activation_bytes(spec, read)
    assert layer_activation_bytes(spec, unread) - saved == 3 * 4 * (256 - span) * 4
    assert layer_activation_bytes(spec, masked) == layer_activation_bytes(spec, unread)


def test_a_run_records_its_estimate_for_the_samples_of_its_data(tmp_path) -> None:
    """`app.plan.with_target_share`, as a run prepares (`app.runs.check_data` gives the span):
    a packed GPT-2 on the CPU is budgeted for its samples' attention, not seq_len's."""
    import json

    from homelab_dp.app.plan import make_plan, with_target_share

    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 1200,
        "n_embd": 96, "n_layer": 4, "n_head": 4, "n_positions": 512}))  # fmt: skip
    preset = preset_from_dict({"model": {"path": str(model)},
                               "data": {"path": "d", "seq_len": 256},
                               "train": {"method": "full", "micro_batch": 2}})  # fmt: skip
    planned = make_plan(preset, "cpu:1:16GiB", fetch=False)
    chosen = planned.plan.chosen
    assert chosen.budget.activations > 0 and planned.plan.seq_len == 256
    assert with_target_share(planned, 1.0, 0.0) is planned.plan  # nothing known: unchanged
    read = with_target_share(planned, 1.0, 64.0).chosen.budget
    saved = 4 * 3 * 4 * (256 - 64) * 4 * 2 * 256  # layers × 3 × heads × keys × fp32 × tokens
    assert chosen.budget.tensors - read.tensors == saved
