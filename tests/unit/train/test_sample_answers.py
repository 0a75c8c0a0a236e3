"""Samples while training without processes (`train.loop.sample_answers`, `data.sample_prompts`): when,
which prompts, that generation leaves the random states and module modes as they were, and that
the KV-cache decoding is what transformers' generate does. The run:
tests/integration/test_samples.py."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from homelab_dp.data.blocks import build_blocks
from homelab_dp.data.sample_prompts import read_sample_prompts
from homelab_dp.data.tokenize import format_instruction, tokenize_records
from homelab_dp.errors import DataError
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.train.evaluation.eval_loss import eval_blocks
from homelab_dp.train.loop.sample_answers import (
    Sampler,
    choose_prompts,
    data_prompt_ids,
    decode,
    evaluating,
    preserved_rng,
    sample_due,
)
from tests.conftest import ROOT

MODEL = ROOT / "assets" / "models" / "tiny-llama"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def small_model(tok) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, attention_dropout=0.5,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    return LlamaForCausalLM(config)


def test_due_with_each_eval_every_n_and_at_the_last() -> None:
    assert [s for s in range(1, 8) if sample_due(3, s, 7, evaluated=False)] == [3, 6, 7]
    assert [s for s in range(1, 8) if sample_due("eval", s, 7, evaluated=s in (2, 7))] == [2, 7]
    assert not any(sample_due("off", s, 7, evaluated=True) for s in range(1, 8))
    assert not any(sample_due(0, s, 7, evaluated=True) for s in range(1, 8))
    assert sample_due(3, 4, 7, evaluated=True, ending=True)  # an early stop is the end


def _blocks(tok, records, fmt: str, pack: bool):
    examples = tokenize_records(records, fmt, tok)
    return examples, eval_blocks(
        build_blocks(examples, 48, pack, tok.pad_token_id, split=fmt == "text"), pack
    )


@pytest.mark.parametrize("pack", [True, False])
def test_data_prompts_are_each_samples_tokens_before_its_answer(tok, pack: bool) -> None:
    records = [{"instruction": f"Say {w}.", "output": f"{w} {w}"} for w in ("red", "blue", "green",
                                                                           "pink")]  # fmt: skip
    examples, b = _blocks(tok, records, "instruction", pack)
    got = data_prompt_ids(b.input_ids, b.labels, b.positions, b.mask)
    wanted = [list(tok(format_instruction(r["instruction"]))["input_ids"]) for r in records]
    assert len(got) == 3 and all(g in wanted for g in got)
    for g in got:  # the prompt is exactly the part without loss, in the example
        ex = next(e for e in examples if e.input_ids[: len(g)] == g)
        first_target = next(i for i, t in enumerate(ex.labels) if t != -100)
        assert len(g) == first_target


def test_text_prompts_are_the_first_tokens_at_most_half(tok) -> None:
    records = [{"text": "one two three four five six seven eight nine ten " * 2}, {"text": "hi"}]
    examples, b = _blocks(tok, records, "text", True)
    got = data_prompt_ids(b.input_ids, b.labels, b.positions, b.mask)
    lengths = sorted(len(e.input_ids) - 1 for e in examples)  # inputs per packed sample
    assert sorted(len(g) for g in got) == [max(1, min(16, n // 2)) for n in lengths]


def test_given_prompts_win_and_render_as_the_run_trains(tok, tmp_path: Path) -> None:
    data = SimpleNamespace(tokenizer=tok, fmt="instruction", eval=None)
    (p,) = choose_prompts(["Name a colour."], data)
    assert p.text == "Name a colour."
    assert p.ids == list(tok(format_instruction("Name a colour."))["input_ids"])
    data.fmt = "completion"
    assert choose_prompts(["Once"], data)[0].ids == list(tok("Once")["input_ids"])
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n', encoding="utf-8")
    assert [p.text for p in choose_prompts(str(file), data)] == ["a", "b"]


def test_eval_data_prompts_before_the_training_data(tok) -> None:
    _, train = _blocks(tok, [{"instruction": "train me", "output": "x"}], "instruction", True)
    _, ev = _blocks(tok, [{"instruction": "eval me", "output": "y"}], "instruction", True)
    data = SimpleNamespace(
        tokenizer=tok, fmt="instruction", eval=ev, input_ids=train.input_ids,
        labels=train.labels, positions=train.positions, mask=train.mask,
    )  # fmt: skip
    assert [p.text for p in choose_prompts([], data)] == [format_instruction("eval me")]
    data.eval = None
    assert [p.text for p in choose_prompts([], data)] == [format_instruction("train me")]


@pytest.mark.parametrize(
    ("content", "suffix", "where"),
    [("a\n", ".csv", ".txt nor a .jsonl"), ('{"prompt": "a"}\nnope\n', ".jsonl", "p.jsonl:2"),
     ('{"text": "a"}\n', ".jsonl", "p.jsonl:1"), ("\n\n", ".txt", "holds no prompt")],
)  # fmt: skip
def test_bad_prompt_files_name_the_field_file_and_line(
    tmp_path: Path, content: str, suffix: str, where: str
) -> None:
    path = tmp_path / f"p{suffix}"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_sample_prompts(str(path))
    assert "data.sample_prompts" in err.value.message and where in err.value.message
    assert err.value.hint
    with pytest.raises(DataError, match="missing|cannot read"):
        read_sample_prompts(str(tmp_path / "missing.txt"))
    with pytest.raises(DataError, match=r"sample_prompts\[1\]"):
        read_sample_prompts(["ok", "  "])


def test_decode_is_what_generate_does_greedily(tok, small_model) -> None:
    prompt = list(tok(format_instruction("Say red."))["input_ids"])
    small_model.eval()
    eos = {tok.eos_token_id}
    new = decode(small_model, prompt, max_tokens=10, eos=eos, device=torch.device("cpu"))
    out = small_model.generate(
        torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    assert new == out[0, len(prompt) :].tolist() and len(new) >= 1


def test_generation_leaves_random_states_and_modes_as_they_were(tok, small_model) -> None:
    """Sampled at temperature 1 through the `Sampler` (dropout 0.5 would draw in train mode):
    every random state and each module's own flag come back; the text repeats for the step."""
    small_model.train()
    small_model.model.layers[0].eval()  # a module in its own mode stays in it
    preset = preset_from_dict({"model": {"path": str(MODEL)}, "data": {"path": "x.jsonl",
        "sample_prompts": ["Say red."]}, "train": {"sample_every": 1, "sample_max_tokens": 6,
        "sample_temperature": 1.0, "seed": 3}})  # fmt: skip
    data = SimpleNamespace(tokenizer=tok, fmt="instruction", eval=None)
    model = SimpleNamespace(strategy=SimpleNamespace(inner=small_model),
                            autocast=lambda: torch.autocast("cpu", enabled=False))  # fmt: skip
    rank = SimpleNamespace(device=torch.device("cpu"), world=1, rank=0)
    sampler = Sampler(preset, data, model, rank)
    torch.manual_seed(123)
    random.seed(5)
    before = (torch.get_rng_state(), random.getstate())
    first = sampler.generate(2)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    modes = {n: m.training for n, m in small_model.named_modules()}
    assert modes[""] and not modes["model.layers.0"] and modes["model.layers.1"]
    again = sampler.generate(2)
    assert [(e.text, e.tokens) for e in again] == [(e.text, e.tokens) for e in first]
    assert first[0].step == 2 and first[0].prompt == "Say red." and 1 <= first[0].tokens <= 6


def test_preserved_rng_and_evaluating_restore_after_an_error(small_model) -> None:
    small_model.train()
    torch.manual_seed(1)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError), preserved_rng(torch.device("cpu")), evaluating(small_model):
        torch.rand(3)
        assert not small_model.training
        raise RuntimeError
    assert torch.equal(torch.get_rng_state(), state) and small_model.training
