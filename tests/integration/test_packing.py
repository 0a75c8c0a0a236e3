"""The acceptance test of exact packing: packed blocks train exactly as one sample per row.

One optimizer step over the whole data set (effective batch = its number of blocks), plain SGD
without clipping in fp64, so the update is lr × the gradient: packed (several samples a row,
positions restarting at each, no attention mask) and padded (one sample a row, with a mask)
give the same loss and the same update to fp64 rounding, on one process and on two. The data is
ragged instruction data (outputs of 3 to 60 words) with seq_len above the longest sample, so
nothing is truncated. Both go through homelab_packed (each sample attends alone, no mask; padded
rows as their real tokens and their padding). The unit tests (tests/unit/train/test_attention.py,
tests/unit/train/test_packed_attention.py) show, at the model level, that the old packing (one
run of positions over a block) would differ measurably.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from homelab_dp.presets.preset import DataSection
from homelab_dp.runs.folder.run_folder import read_run_spec, write_run_spec
from tests.integration.conftest import DEMO_MODEL, events, final_weights, make_run, run

pytestmark = pytest.mark.slow
SEQ = 192
REL = 1e-9  # measured: loss equal, updates within 8e-15 of the largest; old packing: 7e-4 off
# fmt: off
WORDS = ("the", "a", "tea", "salt", "river", "stone", "cold", "warm", "bright", "quiet", "small",
         "large", "green", "blue", "red", "pot", "cup", "leaf", "road", "bread", "water", "light",
         "north", "south", "wind", "rain", "under", "over", "slowly", "quickly", "keeps", "brings")
# fmt: on


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Seeded tiny LLaMA (rotary positions, GQA) and GPT-2 (learned absolute positions) with
    the demo tokenizer and 256 positions."""
    import torch
    from transformers import (
        AutoTokenizer,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    configs = {
        "llama": (LlamaForCausalLM, LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, **ids)),
        "gpt2": (GPT2LMHeadModel, GPT2Config(
            vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=256,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)),
    }  # fmt: skip
    out = {}
    for name, (cls, config) in configs.items():
        out[name] = tmp_path_factory.mktemp(f"packing-{name}")
        torch.manual_seed(0)
        cls(config).save_pretrained(out[name])
        tokenizer.save_pretrained(out[name])
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 instruction records, outputs of 3 to 60 words."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("packing-data") / "ragged.jsonl"
    records = [
        {
            "instruction": " ".join(rng.choices(WORDS, k=rng.randint(2, 8))).capitalize() + ".",
            "output": " ".join(rng.choices(WORDS, k=rng.randint(3, 60))) + ".",
        }
        for _ in range(24)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def block_counts(model: Path, data: Path) -> dict[bool, int]:
    """Blocks packed and padded, as the worker builds them; checks that nothing is truncated."""
    from transformers import AutoTokenizer

    from homelab_dp.data.blocks import summarize
    from homelab_dp.data.eval_split import load_dataset

    tokenizer = AutoTokenizer.from_pretrained(model)
    blocks = {
        pack: load_dataset(DataSection(path=str(data), seq_len=SEQ, pack=pack), tokenizer,
                           seq_len_limit=256, min_blocks=1)
        for pack in (True, False)
    }  # fmt: skip
    padded, packed = summarize(blocks[False]), summarize(blocks[True])
    assert max(sum(b.attention_mask) for b in blocks[False]) < SEQ  # every sample whole
    assert packed["target_tokens"] == padded["target_tokens"]
    assert packed["blocks"] < padded["blocks"] == 24
    return {pack: len(b) for pack, b in blocks.items()}


def one_step(root: Path, model: Path, data: Path, name: str, *, pack: bool, world: int,
             micro: int, accum: int) -> tuple[dict, dict]:  # fmt: skip
    """One SGD step over the whole data set: the step event and the final weights."""
    rd = make_run(root, model, data, name=name, world=world, micro=micro, accum=accum,
                  dtype="fp64", lr=0.1, seq_len=SEQ,
                  train={"max_steps": 1, "optimizer": "sgd", "max_grad_norm": 0.0})  # fmt: skip
    spec = read_run_spec(rd)  # make_run pads; the packed runs pack
    preset = replace(spec.preset, data=replace(spec.preset.data, pack=pack))
    write_run_spec(rd, replace(spec, preset=preset))
    assert run(rd, world) == 0
    (step,) = events(rd, "step")
    assert step["effective_batch"] == world * micro * accum
    (start,) = events(rd, "start")  # the worker checked packing on the model before training
    assert start["packing"] == ("exact" if pack else "off")
    assert (start["packing_error"] is not None) == pack and (start["packing_error"] or 0) < 1e-9
    # Every run, packed or padded, attends each sample alone (train.packed_attention): no mask.
    assert start["attention"] == "homelab_packed" and "CUDA" in start["attention_reason"]
    assert "SDPA on each sample alone" in start["attention_reason"]
    # What ran, counted: per micro-step forward, one per-sample SDPA call in each of 2 layers.
    assert step["attention_routes"] == {"sdpa": 2 * accum}
    return step, final_weights(rd)


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_step_equals_one_sample_per_row(
    arch: str, models: dict[str, Path], data: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = models[arch]
    counts = block_counts(model, data)
    assert counts[False] == 24 and counts[False] % 3 == 0
    runs = {
        "padded": one_step(tmp_path, model, data, "padded", pack=False, world=1, micro=8, accum=3),
        "packed": one_step(
            tmp_path, model, data, "packed", pack=True, world=1, micro=counts[True], accum=1
        ),
    }
    if arch == "llama":  # two processes, accumulating: 2 ranks × micro 1 × accumulation n/2
        assert counts[True] % 2 == 0
        runs["packed-2"] = one_step(
            tmp_path, model, data, "packed-2", pack=True, world=2, micro=1, accum=counts[True] // 2
        )
    initial = {
        k: v.double() for k, v in AutoModelForCausalLM.from_pretrained(model).state_dict().items()
    }
    ref_step, ref_weights = runs.pop("padded")
    ref_update = {k: ref_weights[k].double() - initial[k] for k in ref_weights}
    scale = max(float(u.abs().max()) for u in ref_update.values())
    assert scale > 1e-4  # the step moved the weights
    for name, (step, weights) in runs.items():
        assert weights.keys() == ref_weights.keys()
        assert rel_diff(step["loss"], ref_step["loss"]) < REL, name
        assert rel_diff(step["grad_norm"], ref_step["grad_norm"]) < REL, name
        worst = max(
            float((weights[k].double() - initial[k] - ref_update[k]).abs().max()) for k in weights
        )
        assert worst < REL * scale, (name, worst / scale)
        print(f"{arch} {name}: loss {step['loss']!r} vs {ref_step['loss']!r}, "
              f"update diff {worst / scale:.1e} of the largest update")  # fmt: skip
    assert torch.isfinite(torch.tensor(ref_step["loss"]))
