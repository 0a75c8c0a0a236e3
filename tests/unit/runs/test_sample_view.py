"""Sample events (answers while training) in what a follower shows: the RunView keeps them (the
latest in ``status --json``, a resume's repeats dropped, their time in the ETA), attach prints a
line for each and its live panel the latest."""

from __future__ import annotations

import io

from rich.console import Console

from homelab_dp.render.run_view import event_line, live_panel, samples_text
from homelab_dp.runs.run_events import SampleEvent, parse_event
from homelab_dp.runs.run_view import RunView


def sample(step: int, prompt: str, text: str, seconds: float = 1.5) -> dict:
    return {"type": "sample", "time": 200.0 + step, "step": step, "prompt": prompt, "text": text,
            "tokens": 7, "seconds": seconds}  # fmt: skip


def step(n: int) -> dict:
    return {"type": "step", "time": 100.0 + n, "step": n, "total_steps": 10, "loss": 2.0,
            "step_time_s": 2.0}  # fmt: skip


def test_the_latest_sample_is_in_status_and_the_eta_counts_the_samples_time() -> None:
    v = RunView()
    for n in (1, 2):
        v.apply(step(n))
    assert v.sample_doc() is None and v.eta_s == 8 * 2.0
    v.apply(sample(2, "Name a colour.", "Red."))
    v.apply(sample(2, "Two plus two?", "4", seconds=2.5))
    assert v.sample_doc() == {"step": 2, "prompt": "Two plus two?", "text": "4", "tokens": 7,
                              "seconds": 2.5}  # fmt: skip
    assert [e.prompt for e in v.samples_at()] == ["Name a colour.", "Two plus two?"]
    assert v.eta_s == 8 * (2.0 + 4.0 / 2)  # 4 s of samples over 2 steps: 2 s a step more
    assert v.copy().samples == v.samples and v.copy().samples is not v.samples


def test_a_resume_drops_the_samples_after_its_checkpoint() -> None:
    v = RunView()
    for n in (2, 4):
        v.apply(sample(n, "p", f"answer {n}"))
    v.apply({"type": "start", "time": 300.0, "total_steps": 10, "start_step": 2})
    assert [e.step for e in v.samples] == [2]


def test_older_readers_and_damaged_lines() -> None:
    e = parse_event({"type": "sample", "time": 5.0, "step": 3, "future_field": 1})
    assert e == SampleEvent(time=5.0, step=3)  # missing fields default, unknown ones ignored
    v = RunView()
    v.apply({"type": "sample", "step": "x", "prompt": 1, "text": None, "seconds": "slow"})
    assert v.skipped_events == 1 and not v.samples


def test_attach_prints_each_sample_and_its_panel_the_latest() -> None:
    v = RunView()
    v.apply(step(2))
    e = sample(2, "Say [red]\nnow", "x" * 100)
    v.apply(e)
    line = event_line(e, v)
    assert line == f'sample at step 2 (7 tokens, 1.5 s): "Say [red] ⏎ now" → "{"x" * 59}…"'
    out = io.StringIO()
    Console(file=out, width=120).print(live_panel(v))
    assert 'sample at step 2 (7 tokens, 1.5 s): "Say [red] ⏎ now"' in out.getvalue()
    assert "samples at step 2 (latest" in samples_text(v).plain
