"""GRPO's prompts and rewards at run time: the built-ins, a user function in its own process
with a time limit, and every way a reward can fail named with its function and prompt."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from homelab_dp.data.prompt_records import read_prompts
from homelab_dp.errors import DataError, RunFailedError
from homelab_dp.presets.reward_specs import reward_specs
from homelab_dp.render.run_view import objective_text
from homelab_dp.runs.run_events import StepEvent, parse_event
from homelab_dp.runs.run_view import RunView
from homelab_dp.train.loop.reporting import step_scalars
from homelab_dp.train.objectives.reward_functions import RewardError, Rewards, final_answer
from homelab_dp.tui.screens.monitor import OBJECTIVE_CHARTS


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prompts_and_chat_prompts_keep_their_other_columns(tmp_path: Path) -> None:
    data = _write(tmp_path / "p.jsonl", [
        {"prompt": "2+2=", "answer": "4"},
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "3+4?"}], "answer": 7, "level": "easy"},
    ])  # fmt: skip
    got = read_prompts(str(data))
    assert [r.chat for r in got] == [False, True]
    assert got[1].columns == {"answer": 7, "level": "easy"}
    assert got[0].where == f"{data}:1"
    renamed = _write(tmp_path / "q.jsonl", [{"question": "1+1=", "answer": "2"}])
    (got,) = read_prompts(str(renamed), columns={"prompt": "question"})
    assert got.prompt == "1+1=" and got.columns == {"answer": "2"}


def test_bad_prompt_records_are_named_by_file_and_line(tmp_path: Path) -> None:
    data = _write(tmp_path / "p.jsonl", [
        {"prompt": "ok"}, {"text": "no prompt"},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"prompt": ""},
    ])  # fmt: skip
    with pytest.raises(DataError) as exc:
        read_prompts(str(data))
    message = exc.value.message
    assert f"{data}:2: no 'prompt' or 'messages' field (fields: text)" in message
    assert f"{data}:3: field 'messages' ends with an assistant turn" in message
    assert f"{data}:4: field 'prompt' must be a non-empty string" in message


def test_the_builtin_rewards() -> None:
    assert final_answer("so 3 + 4 = 7, not 1,000") == "1000"
    assert final_answer(r"first \boxed{12} then \boxed{x+1} and 5") == "x+1"
    assert final_answer("no digits") is None
    specs = reward_specs(["exact_answer", "regex:^<a>.*</a>$", "length:3,6"])
    rewards = Rewards(specs, timeout_s=5)
    completions = ["it is 4", "<a>\n7.0</a>", "1,000,000 chars more"]
    got = rewards.score(["p"] * 3, completions, {"answer": ["4", 7, "1000"]}, [0, 1, 2])
    assert [row[0] for row in got] == [1.0, 1.0, 0.0]
    assert [row[1] for row in got] == [0.0, 1.0, 0.0]
    # 7 chars: 1 − 1/6; 11 chars: 1 − 5/6; 20 chars: 1 − 14/6 clamped to 0
    assert [row[2] for row in got] == pytest.approx([1 - 1 / 6, 1 - 5 / 6, 0.0])


def test_exact_answer_without_an_answer_column_names_the_prompt() -> None:
    rewards = Rewards(reward_specs(["exact_answer"]), timeout_s=5)
    with pytest.raises(RewardError, match=r"reward exact_answer raised on prompt 3 \('what\?'\)"):
        rewards.score(["what?"], ["4"], {}, [3])


USER = """
import math, time

def good(prompts, completions, **columns):
    return [float(len(c)) + columns["bonus"][i] for i, c in enumerate(completions)]

def raises_on_b(prompts, completions, **columns):
    if "b" in prompts:
        raise ValueError("no b")
    return [1.0] * len(completions)

def short(prompts, completions, **columns):
    return [1.0]

def nan(prompts, completions, **columns):
    return [1.0, math.nan][: len(completions)]

def slow(prompts, completions, **columns):
    time.sleep(30)
    return [0.0] * len(completions)
"""


@pytest.fixture(scope="module")
def user_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "mine.py").write_text(USER)
    return str(folder / "preset.toml")


def _score(source: str, name: str, timeout: float = 20) -> list[list[float]]:
    rewards = Rewards(reward_specs([f"mine.py:{name}"], source), timeout_s=timeout)
    try:
        return rewards.score(["a", "b"], ["xy", "xyz"], {"bonus": [0.5, 0.25]}, [10, 11])
    finally:
        rewards.close()


def test_a_user_reward_runs_in_its_own_process(user_file: str) -> None:
    assert _score(user_file, "good") == [[2.5], [3.25]]


@pytest.mark.parametrize(("name", "message"), [
    ("raises_on_b", r"reward raises_on_b \(.*mine.py\) raised on prompt 11 \('b'\): "
                    r"ValueError: no b"),
    ("short", r"reward short \(.*mine.py\) returned 1 values for 2 completions \(prompts 10..11\)"),
    ("nan", r"reward nan \(.*mine.py\) returned nan for a completion of prompt 11 \('b'\)"),
])  # fmt: skip
def test_a_failing_user_reward_ends_the_run_naming_it_and_the_prompt(
    user_file: str, name: str, message: str
) -> None:
    with pytest.raises(RewardError, match=message) as exc:
        _score(user_file, name)
    assert isinstance(exc.value, RunFailedError) and exc.value.exit_code == 1


def test_a_slow_user_reward_is_stopped_at_its_time_limit(user_file: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"reward slow \(.*\) on prompts 10..11 took more than"):
        _score(user_file, "slow", timeout=1.5)
    assert time.perf_counter() - t0 < 25  # liveness: the 30 s sleep was not waited for


def test_grpo_step_figures_round_trip_and_reach_the_loggers() -> None:
    event = StepEvent(step=3, loss=0.5, reward=0.75, reward_std=0.25, clipped=0.0,
                      reward_functions={"exact_answer": 0.5, "brevity": 1.25},
                      completion_length=7.5, generation_s=0.2)  # fmt: skip
    line = event.to_json()
    assert line["reward_exact_answer"] == 0.5 and line["reward_brevity"] == 1.25
    assert "reward_functions" not in line
    back = parse_event(json.loads(json.dumps(line)))
    assert isinstance(back, StepEvent)
    assert back.reward_functions == {"exact_answer": 0.5, "brevity": 1.25}
    assert back.reward == 0.75 and back.completion_length == 7.5
    scalars = step_scalars(back)
    assert scalars["train/reward"] == 0.75 and scalars["train/reward_brevity"] == 1.25
    assert scalars["train/completion_length"] == 7.5 and "train/kl" not in scalars
    sft = StepEvent(step=1, loss=1.0)  # another objective: no reward keys at all
    assert not [k for k in sft.to_json() if k.startswith("reward_") and k != "reward_margin"
                and k != "reward_accuracy" and k != "reward_std"]  # fmt: skip


def test_status_and_the_monitor_read_grpos_reward() -> None:
    view = RunView()
    for step, reward in ((1, 0.125), (2, 0.5)):
        line = StepEvent(step=step, total_steps=2, loss=0.1, reward=reward, reward_std=0.25,
                         completion_length=9.5, clipped=0.0,
                         reward_functions={"length": reward}).to_json()  # fmt: skip
        view.apply(json.loads(json.dumps(line)))
    doc = view.objective_doc()
    assert doc is not None and doc["reward"] == 0.5 and doc["completion_length"] == 9.5
    assert view.series("reward") == [0.125, 0.5]  # the Monitor's chart
    assert "reward" in [figure for figure, _, _ in OBJECTIVE_CHARTS]
    assert objective_text(doc) == "reward 0.500 ± 0.250, completion 9.5 tokens"


def test_status_shows_every_grpo_figure_of_the_latest_step() -> None:
    view = RunView()
    line = StepEvent(step=2, total_steps=4, loss=0.1, reward=0.5, reward_std=0.25,
                     completion_length=9.5, completion_length_min=2.0,
                     completion_length_max=16.0, completion_truncated=0.125, clipped=0.0625,
                     kl=0.002, generation_s=1.5,
                     reward_functions={"length": 0.75, "exact_answer": 0.25}).to_json()  # fmt: skip
    view.apply(json.loads(json.dumps(line)))
    doc = view.objective_doc()  # status --json's objective_figures
    assert doc is not None
    assert {k: doc[k] for k in ("reward_length", "reward_exact_answer", "completion_length_min",
                                "completion_length_max", "completion_truncated", "clipped",
                                "kl", "generation_s")} == {
        "reward_length": 0.75, "reward_exact_answer": 0.25, "completion_length_min": 2.0,
        "completion_length_max": 16.0, "completion_truncated": 0.125, "clipped": 0.0625,
        "kl": 0.002, "generation_s": 1.5}  # fmt: skip
    assert objective_text(doc) == ("reward 0.500 ± 0.250, completion 9.5 tokens, clipped 6.2%, "
                                   "KL 0.0020, generation 1.5 s")  # fmt: skip
