"""The `eval` table for preference pairs: every figure of the report, and "n/a" without pairs."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console

from homelab_dp.app.evaluate import PairEvalReport
from homelab_dp.render.evaluate import render_eval

REPORT = PairEvalReport(
    model="dpo-run", data="/p.jsonl", reference="/m/base with the adapters disabled",
    world_size=2, loss=0.5123, reward_accuracy=0.875, reward_margin=0.4321,
    rewards_chosen=0.2, rewards_rejected=-0.2321, pairs=40, identical=2, beta=0.1,
    loss_type="sigmoid", label_smoothing=0.05, seconds=1.5, seq_len=256, device="cpu",
    dtype="fp32", base="fp32",
)  # fmt: skip


def _text(report: PairEvalReport) -> str:
    console = Console(width=140, record=True)
    console.print(render_eval(report))
    return console.export_text()


def test_the_pair_table_shows_every_figure() -> None:
    text = _text(REPORT)
    for needle in ("dpo-run", "/m/base with the adapters disabled",
                   "/p.jsonl (40 pairs, 2 identical left out, seq_len 256)",
                   "2 CPU processes · fp32", "0.5123 per pair (DPO sigmoid, beta 0.1, label "
                   "smoothing 0.05", "87.5%", "+0.4321", "chosen +0.2000, rejected -0.2321",
                   "1.50"):  # fmt: skip
        assert needle in text, text


def test_no_pairs_reads_n_a() -> None:
    empty = replace(REPORT, pairs=0, loss=None, reward_accuracy=None, reward_margin=None,
                    rewards_chosen=None, rewards_rejected=None)  # fmt: skip
    text = _text(empty)
    assert "n/a per pair" in text and "chosen n/a, rejected n/a" in text, text
