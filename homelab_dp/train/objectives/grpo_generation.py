"""GRPO's generation: the group of completions of one prompt, by the weights being trained.

Exact on 1 or N processes: the completions of a prompt depend only on the weights, ``seed``,
the optimizer step and the prompt's index in the data, never on the rank, the world size or
the other prompts of the batch. Each prompt gets a generator of its own seeded from those three
(`prompt_generator`), and its ``generations`` completions are decoded together as one batch of
identical prompts (no padding, the same shapes wherever it runs), with a KV cache, in eval mode
(no dropout, LoRA's included) and no_grad; LoRA and QLoRA generate with the same base in memory
and the adapters on. Nothing else is drawn from any random generator, so a resumed run repeats
the generation of an uninterrupted one without saving a generator state.

Sampling (`sample_next`): logits / temperature, then top_k (0: off), then top_p (1: off), then
one draw per row from the prompt's generator. A completion ends after an eos id (kept) or at
``max_completion_tokens`` (truncated).

The engine seam (`engine_name`): ``grpo.engine = "auto"`` is this decoder over transformers'
model forward on every device today; a colocated vLLM engine (sleeping during the optimizer
step, the adapters passed in memory) is the name to add for CUDA, and the plan names the one
that generates.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from homelab_dp.train.loop.sample_answers import _forward_kwargs

ENGINES = ("transformers",)
"""The generation engines this version has."""
SEED_MIX = (1_000_003, 998_244_353)
"""Primes mixing (seed, step, prompt index) into one generator seed."""


def engine_name(setting: str) -> str:
    """The engine ``grpo.engine`` resolves to: auto is transformers (the seam for vLLM)."""
    name = "transformers" if setting == "auto" else setting
    if name not in ENGINES:
        raise ValueError(f"grpo.engine {setting!r} is not an engine ({', '.join(ENGINES)})")
    return name


def prompt_generator(seed: int, step: int, prompt: int, device: Any) -> torch.Generator:
    """The generator of prompt ``prompt``'s completions at optimizer step ``step``."""
    g = torch.Generator(device=device)
    a, b = SEED_MIX
    g.manual_seed((seed * a * b + step * b + prompt) % (2**63 - 1))
    return g


def sample_next(
    logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
    generator: torch.Generator,
) -> torch.Tensor:  # fmt: skip
    """One token per row of ``logits`` ``[rows, vocab]`` (see the module docstring)."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the more likely
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)  # the first always kept
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Group:
    """The completions of one prompt."""

    ids: torch.Tensor
    """``[generations, length]`` token ids, ``pad`` after each completion's end."""
    mask: torch.Tensor
    """``[generations, length]`` 1 on the completion's tokens (its eos included)."""
    truncated: torch.Tensor
    """``[generations]`` bool: ended at max_completion_tokens without an eos."""

    def completion(self, row: int) -> list[int]:
        """Row ``row``'s token ids."""
        return self.ids[row, : int(self.mask[row].sum())].tolist()


@torch.no_grad()
def generate_group(
    model: torch.nn.Module, prompt: list[int], *, generations: int, max_tokens: int,
    eos: set[int], pad: int, temperature: float, top_k: int, top_p: float,
    generator: torch.Generator, device: Any, autocast: Any = contextlib.nullcontext,
) -> Group:  # fmt: skip
    """``generations`` completions of ``prompt`` (token ids) by ``model`` as it is (call it in
    eval mode: `homelab_dp.train.loop.sample_answers.evaluating`)."""
    extra = _forward_kwargs(model)
    ids = torch.tensor([prompt] * generations, dtype=torch.long, device=device)
    eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    done = torch.zeros(generations, dtype=torch.bool, device=device)
    out, live = [], []
    past: Any = None
    for _ in range(max_tokens):
        with autocast():
            res = model(input_ids=ids, past_key_values=past, use_cache=True, **extra)
        past = res.past_key_values
        nxt = sample_next(res.logits[:, -1], temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=generator)  # fmt: skip
        live.append(~done)
        out.append(torch.where(done, torch.full_like(nxt, pad), nxt))
        done = done | torch.isin(nxt, eos_ids)
        if bool(done.all()):
            break
        ids = nxt[:, None]
    tokens = torch.stack(out, dim=1)
    mask = torch.stack(live, dim=1).long()
    return Group(tokens, mask, ~done)
