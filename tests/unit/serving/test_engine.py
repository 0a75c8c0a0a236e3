"""The batched decoder and the prompt templates, on the demo model (assets/models/tiny-llama).

Batched greedy decoding must give each prompt exactly the tokens it gets alone (left padding,
positions and the KV cache done right), and alone it must match transformers' ``generate``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from homelab_dp.data.blocks import format_instruction
from homelab_dp.runs.model_ref import ModelRef, resolve_model
from homelab_dp.serving.replica.generation_engine import Engine, Request, TextStream
from homelab_dp.serving.replica.prompt_templates import (
    CHAT,
    INSTRUCTION,
    INSTRUCTION_STOP,
    PLAIN,
    eos_ids,
    prompt_ids,
    render_messages,
    template_for,
)
from homelab_dp.serving.replica.result_model import load_for_inference

ROOT = Path(__file__).resolve().parents[3]
DEMO_MODEL = ROOT / "assets" / "models" / "tiny-llama"
DEMO_DATA = ROOT / "assets" / "data" / "tiny-instruct.jsonl"
PROMPTS = ["Hello", "The capital of", "### Instruction:\nWhat is 2 + 3?\n\n### Response:\n"]


@pytest.fixture(scope="module")
def loaded() -> Iterator[Any]:
    import torch

    # One thread: a tiny model's matmuls gain nothing from more, and on a busy machine threads
    # that wait for each other make each step many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_for_inference(resolve_model(str(DEMO_MODEL)), "cpu")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine(loaded: Any) -> Engine:
    eos = eos_ids(loaded.tokenizer, loaded.model)
    return Engine(loaded.model, loaded.tokenizer, context=loaded.context, eos_ids=eos)


def ids_of(engine: Engine, prompt: str) -> list[int]:
    return prompt_ids(engine.tokenizer, prompt=prompt)


def test_loading_the_demo_model(loaded: Any) -> None:
    import torch

    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert loaded.context == 512 and not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.tokenizer.pad_token_id is not None


def test_batched_greedy_equals_one_at_a_time(engine: Engine, loaded: Any) -> None:
    import torch

    prompts = [ids_of(engine, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3  # different lengths: real left padding
    batch = engine.generate([Request(p, 24) for p in prompts])
    for p, together in zip(prompts, batch, strict=True):
        alone = engine.generate([Request(p, 24)])[0]
        assert together.token_ids == alone.token_ids
        reference = loaded.model.generate(
            torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=engine.pad_id
        )[0, len(p) :].tolist()
        assert alone.token_ids == reference  # transformers' own greedy decoding


def test_finish_reasons_usage_and_events(engine: Engine) -> None:
    events: list[list[dict]] = [[], []]
    prompts = [ids_of(engine, "The capital of"), ids_of(engine, "Hello")]
    requests = [
        Request(p, n, emit=events[i].append)
        for i, (p, n) in enumerate(zip(prompts, (40, 5), strict=True))
    ]
    stopped, cut = engine.generate(requests)
    # The first answer ends with the eos token (within 40 tokens), the second at max_tokens.
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] in engine.eos_ids
    assert len(stopped.token_ids) < 40
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    for result, got, prompt in zip((stopped, cut), events, prompts, strict=True):
        *deltas, last = got
        assert "".join(d["text"] for d in deltas) == result.text
        assert last == {"finish_reason": result.finish_reason, "usage": result.usage}
        assert result.usage["prompt_tokens"] == len(prompt)
        assert result.usage["completion_tokens"] == len(result.token_ids)
        assert result.usage["total_tokens"] == result.usage["prompt_tokens"] + len(result.token_ids)
    assert engine.tokenizer.eos_token not in stopped.text


def test_max_tokens_is_clipped_to_the_context(engine: Engine) -> None:
    prompt = ids_of(engine, "word " * 250)
    room = engine.context - len(prompt)
    result = engine.generate([Request(prompt, 10_000)])[0]
    assert result.finish_reason == "length" or result.token_ids[-1] in engine.eos_ids
    assert len(result.token_ids) <= room


def test_stop_strings_end_the_answer(engine: Engine) -> None:
    prompt = ids_of(engine, "Hello")
    full = engine.generate([Request(prompt, 30)])[0].text
    stop = full.split()[3]
    deltas: list[str] = []
    result = engine.generate(
        [Request(prompt, 30, stop=(stop,), emit=lambda e: deltas.append(e.get("text", "")))]
    )[0]
    assert result.finish_reason == "stop" and result.text == full[: full.index(stop)]
    assert "".join(deltas) == result.text  # no piece of the stop string was ever emitted
    assert len(result.token_ids) < 30


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    prompt = ids_of(engine, "Hello")
    seeded = [Request(prompt, 30, temperature=1.0, seed=s) for s in (1, 1, 2)]
    a, b, c = engine.generate(seeded)
    assert a.token_ids == b.token_ids != c.token_ids
    alone = engine.generate([Request(prompt, 30, temperature=1.0, seed=1)])[0]
    assert alone.token_ids == a.token_ids  # its own generator: the batch does not matter
    # A tiny top_p keeps only the most likely token: greedy.
    greedy = engine.generate([Request(prompt, 30)])[0]
    for top_p in (1e-6, 0.0):
        nucleus = engine.generate([Request(prompt, 30, temperature=1.0, top_p=top_p, seed=3)])[0]
        assert nucleus.token_ids == greedy.token_ids


def test_a_cancelled_row_leaves_and_the_others_finish(engine: Engine) -> None:
    events: list[dict] = []
    victim = Request(ids_of(engine, "Hello"), 40, stop=())

    def emit(event: dict) -> None:
        events.append(event)
        if len(events) == 3:
            victim.cancelled.set()

    victim.emit = emit
    other = Request(ids_of(engine, "The capital of"), 8)
    cancelled, done = engine.generate([victim, other])
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) == 3
    assert all("finish_reason" not in e for e in events)
    assert done.token_ids == engine.generate([Request(other.prompt_ids, 8)])[0].token_ids


def test_text_stream_never_emits_a_broken_character(engine: Engine) -> None:
    text = "héllo 日本 wörld 🙂"
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(engine.tokenizer)
    deltas = [stream.push(t) for t in ids]
    assert "".join(deltas) + stream.flush() == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") >= 3  # held back while a character's bytes were incomplete


def test_chat_template_rendering(engine: Engine) -> None:
    tok = engine.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    template = template_for(tok, ModelRef(name="m", path=DEMO_MODEL))
    assert template.kind == CHAT and template.stop == ()
    text = render_messages(tok, messages, template)
    assert text == "<s><|system|>\nBe brief.</s><|user|>\nHi</s><|assistant|>\n"
    ids = prompt_ids(tok, messages=messages, template=template)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]  # one <s>, the template's


def test_instruction_template_for_instruction_runs(engine: Engine, tmp_path: Path) -> None:
    tok = engine.tokenizer
    run = ModelRef(name="r", path=DEMO_MODEL, data_format="auto", data_path=DEMO_DATA)
    template = template_for(tok, run)  # auto: detected from the run's data (instruction)
    assert template.kind == INSTRUCTION and template.stop == (INSTRUCTION_STOP,)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 2 + 4?"},
    ]
    expected = (
        format_instruction("Be brief.\n\nWhat is 2 + 3?")
        + "5\n\n"
        + format_instruction("And 2 + 4?")
    )
    assert render_messages(tok, messages, template) == expected
    ids = prompt_ids(tok, messages=messages, template=template)
    assert ids == tok(expected)["input_ids"] and ids[0] == tok.bos_token_id
    # Data that is gone: the chat template the tokenizer has; a text run: plain concatenation.
    gone = ModelRef(name="r", path=DEMO_MODEL, data_format="auto", data_path=tmp_path / "x.jsonl")
    assert template_for(tok, gone).kind == CHAT
    plain = template_for(tok, ModelRef(name="r", path=DEMO_MODEL, data_format="text"))
    assert plain.kind == PLAIN and render_messages(tok, messages[1:2], plain) == "What is 2 + 3?"


def test_no_chat_template_falls_back_to_instruction(loaded: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    tok.chat_template = None
    template = template_for(tok, ModelRef(name="m", path=DEMO_MODEL))
    assert template.kind == INSTRUCTION
    text = render_messages(tok, [{"role": "user", "content": "Hi"}], template)
    assert text == format_instruction("Hi")


def test_an_adapter_is_merged_into_one_plain_model(loaded: Any, tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(DEMO_MODEL), config)
    adapted.save_pretrained(tmp_path / "adapter")
    ref = resolve_model(str(tmp_path / "adapter"))
    assert ref.is_adapter and ref.tokenizer_path == DEMO_MODEL
    merged = load_for_inference(ref, "cpu").model
    assert not any("lora" in name for name, _ in merged.named_parameters())
    ids = torch.tensor([loaded.tokenizer("The capital of")["input_ids"]])
    with torch.no_grad():
        want = adapted(ids).logits
        with adapted.disable_adapter():
            base = adapted(ids).logits
        got = merged(ids).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got, base, atol=1e-3)  # the adapter changes the answer


@pytest.mark.parametrize("arch", ["gpt2", "gemma2-sliding-window"])
def test_batched_greedy_on_other_architectures(loaded: Any, arch: str) -> None:
    """Learned absolute positions (GPT-2) and a sliding window shorter than the prompts
    (Gemma-2, window 8): batched still equals alone equals transformers' generate."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel

    tok = loaded.tokenizer
    torch.manual_seed(0)
    if arch == "gpt2":
        config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=128)
        model = GPT2LMHeadModel(config)
    else:
        config = Gemma2Config(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=8,
            max_position_embeddings=128,
        )
        model = Gemma2ForCausalLM(config)
    model.eval()
    engine = Engine(model, tok, context=128, eos_ids={tok.eos_token_id})
    prompts = [ids_of(engine, p) for p in ("Hello", "The capital of Foulek is a city on the river")]
    batch = engine.generate([Request(p, 16) for p in prompts])
    for p, together in zip(prompts, batch, strict=True):
        assert together.token_ids == engine.generate([Request(p, 16)])[0].token_ids
        reference = model.generate(
            torch.tensor([p]),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )[0, len(p) :].tolist()
        assert together.token_ids == reference
