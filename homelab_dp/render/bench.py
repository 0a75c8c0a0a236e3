"""A `bench` result for people: one row per task and metric, its value and standard error."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _figure(value: Any) -> str:
    """A metric or its standard error, as lm_eval prints them (4 decimals); "-" for none."""
    return "-" if not isinstance(value, (int, float)) else f"{value:.4f}"


def bench_rows(doc: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(task, metric, value, stderr) for each metric of the `bench --json` document, in its
    order; a task's name only on its first row, its document count beside it."""
    rows = []
    samples = doc.get("samples") or {}
    for task, metrics in doc.get("tasks", {}).items():
        label = f"{task} ({samples[task]})" if task in samples else task
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr"):
                continue
            stderr_key = f"{metric}_stderr" + (f",{filt}" if filt else "")
            rows.append((label, key, _figure(value), _figure(metrics.get(stderr_key))))
            label = ""
    return rows


def bench_caption(doc: dict[str, Any]) -> str:
    """Where it ran, how long, and what was limited."""
    n = int(doc.get("world_size", 1))
    where = "CPU" if doc.get("device") == "cpu" else "GPU"
    parts = [f"{doc.get('model')}", f"{n} {where} process{'es' if n != 1 else ''}",
             f"{float(doc.get('seconds', 0)):.1f} s", f"lm_eval {doc.get('lm_eval', '?')}"]  # fmt: skip
    if doc.get("limit"):
        parts.append(f"--limit {doc['limit']} documents per task")
    return " · ".join(parts)


def render_bench(doc: dict[str, Any]) -> Any:
    """The table `homelab-dp bench` prints."""
    title = "Benchmark (base model)" if doc.get("base") else "Benchmark"
    table = Table(title=title, caption=bench_caption(doc))
    table.add_column("task (documents)", style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("± stderr", justify="right")
    for row in bench_rows(doc):
        table.add_row(*row)
    return table
