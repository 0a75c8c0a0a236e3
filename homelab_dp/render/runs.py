"""Runs as text: the CLI's `runs` table and `status` lines, the rows of the TUI's Runs table.

Each reads the JSON documents of `RunController.list_runs` and `RunController.status` (the
``runs --json`` and ``status --json`` output), so what a person reads is what a script reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text

from homelab_dp.byte_units import format_bytes
from homelab_dp.render.run_view import (
    STATUS_STYLE,
    comm_text,
    eval_summary,
    objective_text,
    prediction_text,
    sample_line,
    scaling_text,
)
from homelab_dp.render.text import duration, mfu_text

NO_RUNS = "no runs yet; start one with: homelab-dp run tiny-demo"


def runs_lines(rows: list[dict[str, Any]]) -> list[str]:
    """`homelab-dp runs`: a header, then one line a run."""
    if not rows:
        return [NO_RUNS]
    out = [f"{'run':<44} {'status':<12} {'steps':>11} {'loss':>8} {'energy':>9}  folder"]
    for r in rows:
        if r.get("exists") is False or "step" not in r:  # gone, or a folder that cannot be read
            word = "gone" if r.get("exists") is False else "damaged"
            out.append(f"{r['run_id']:<44} {word:<12} {'':>11} {'':>8} {'':>9}  {where(r)}")
            continue
        loss = f"{r['loss']:.4f}" if r.get("loss") is not None else "–"
        energy = f"{r['energy_wh']:.2f} Wh" if r.get("energy_wh") else "–"
        steps = f"{r['step']}/{r['total_steps']}"
        out.append(
            f"{r['run_id']:<44} {status_word(r):<12} {steps:>11} {loss:>8} {energy:>9}  {where(r)}"
        )
    if any(r.get("exists") is False for r in rows):
        out.append("gone: the folder was moved or deleted (`homelab-dp runs --forget-gone`)")
    if any(r.get("exists") is not False and "step" not in r for r in rows):
        out.append(
            "damaged: the folder is there but cannot be read (`homelab-dp status RUN` says why)"
        )
    return out


def short_path(path: str | Path) -> str:
    """A path for people: under the home folder it starts with ``~``."""
    path = Path(path)
    try:
        return str(Path("~") / path.relative_to(Path.home()))
    except (ValueError, RuntimeError):  # outside home, or no home to speak of
        return str(path)


def where(row: dict[str, Any]) -> str:
    """The folder a run lives in (its runs folder), shortened with ``~``."""
    return short_path(Path(row["path"]).parent) if row.get("path") else "–"


def status_word(doc: dict[str, Any]) -> str:
    """The status, with a queued run's position: "queued #2"."""
    queue = doc.get("queue")
    if doc.get("status") == "queued" and queue:
        return f"queued #{queue.get('position')}"
    return str(doc.get("status") or "unknown")


def queue_line(queue: dict[str, Any] | None) -> str | None:
    """A queued run's place and what it waits for, in words (None: not queued)."""
    if not queue:
        return None
    waits = ", ".join(queue.get("waiting_for") or []) or "nothing (starting)"
    return f"position {queue.get('position')} in the queue, waiting for {waits}"


def model_text(model: dict[str, Any]) -> str:
    """A run's model: ``org/name (main, commit 1a2b3c4)`` when given by id, else its folder."""
    if not model.get("repo_id"):
        return short_path(model.get("path") or "–")
    commit = f", commit {model['commit'][:7]}" if model.get("commit") else ""
    return f"{model['repo_id']} ({model.get('revision') or 'main'}{commit})"


def status_lines(doc: dict[str, Any]) -> list[str]:
    """`homelab-dp status RUN`: state, strategy, progress and the figures known so far."""
    lines = [
        f"run       {doc['run_id']}",
        *([f"folder    {short_path(doc['path'])}"] if doc.get("path") else []),
        f"status    {doc['status']}" + (f" — {doc['reason']}" if doc.get("reason") else ""),
        *([f"model     {model_text(doc['model'])}"] if doc.get("model") else []),
        f"strategy  {doc['method']} · {doc['distribution']} · {doc['world_size']} process(es)",
        *([f"queue     {queue_line(doc['queue'])}"] if doc.get("queue") else []),
        f"progress  step {doc['step']}/{doc['total_steps']}"
        + (f", loss {doc['loss']:.4f}" if doc.get("loss") is not None else ""),
    ]
    if doc.get("tokens_per_s"):
        mfu = f", {mfu_text(doc.get('mfu'))}" if "mfu" in doc else ""  # a document that has it
        lines.append(f"speed     {doc['tokens_per_s']:,.0f} tokens/s{mfu}")
    speed = doc.get("speed") or {}
    scaling = scaling_text(doc.get("scaling"), speed.get("predicted_speedup"))
    if scaling:  # more than one process: how well they share the work, measured
        comm = comm_text(doc.get("scaling"), speed.get("predicted_exposed_share"))
        lines.append(
            f"scaling   {scaling.removeprefix('scaling ')}" + (f"; {comm}" if comm else "")
        )
    predicted = prediction_text(doc.get("speed"))
    if predicted:
        lines.append(f"predicted {predicted}")
    figures = objective_text(doc.get("objective_figures"))
    if figures:  # a preference objective's latest figures
        named = doc.get("objective") not in (None, "sft")
        lines.append(f"objective {doc['objective'] + ' · ' if named else ''}{figures}")
    if doc.get("peak_memory_bytes"):
        peaks = ", ".join(format_bytes(b) for b in doc["peak_memory_bytes"])
        est = (
            f" (estimate {format_bytes(doc['estimate_bytes'])})"
            if doc.get("estimate_bytes")
            else ""
        )
        lines.append(f"memory    peak per rank {peaks}{est}")
    if doc.get("energy_wh"):
        extra = f", {doc['tokens_per_wh']:,.0f} tokens/Wh" if doc.get("tokens_per_wh") else ""
        cost = f", cost {doc['cost']:.3f}" if doc.get("cost") is not None else ""
        lines.append(f"energy    {doc['energy_wh']:.2f} Wh{extra}{cost}")
    if doc.get("eval"):  # validation while training: the latest eval and the best
        lines.append(f"eval      {eval_summary(doc['eval'])}")
    if doc.get("sample"):
        lines.append(f"sample    {sample_line(doc['sample']).removeprefix('sample ')}")
    if doc.get("last_checkpoint_step") is not None:
        lines.append(f"checkpoint step {doc['last_checkpoint_step']}")
    if doc.get("final_path"):
        lines.append(f"result    {doc['final_path']}")
    for warning in doc.get("stragglers") or []:
        lines.append(f"warning   {warning}")
    return lines


def row_cells(run: dict[str, Any]) -> tuple[Text | str, ...]:
    """One row of the TUI's history: status, steps, final loss, energy, duration, id (a run
    whose folder has gone says so, with nothing else to show)."""
    if run.get("exists") is False or "step" not in run:  # gone, or damaged (cannot be read)
        word = "gone" if run.get("exists") is False else "damaged"
        return (Text(word, style="dim"), "", "", "", "", str(run["run_id"]))
    status = str(run.get("status") or "unknown")
    word = status_word(run)
    steps = f"{run.get('step') or 0}/{run.get('total_steps') or '?'}"
    loss = "-" if run.get("loss") is None else f"{run['loss']:.3f}"
    energy = f"{run.get('energy_wh') or 0.0:.1f} Wh"
    return (
        Text(word, style=STATUS_STYLE.get(status, "")),
        steps,
        loss,
        energy,
        duration(run.get("duration_s")),
        str(run["run_id"]),
    )
