"""The `eval` result for people: one small table (model, data, processes, loss, perplexity, …;
for preference pairs the reference, DPO loss, reward accuracy and margin)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from homelab_dp.app.evaluate import EvalReport, PairEvalReport


def eval_rows(report: EvalReport) -> list[tuple[str, str]]:
    """(label, value) pairs, in the order the table shows them."""
    ppl = "overflow" if report.perplexity is None else f"{report.perplexity:,.3f}"
    where = "CPU" if report.device == "cpu" else "GPU"
    procs = f"{report.world_size} {where} process{'es' if report.world_size != 1 else ''}"
    return [
        ("model", report.model),
        ("data", f"{report.data} ({report.samples:,} samples, seq_len {report.seq_len})"),
        ("processes", f"{procs} · {report.dtype}"),
        ("base", "NF4 (as the QLoRA run trained on it)" if report.base == "nf4" else report.base),
        ("loss", f"{report.loss:.4f} nats per target token"),
        ("perplexity", ppl),
        ("target tokens", f"{report.tokens:,}"),
        ("tokens/s", f"{report.tokens_per_s:,.0f} (of {report.real_tokens:,} tokens read)"),
        ("seconds", f"{report.seconds:.2f} in the forward passes"),
    ]


def _figure(value: float | None, spec: str) -> str:
    """A figure, or "n/a" where there were no pairs."""
    return "n/a" if value is None else format(value, spec)


def pair_eval_rows(report: PairEvalReport) -> list[tuple[str, str]]:
    """(label, value) pairs of a preference-pair evaluation, in table order."""
    where = "CPU" if report.device == "cpu" else "GPU"
    procs = f"{report.world_size} {where} process{'es' if report.world_size != 1 else ''}"
    left = f", {report.identical:,} identical left out" if report.identical else ""
    smoothing = f", label smoothing {report.label_smoothing:g}" if report.label_smoothing else ""
    return [
        ("model", report.model),
        ("reference", report.reference),
        ("data", f"{report.data} ({report.pairs:,} pairs{left}, seq_len {report.seq_len})"),
        ("processes", f"{procs} · {report.dtype}"),
        ("base", "NF4 (as the QLoRA run trained on it)" if report.base == "nf4" else report.base),
        ("loss", f"{_figure(report.loss, '.4f')} per pair (DPO {report.loss_type}, "
                 f"beta {report.beta:g}{smoothing}; ln 2 = 0.6931 at the reference)"),
        ("reward accuracy", _figure(report.reward_accuracy, ".1%")),
        ("reward margin", _figure(report.reward_margin, "+.4f")),
        ("rewards", f"chosen {_figure(report.rewards_chosen, '+.4f')}, "
                    f"rejected {_figure(report.rewards_rejected, '+.4f')}"),
        ("seconds", f"{report.seconds:.2f} in the forward passes"),
    ]  # fmt: skip


def render_eval(report: EvalReport | PairEvalReport) -> Any:
    """The table `homelab-dp eval` prints."""
    table = Table(title="Evaluation", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    rows = pair_eval_rows(report) if isinstance(report, PairEvalReport) else eval_rows(report)
    for label, value in rows:
        table.add_row(label, value)
    return table
