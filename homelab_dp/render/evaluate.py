"""The `eval` result for people: one small table (model, data, processes, loss, perplexity, …)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from homelab_dp.app.evaluate import EvalReport


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


def render_eval(report: EvalReport) -> Any:
    """The table `homelab-dp eval` prints."""
    table = Table(title="Evaluation", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for label, value in eval_rows(report):
        table.add_row(label, value)
    return table
