"""The recurrent-packing rule against the real models, and the exactness of unpacked rows.

On the torch reference path (this machine has no flash-linear-attention, mamba-ssm or
causal-conv1d), a packed block of a model with Gated DeltaNet, Mamba-2 or short-convolution
layers gives other logits than its samples alone: its state crosses the samples. The rule
(`planning.recurrent_packing`) names exactly those families, from config.json, and leaves the
attention-only ones (Ernie 4.5 MoE, Gemma 4), which pack exactly, packed. Unpacked rows cut to a
micro-batch's longest sample give the logits of the full padded rows, and a step's blocks
grouped by length are the same blocks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from homelab_dp.errors import HomelabError
from homelab_dp.planning.model_spec import STATE_KINDS
from homelab_dp.planning.recurrent_packing import (
    RECURRENT_KINDS,
    model_recurrent_kinds,
    packing_decision,
    recurrent_kinds,
)
from homelab_dp.train.loop.length_groups import group_by_length, trimmed_width
from homelab_dp.train.model.model_census import any_model_spec
from homelab_dp.train.model.packed_attention import register
from homelab_dp.train.model.packing_check import check_packing, require_exact_packing
from tests.tiny_hybrids import FAMILIES


def _load(folder: Path) -> torch.nn.Module:
    register()  # homelab_packed, as the worker loads
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, experts_implementation="eager",
        attn_implementation="homelab_packed",
    )  # fmt: skip
    model.config.use_cache = False
    return model


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_rule_turns_packing_off_exactly_where_a_packed_block_leaks(
    model_type: str, tiny_hybrid: Callable[[str], Path]
) -> None:
    folder = tiny_hybrid(model_type)
    model = _load(folder)
    check = check_packing(model, device=torch.device("cpu"), dtype="fp64",
                          model_type=model_type, vocab_size=model.config.vocab_size)  # fmt: skip
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    kinds = recurrent_kinds(raw)
    assert kinds == recurrent_kinds(model.config.to_dict())  # what the worker reads
    planned = model_recurrent_kinds(any_model_spec(folder), raw)  # what the plan reads
    for read in (kinds, planned):
        assert packing_decision(True, read, model_type).pack == check.exact, (read, check)
    if not check.exact:  # a real leak, far beyond fp64 rounding; the guard refuses it
        assert check.max_diff > 1e-6
        with pytest.raises(HomelabError, match="recurrent layer's state") as err:
            require_exact_packing(check)
        assert "data.pack = false" in (err.value.hint or "")


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h", "lfm2", "falcon_h1"])
def test_a_micro_batch_cut_to_its_longest_sample_gives_the_padded_rows_logits(
    model_type: str, tiny_hybrid: Callable[[str], Path]
) -> None:
    model = _load(tiny_hybrid(model_type)).eval()
    seq_len, lengths = 40, torch.tensor([7, 19, 12])
    gen = torch.Generator().manual_seed(3)
    ids = torch.full((3, seq_len), model.config.pad_token_id, dtype=torch.long)
    mask = torch.zeros((3, seq_len), dtype=torch.long)
    for row, n in enumerate(lengths.tolist()):
        ids[row, :n] = torch.randint(3, 2000, (n,), generator=gen)
        mask[row, :n] = 1
    positions = torch.arange(seq_len).expand(3, -1)
    idx = torch.tensor([0, 1, 2])
    width = trimmed_width(idx, lengths)
    assert width == 19
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        cut = model(input_ids=ids[:, :width], attention_mask=mask[:, :width],
                    position_ids=positions[:, :width]).logits  # fmt: skip
    for row, n in enumerate(lengths.tolist()):
        assert torch.allclose(full[row, :n], cut[row, :n], rtol=0, atol=1e-10)


def test_grouping_keeps_a_steps_blocks_and_sorts_them_longest_first() -> None:
    lengths = torch.tensor([5, 30, 12, 30, 7, 19])
    step = torch.tensor([4, 0, 3, 1, 2, 5])
    grouped = group_by_length(step, lengths)
    assert sorted(grouped.tolist()) == sorted(step.tolist())
    assert grouped.tolist() == [3, 1, 5, 2, 4, 0]  # ties (3, 1) in the order given
    assert lengths[grouped].tolist() == sorted(lengths.tolist(), reverse=True)
    assert trimmed_width(torch.tensor([4, 0]), lengths) == 7
    assert trimmed_width(torch.tensor([], dtype=torch.long), lengths) == 1


def test_every_state_kind_of_the_model_spec_turns_packing_off() -> None:
    assert STATE_KINDS <= RECURRENT_KINDS
