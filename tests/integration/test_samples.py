"""Samples while training, end to end: torchrun, gloo, 2 CPU processes (`train.loop.sample_answers`).

One demo fine-tune with ``train.sample_every = 2`` and a checkpoint every 2 steps, and the same
run with ``sample_every = "off"``:

- sample events after steps 2 and 4 (the last), one per prompt, with text and token counts;
- the text after step 2 is what the checkpoint of step 2 generates greedily with transformers'
  own ``generate``, the prompt rendered as `chat` renders it (`serving.replica.prompt_templates`);
- the final weights, and the checkpoint of step 2 (its RNG states included), are bitwise those of
  the run without samples.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from homelab_dp.runs.folder.run_folder import read_run_spec, write_run_spec
from homelab_dp.runs.model_ref import resolve_model
from homelab_dp.serving.replica.prompt_templates import prompt_ids, template_for
from tests.integration.conftest import (
    DEMO_DATA,
    bitwise_equal,
    events,
    final_weights,
    make_run,
    run,
)

pytestmark = pytest.mark.slow

PROMPTS = ["Name a primary colour.", "What is two plus two?"]
MAX_TOKENS = 12


def _launch(root: Path, model: Path, name: str, every: Any) -> Path:
    train = {"max_steps": 4, "checkpoint_every": 2, "keep_checkpoints": 5,
             "sample_every": every, "sample_max_tokens": MAX_TOKENS}  # fmt: skip
    rd = make_run(root, model, DEMO_DATA, name=name, seq_len=64, train=train)
    spec = read_run_spec(rd)
    data = replace(spec.preset.data, sample_prompts=list(PROMPTS))
    write_run_spec(rd, replace(spec, preset=replace(spec.preset, data=data)))
    assert run(rd, 2) == 0
    return rd


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the run with samples every 2 steps, the same run without samples)."""
    root = tmp_path_factory.mktemp("samples")
    return _launch(root, tiny_model, "with", 2), _launch(root, tiny_model, "without", "off")


def _checkpoint_model(run_dir: Path, step: int, base: Path) -> Any:
    """The run's model as the checkpoint of ``step`` holds it (DCP safetensors shards)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    weights: dict[str, Any] = {}
    for shard in sorted((run_dir / "checkpoints" / f"step-{step}").glob("*.safetensors")):
        weights.update(load_file(shard))
    model_sd = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    model = AutoModelForCausalLM.from_pretrained(base)
    model.load_state_dict(model_sd, strict=True)  # every weight, nothing else
    return model.eval()


def _sample_events_at_each_period_and_the_end(pair: tuple[Path, Path]) -> None:
    with_samples, without = pair
    samples = events(with_samples, "sample")
    assert [(e["step"], e["prompt"]) for e in samples] == [
        (2, PROMPTS[0]), (2, PROMPTS[1]), (4, PROMPTS[0]), (4, PROMPTS[1])
    ]  # fmt: skip
    for e in samples:
        assert 1 <= e["tokens"] <= MAX_TOKENS and e["text"].strip() and e["seconds"] > 0
    assert events(without, "sample") == []


def _step_2_sample_is_what_its_checkpoint_generates_greedily(
    pair: tuple[Path, Path], tiny_model: Path
) -> None:
    import torch
    from transformers import AutoTokenizer

    with_samples, _ = pair
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    template = template_for(tokenizer, resolve_model(str(with_samples)))
    model = _checkpoint_model(with_samples, 2, tiny_model)
    wanted = {}
    for prompt in PROMPTS:
        ids = torch.tensor([prompt_ids(tokenizer, messages=[{"role": "user", "content": prompt}],
                                       template=template)])  # fmt: skip
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        new = out[0, ids.shape[1] :].tolist()
        wanted[prompt] = (tokenizer.decode(new, skip_special_tokens=True), len(new))
    got = {e["prompt"]: (e["text"], e["tokens"]) for e in events(with_samples, "sample")
           if e["step"] == 2}  # fmt: skip
    assert got == wanted


def _samples_change_nothing_of_the_training(pair: tuple[Path, Path]) -> None:
    from safetensors.torch import load_file

    with_samples, without = pair
    assert bitwise_equal(final_weights(with_samples), final_weights(without))
    losses = [[e["loss"] for e in events(rd, "step")] for rd in pair]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    a, b = (rd / "checkpoints" / "step-2" for rd in pair)
    for rank in (0, 1):  # the RNG states a resume would take back
        name = f"rng-rank-{rank}.json"
        assert json.loads((a / name).read_text()) == json.loads((b / name).read_text())
    for shard in sorted(a.glob("*.safetensors")):
        assert bitwise_equal(load_file(shard), load_file(b / shard.name))


def test_samples_while_training(pair: tuple[Path, Path], tiny_model: Path) -> None:
    """One test over the pair of runs, so that pytest's two workers never launch it twice:
    sample events at each period and the end; the step-2 answer is what that step's
    checkpoint generates greedily; the training is bitwise the run without samples."""
    _sample_events_at_each_period_and_the_end(pair)
    _step_2_sample_is_what_its_checkpoint_generates_greedily(pair, tiny_model)
    _samples_change_nothing_of_the_training(pair)
