"""Validation while training without processes: the schedule and the early-stopping rule
(`train.evaluation.validator.Validator`), the view of eval events (`runs.run_view`) and their lines
(`render`). The runs themselves: tests/integration/test_validation.py."""

from __future__ import annotations

import io

from rich.console import Console

from homelab_dp.render.run_view import eval_line, event_line, live_panel
from homelab_dp.render.runs import status_lines
from homelab_dp.runs.run_view import RunView
from homelab_dp.train.evaluation.eval_loss import EvalResult
from homelab_dp.train.evaluation.validator import Validator


def result(loss: float, tokens: int = 100) -> EvalResult:
    return EvalResult(loss_sum=loss * tokens, tokens=tokens, real_tokens=tokens, seconds=0.5)


def test_due_every_n_steps_and_at_the_last() -> None:
    assert [s for s in range(1, 11) if Validator(None, 3, 0).due(s, 10)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if Validator(None, 0, 0).due(s, 10)] == [10]
    assert [s for s in range(1, 9) if Validator(None, 4, 0).due(s, 8)] == [4, 8]


def test_early_stopping_after_patience_evaluations_without_a_lower_loss() -> None:
    v = Validator(None, 1, patience=2)
    losses = [5.0, 4.0, 4.0, 4.5, 3.9, 4.1, 3.95]  # an equal loss is no improvement
    verdicts = [v.record(step, result(loss)) for step, loss in enumerate(losses, 1)]
    assert [d.best for d in verdicts] == [True, True, False, False, True, False, False]
    assert [d.stop for d in verdicts] == [False, False, False, True, False, False, True]
    assert (v.best_loss, v.best_step, v.since_best) == (3.9, 5, 2)
    event = verdicts[0].event
    assert (event.step, event.loss, event.tokens, event.seconds) == (1, 5.0, 100, 0.5)
    assert abs(event.perplexity - 148.4131591) < 1e-6
    assert result(800.0).perplexity == float("inf")
    assert Validator(None, 1, 0).record(1, result(800.0)).event.perplexity is None  # JSON-safe


def test_a_restored_validator_decides_as_an_uninterrupted_one() -> None:
    losses = [3.0, 2.5, 2.6, 2.4, 2.45, 2.5, 2.41]
    whole = Validator(None, 1, patience=3)
    expected = [
        (d.best, d.stop) for d in (whole.record(i, result(x)) for i, x in enumerate(losses, 1))
    ]
    first = Validator(None, 1, patience=3)
    got = [
        (d.best, d.stop) for d in (first.record(i, result(x)) for i, x in enumerate(losses[:5], 1))
    ]
    resumed = Validator(None, 1, patience=3)
    resumed.restore(first.state())  # what the checkpoint of step 5 holds
    got += [(d.best, d.stop) for d in (resumed.record(i, result(x)) for i, x in
                                       enumerate(losses[5:], 6))]  # fmt: skip
    assert got == expected and expected[-1] == (False, True)
    fresh = Validator(None, 1, 3)
    fresh.restore(None)  # a checkpoint of a run without eval data
    assert (fresh.best_loss, fresh.since_best) == (None, 0)


def eval_event(step: int, loss: float, best: bool = False) -> dict:
    return {"type": "eval", "time": 100.0 + step, "step": step, "loss": loss,
            "perplexity": 2.718281828**loss, "tokens": 5120, "seconds": 0.3,
            "best": best}  # fmt: skip


def test_the_view_keeps_every_eval_the_latest_and_the_best() -> None:
    v = RunView(run_id="r")
    assert v.last_eval is None and v.eval_doc() is None
    for step, loss in [(10, 2.5), (20, 2.31), (30, 2.4)]:
        v.apply(eval_event(step, loss))
    assert [e.loss for e in v.evals] == [2.5, 2.31, 2.4]
    assert v.eval_doc() == {"step": 30, "loss": 2.4, "perplexity": 2.718281828**2.4,
                            "tokens": 5120, "best_step": 20, "best_loss": 2.31}  # fmt: skip
    copy = v.copy()
    v.apply(eval_event(40, 2.0))
    assert len(copy.evals) == 3 and copy.best_eval.step == 20  # the copy shares nothing
    # A resume from step 20 evaluates the later steps again: their old evals go.
    v.apply({"type": "start", "time": 200.0, "start_step": 20})
    assert [e.step for e in v.evals] == [10, 20] and v.best_eval.step == 20
    v.apply({"type": "end", "time": 300.0, "reason": "early_stopped", "steps": 25})
    assert v.status == "completed" and v.end_reason == "early_stopped"


def test_the_start_line_says_what_is_evaluated_and_when() -> None:
    v = RunView(run_id="r")
    start = {"type": "start", "method": "full", "distribution": "ddp", "world_size": 2,
             "total_steps": 60, "eval_blocks": 3, "eval_every": 20}  # fmt: skip
    v.apply(start)
    assert event_line(start, v) == (
        "started r: full · ddp, 2 process(es), 60 steps, evaluating 3 blocks every 20 steps "
        "and at the end"
    )
    assert event_line({**start, "eval_every": 0, "eval_blocks": 1}, v).endswith(
        "60 steps, evaluating 1 block at the end"
    )
    assert event_line({**start, "eval_blocks": 0}, v).endswith("60 steps")  # no eval data
    # Which attention ran and whether packing was checked exact (the start event says why).
    ran = {**start, "eval_blocks": 0, "attention": "sdpa", "packing": "exact"}
    assert event_line(ran, v).endswith("60 steps, attention sdpa, packing exact")


def test_the_lines_of_an_eval() -> None:
    e = eval_event(20, 2.31, best=True)
    assert eval_line(e) == "eval step 20: loss 2.3100, ppl 10.1, 5,120 tokens (best so far)"
    v = RunView(run_id="r")
    v.apply(e)
    assert event_line(e, v) == eval_line(e)
    v.apply(eval_event(30, 2.4))
    doc = {"run_id": "r", "status": "running", "method": "full", "distribution": "ddp",
           "world_size": 2, "step": 30, "total_steps": 60, "loss": 2.0,
           "eval": v.eval_doc()}  # fmt: skip
    assert "eval      step 30: loss 2.4000, ppl 11.0, 5,120 tokens · best 2.3100 at step 20" in (
        status_lines(doc)
    )
    assert not [line for line in status_lines({**doc, "eval": None}) if "eval" in line]
    console = Console(width=120, file=io.StringIO(), color_system=None)
    with console.capture() as captured:
        console.print(live_panel(v))
    assert "eval step 30: loss 2.4000, ppl 11.0, 5,120 tokens · best 2.3100 at step 20" in (
        captured.get()
    )
