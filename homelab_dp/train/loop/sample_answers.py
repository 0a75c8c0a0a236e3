"""Samples while training: the model being trained answers a few prompts (``train.sample_every``).

Which prompts (`choose_prompts`): ``data.sample_prompts`` (a list or a file,
`homelab_dp.data.sample_prompts`), each rendered as `chat` and `serve` render one user message
for this run (the format it trains on: instruction data → the instruction prompt, text and
completion data → the text itself with the tokenizer's leading special tokens, chat data → the
tokenizer's chat template with the generation prompt); else the prompt part of the first
`DATA_PROMPTS` samples of the eval data, else of the training data, exactly as the model sees
them (the tokens before the first target: the template is already in them). A text sample has
no prompt part, so its first `TEXT_PROMPT_TOKENS` tokens (at most half of it) are the prompt.

When (`sample_due`): "eval" with each evaluation, N every N optimizer steps and at the last,
"off" never.

How (`Sampler.generate`): every rank runs the same decoding with the same inputs (FSDP2 gathers
sharded parameters collectively in each forward, so every rank must run every forward); under
DDP on the unwrapped module. With more than one rank, rank 0's token is broadcast after each
forward, so every rank runs the same number of forwards whatever the kernels' rounding, and
rank 0 writes the events. A KV cache, eval mode (no dropout, LoRA's included), no_grad, the
training's autocast; greedy at temperature 0, else sampled from softmax(logits / T) with a
generator of its own seeded by ``train.seed`` and the step.

No change to training: every module's train/eval flag is put back as it was, and every random
state the forward could touch (torch's CPU generator, the CUDA generator of this device,
Python's ``random``) is saved and restored, so a run with samples ends with the same weights,
bit for bit, as without (tests/integration/test_samples.py).
"""

from __future__ import annotations

import contextlib
import inspect
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from homelab_dp.data.sample_prompts import DATA_PROMPTS, read_sample_prompts
from homelab_dp.data.tokenize import IGNORE_INDEX, format_instruction
from homelab_dp.runs.folder.heartbeats import EVALUATING
from homelab_dp.runs.run_events import SampleEvent

TEXT_PROMPT_TOKENS = 16
"""The prompt of a text sample (which has no prompt part): its first tokens, at most half."""
SEED_STRIDE = 1_000_003
"""Seed of a sampled step: train.seed × SEED_STRIDE + step (a prime: distinct per step)."""


@dataclass(frozen=True)
class SamplePrompt:
    """One prompt: what the events show and the token ids the model gets."""

    text: str
    ids: list[int]


def sample_due(
    every: str | int, step: int, total_steps: int, *, evaluated: bool, ending: bool = False
) -> bool:
    """Whether to sample after optimizer step ``step`` (1-based): ``every`` is
    ``train.sample_every`` ("eval": when the step was evaluated; N: every N steps and at the
    last, ``ending`` (an early stop) counting as the last; "off", or N of 0 or less: never)."""
    if every == "eval":
        return evaluated
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
        return False
    return step % every == 0 or step == total_steps or ending


def user_prompt_ids(tokenizer: Any, text: str, fmt: str) -> list[int]:
    """Token ids of one user prompt in the format the run trains on (see the module docstring;
    the same ids `serving.replica.prompt_templates.prompt_ids` gives chat and serve)."""
    if fmt == "chat":
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    if fmt == "instruction":
        text = format_instruction(text)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def data_prompt_ids(
    input_ids: Any, labels: Any, positions: Any, mask: Any, limit: int = DATA_PROMPTS
) -> list[list[int]]:
    """The prompt parts of the first ``limit`` distinct samples of blocks (`data.blocks`: labels
    shifted, positions restarting at each packed sample, mask 0 on padding).

    A sample runs from a position 0 to the next; its prompt is its tokens up to and including
    the first one whose label is a target (that token's input predicts the answer's first
    token). A sample whose first token is already a target (text) gives its first
    `TEXT_PROMPT_TOKENS` tokens, at most half of it."""
    out: list[list[int]] = []
    for ids, labs, pos, real in zip(input_ids.tolist(), labels.tolist(), positions.tolist(),
                                    mask.tolist(), strict=True):  # fmt: skip
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:], strict=False):
            n = sum(real[a:b])
            if n == 0:  # the padding run of a packed block
                continue
            first = next((i for i in range(a, a + n) if labs[i] != IGNORE_INDEX), None)
            if first is None:
                continue
            end = first + 1 if first > a else a + max(1, min(TEXT_PROMPT_TOKENS, n // 2))
            prompt = ids[a:end]
            if prompt not in out:
                out.append(prompt)
            if len(out) == limit:
                return out
    return out


def choose_prompts(sample_prompts: str | list[str], data: Any) -> list[SamplePrompt]:
    """The run's prompts (see the module docstring); ``data`` is `train.loop.rank_setup.Data`."""
    tok = data.tokenizer
    given = read_sample_prompts(sample_prompts)
    if given:
        return [SamplePrompt(p, user_prompt_ids(tok, p, data.fmt)) for p in given]
    source = data.eval if data.eval is not None else data
    found = data_prompt_ids(source.input_ids, source.labels, source.positions, source.mask)
    return [SamplePrompt(tok.decode(ids, skip_special_tokens=True), ids) for ids in found]


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Restore torch's CPU generator, this CUDA device's generator and Python's ``random``."""
    cpu = torch.get_rng_state()
    py = random.getstate()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        random.setstate(py)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode for the block; then every module's own flag back (not one flag for all)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _eos_ids(tokenizer: Any, model: torch.nn.Module) -> set[int]:
    """The tokenizer's eos and the generation config's (as chat and serve stop)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids.update(int(i) for i in extra)
    return ids


def _forward_kwargs(model: torch.nn.Module) -> dict[str, Any]:
    """``logits_to_keep=1`` where the model takes it: no full-prompt logits (memory)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        takes = "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        takes = False
    return {"logits_to_keep": 1} if takes else {}


@torch.no_grad()
def decode(
    model: torch.nn.Module, prompt: list[int], *, max_tokens: int, eos: set[int],
    device: torch.device, autocast: Any = contextlib.nullcontext, temperature: float = 0.0,
    generator: torch.Generator | None = None, world: int = 1,
) -> list[int]:  # fmt: skip
    """New token ids after ``prompt`` (greedy, or sampled at ``temperature`` > 0 with
    ``generator``), with a KV cache; ends after an eos id (kept) or ``max_tokens``. With
    ``world`` > 1 every rank calls it and follows rank 0's tokens (a broadcast each)."""
    import torch.distributed as dist

    extra = _forward_kwargs(model)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    past: Any = None
    out: list[int] = []
    for _ in range(max_tokens):
        with autocast():
            res = model(input_ids=ids, past_key_values=past, use_cache=True, **extra)
        past = res.past_key_values
        logits = res.logits[0, -1].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        else:
            nxt = logits.argmax().reshape(1)
        if world > 1:
            dist.broadcast(nxt, src=0)
        token = int(nxt.item())
        out.append(token)
        if token in eos:
            break
        ids = nxt.reshape(1, 1)
    return out


class Sampler:
    """One rank's prompts and the generation of their answers at a step."""

    def __init__(self, preset: Any, data: Any, model: Any, rank: Any) -> None:
        """``model`` is `train.loop.rank_setup.Model`, ``rank`` `train.loop.rank_setup.Rank`."""
        self.train = preset.train
        self.tokenizer = data.tokenizer
        self.model, self.rank = model, rank
        self.prompts = choose_prompts(preset.data.sample_prompts, data)

    def due(self, step: int, total_steps: int, *, evaluated: bool, ending: bool = False) -> bool:
        """Whether to sample after ``step`` (`sample_due`), with prompts to answer."""
        return bool(self.prompts) and sample_due(
            self.train.sample_every, step, total_steps, evaluated=evaluated, ending=ending
        )

    def generate(self, step: int, guard: Any = None) -> list[SampleEvent]:
        """Every prompt's answer by the model as trained for ``step`` steps (a collective under
        FSDP2 and with several ranks: every rank calls it); one event per prompt."""
        strategy, r = self.model.strategy, self.rank
        model = strategy.inner  # DDP's module; for FSDP2 the fully_shard-ed model itself
        eos = _eos_ids(self.tokenizer, model)
        temperature = float(self.train.sample_temperature)
        beating = guard.beating(step, EVALUATING) if guard is not None else contextlib.nullcontext()
        events = []
        with beating, preserved_rng(r.device), evaluating(model):
            generator = None
            if temperature > 0:
                generator = torch.Generator(device=r.device)
                generator.manual_seed(int(self.train.seed) * SEED_STRIDE + step)
            for prompt in self.prompts:
                t0 = time.perf_counter()
                new = decode(model, prompt.ids, max_tokens=int(self.train.sample_max_tokens),
                             eos=eos, device=r.device, autocast=self.model.autocast,
                             temperature=temperature, generator=generator,
                             world=r.world)  # fmt: skip
                text = self.tokenizer.decode(new, skip_special_tokens=True)
                events.append(SampleEvent(step=step, prompt=prompt.text, text=text,
                                          tokens=len(new),
                                          seconds=time.perf_counter() - t0))  # fmt: skip
            _reshard(model)
        return events


def _reshard(model: torch.nn.Module) -> None:
    """FSDP2: free the parameters the forwards gathered (grad-op keeps them after a forward
    until the backward, and no backward follows these)."""
    for m in model.modules():
        reshard = getattr(m, "reshard", None)
        if callable(reshard) and type(m).__name__.startswith("FSDP"):
            reshard()
