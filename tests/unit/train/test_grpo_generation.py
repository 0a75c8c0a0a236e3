"""GRPO's generation on the tiny model: the KV-cache decoder against a decoder that recomputes
every position, sampling settings, per-prompt generators, the adapters on."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from homelab_dp.train.objectives.grpo_generation import (
    engine_name,
    generate_group,
    prompt_generator,
    sample_next,
)
from tests.conftest import ROOT

TINY = ROOT / "assets" / "models" / "tiny-llama"
PROMPT = [0, 17, 42, 99, 5]
EOS, PAD = 1, 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread: these many small forwards are slower with more on shared CI cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(one_thread: None) -> torch.nn.Module:
    m = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float64).eval()
    with torch.no_grad():  # an eos likely enough that some completions end before the limit
        m.lm_head.weight[EOS] += 0.1 * m.lm_head.weight.norm(dim=1).mean()
    return m


def _no_cache(model, prompt, *, generations, max_tokens, generator, **sampling):
    """The reference: every position recomputed from the whole sequence, the same draws."""
    rows = torch.tensor([prompt] * generations)
    done = torch.zeros(generations, dtype=torch.bool)
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=rows).logits[:, -1]
            nxt = sample_next(logits, generator=generator, **sampling)
            out.append(torch.where(done, torch.full_like(nxt, PAD), nxt))
            done = done | (nxt == EOS)
            if bool(done.all()):
                break
            rows = torch.cat([rows, nxt[:, None]], dim=1)
    return torch.stack(out, dim=1), done


def _group(model, step=3, prompt=7, **kw):
    settings = {"generations": 6, "max_tokens": 12, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    settings.update(kw)
    return generate_group(model, PROMPT, eos={EOS}, pad=PAD, device="cpu",
                          generator=prompt_generator(42, step, prompt, "cpu"), **settings)  # fmt: skip


def test_the_cached_decoder_draws_what_recomputing_every_position_draws(model) -> None:
    group = _group(model)
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    ref, done = _no_cache(model, PROMPT, generations=6, max_tokens=12,
                          generator=prompt_generator(42, 3, 7, "cpu"), **sampling)  # fmt: skip
    assert torch.equal(group.ids, ref)
    assert torch.equal(group.truncated, ~done)
    lengths = group.mask.sum(1)
    assert 0 < int(group.truncated.sum()) < 6  # some end on eos, some at the limit
    for row in range(6):  # the mask covers the completion up to its eos, pad after
        n = int(lengths[row])
        assert group.completion(row) == ref[row, :n].tolist()
        assert (group.ids[row, n:] == PAD).all()
        assert (group.completion(row)[-1] == EOS) != bool(group.truncated[row])


def test_a_prompts_completions_depend_on_seed_step_and_prompt_only(model) -> None:
    first = _group(model)
    _group(model, step=4, prompt=1)  # anything generated in between changes nothing
    assert torch.equal(_group(model).ids, first.ids)
    assert not torch.equal(_group(model, step=4).ids, first.ids)
    assert not torch.equal(_group(model, prompt=8).ids, first.ids)
    assert torch.equal(_group(model, step=4).ids, _group(model, step=4).ids)


def test_top_k_and_top_p_narrow_the_draw(model) -> None:
    greedy = _group(model, top_k=1, temperature=0.7)
    logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    assert (greedy.ids[:, 0] == logits.argmax()).all()  # one candidate: every row takes it
    assert torch.equal(_group(model, top_p=1e-9).ids, greedy.ids)  # only the likeliest
    g = torch.Generator().manual_seed(0)
    row = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(2000, 1)
    drawn = sample_next(row, temperature=1.0, top_k=0, top_p=0.75, generator=g)
    # probabilities ~ .032 .087 .237 .644: the nucleus of 0.75 holds tokens 3 and 2 only
    assert set(drawn.tolist()) == {2, 3}
    drawn = sample_next(row, temperature=1.0, top_k=3, top_p=1.0, generator=g)
    assert set(drawn.tolist()) == {1, 2, 3}


def test_lora_generates_with_the_adapters_on(model) -> None:
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float64),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"]))  # fmt: skip
    peft.eval()
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    on = _group(peft)
    with peft.disable_adapter():
        off = _group(peft)
    base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float64).eval()
    assert torch.equal(off.ids, _group(base).ids)
    assert not torch.equal(on.ids, off.ids)


def test_the_engine_seam() -> None:
    assert engine_name("auto") == "transformers"
    with pytest.raises(ValueError, match="not an engine"):
        engine_name("vllm")
