"""benchmarks/vs_hf_trainer.py: its ragged data and its fairness rule (no timed run here)."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import statistics
from pathlib import Path

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
