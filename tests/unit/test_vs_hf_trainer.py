"""benchmarks/vs_hf_trainer.py: its ragged data, its fairness rule, its HF set-ups and its
summary (no timed run here)."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "vs_hf_trainer", ROOT / "benchmarks" / "vs_hf_trainer.py"
)
assert _spec and _spec.loader
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

VOCAB = json.loads((bench.DEMO / "tokenizer.json").read_text())["model"]["vocab"]


def test_output_lengths_are_log_uniform_with_a_long_tail() -> None:
    lengths = bench.output_lengths(20000, 3, 300, random.Random(1))
    assert min(lengths) == 3 and max(lengths) == 300
    # Log-uniform on [3, 300]: median sqrt(3·300) = 30, mean (300 - 3) / ln(100) ≈ 64.5,
    # P(> 100) = ln(3) / ln(100) ≈ 0.239.
    assert 28 <= statistics.median(lengths) <= 32
    assert 61 <= statistics.mean(lengths) <= 68
    assert abs(sum(n > 100 for n in lengths) / len(lengths) - math.log(3) / math.log(100)) < 0.015


def test_records_are_seeded_and_outputs_have_the_drawn_word_counts() -> None:
    words, pieces = bench.vocabulary_words(VOCAB)
    assert len(words) > 500 and len(pieces) > 300
    a = bench.ragged_records(200, words, pieces, lo=3, hi=300, seed=7)
    assert a == bench.ragged_records(200, words, pieces, lo=3, hi=300, seed=7)
    assert a != bench.ragged_records(200, words, pieces, lo=3, hi=300, seed=8)
    drawn = bench.output_lengths(200, 3, 300, random.Random(7))
    assert [len(r["output"].split()) for r in a] == drawn
    assert all(r["instruction"].endswith("?") and r["output"].endswith(".") for r in a)
    assert 0.35 < sum(bool(r["input"]) for r in a) / len(a) < 0.65


def test_the_demo_tokenizer_makes_about_one_and_a_half_tokens_a_word() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bench.DEMO)
    words, pieces = bench.vocabulary_words(VOCAB)
    records = bench.ragged_records(300, words, pieces, lo=3, hi=300, seed=0)
    outputs = [r["output"] for r in records]
    tokens = sum(len(ids) for ids in tokenizer(outputs, add_special_tokens=False)["input_ids"])
    assert 1.2 < tokens / sum(len(o.split()) for o in outputs) < 1.8


def test_hf_batch_matches_real_tokens_per_micro_batch() -> None:
    # 4 blocks of 512 = 2048 real tokens; samples of 128 tokens on average: 16 of them.
    assert bench.hf_batch([100, 156, 128], micro=4, seq_len=512) == 16
    assert bench.hf_batch([5000], micro=1, seq_len=512) == 1


def test_hf_setups_are_defaults_and_the_two_a_careful_user_would_pick() -> None:
    setups = bench.HF_SETUPS
    assert set(setups) == {"hf-defaults", "hf-group-by-length", "hf-padding-free"}
    assert setups["hf-defaults"] == {"collator": "pad", "args": {}}  # HF's own defaults
    for name in ("hf-group-by-length", "hf-padding-free"):
        args = setups[name]["args"]
        assert args["ddp_find_unused_parameters"] is False
        assert args["ddp_broadcast_buffers"] is False
    assert setups["hf-group-by-length"]["args"]["train_sampling_strategy"] == "group_by_length"
    assert setups["hf-padding-free"]["collator"] == "flatten"


def _run(side: str, tokens: int, wall: float) -> dict:
    return {"side": side, "real_tokens": tokens, "wall_s": wall, "micro_batch": "-"}


def test_medians_min_max_and_the_ratio_to_the_best_hf_setup() -> None:
    # interleaved: ours, defaults, grouped, for three repeats (tokens/s = tokens / 1 s)
    runs = []
    for ours, defaults, grouped in ((1000, 300, 800), (1200, 250, 700), (900, 400, 900)):
        runs += [_run("homelab-dp", ours, 1.0), _run("hf-defaults", defaults, 1.0),
                 _run("hf-group-by-length", grouped, 1.0)]  # fmt: skip
    summary = bench.summarize(runs)
    assert list(summary) == ["homelab-dp", "hf-defaults", "hf-group-by-length"]
    assert summary["homelab-dp"]["median"] == 1000
    assert (summary["hf-defaults"]["min"], summary["hf-defaults"]["max"]) == (250, 400)
    assert bench.best_hf(summary) == "hf-group-by-length"
    assert summary["hf-group-by-length"]["ratio"] == pytest.approx(1000 / 800)
    assert bench.per_repeat_ratios(runs, "hf-defaults") == pytest.approx(
        [1000 / 300, 1200 / 250, 900 / 400]
    )
    text = bench.table(runs, "header")
    assert "best HF set-up (hf-group-by-length): x1.25" in text


def test_trees_ab_table_gives_each_trees_median_over_the_first_and_ms_per_step(
    tmp_path: Path,
) -> None:
    (tmp_path / "old" / "homelab_dp").mkdir(parents=True)
    trees = bench.parse_trees(f"old={tmp_path / 'old'},new={ROOT}")
    assert trees == {"old": (tmp_path / "old").resolve(), "new": ROOT}
    for bad in ("old", f"x={tmp_path}", f"a={ROOT},a={ROOT}"):  # no path, no homelab_dp, twice
        with pytest.raises(SystemExit):
            bench.parse_trees(bad)
    runs = []
    for old, new in ((1000, 1100), (900, 1000), (1100, 1300)):  # tokens in 2 s of 10 steps
        runs += [{**_run("homelab-dp[old]", 2 * old, 2.0), "steps": 10},
                 {**_run("homelab-dp[new]", 2 * new, 2.0), "steps": 10}]  # fmt: skip
    summary = bench.summarize(runs, "homelab-dp[old]")
    assert summary["homelab-dp[new]"]["median"] == 1100
    lines = bench.tree_table(runs, "header").splitlines()
    new_row = next(line for line in lines if line.startswith("homelab-dp[new]"))
    assert new_row.split()[-2:] == ["200.0", "1.100x"]  # 2 s / 10 steps; 1100 / 1000
