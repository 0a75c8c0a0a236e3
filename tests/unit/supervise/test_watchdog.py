"""The watchdog's decision on recorded heartbeats: a long phase that beats is not a stall, a rank
that stops beating is, and a waiting rank's beats are nobody's progress.

The recording (tests/data/heartbeats/slow-result.jsonl, made by its make_recording.py) is what
the keeper read during a real 2-rank run whose rank 0 spent 20 s saving the result, with
``train.watchdog_s = 6``: rank 0 beats ``saving-result`` every second, rank 1 ``waiting``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from homelab_dp.supervise.watchdog import Stall, Watchdog, progress_key
from tests.conftest import DATA

RECORDING = DATA / "heartbeats" / "slow-result.jsonl"
LIMIT_S = 6.0  # the recorded run's train.watchdog_s
POLL_S = 0.2  # the keeper's poll interval


def recording() -> list[tuple[float, dict[int, dict[str, Any]]]]:
    """(time, every rank's heartbeat) per reading; the pids are this (live) process."""
    rows = []
    for line in RECORDING.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        beats = {int(r): {**b, "pid": os.getpid()} for r, b in row["beats"].items()}
        rows.append((float(row["t"]), beats))
    return rows


def replay(
    rows: list[tuple[float, dict[int, dict[str, Any]]]], until: float, tmp_path: Path
) -> tuple[float, Stall] | None:
    """Poll like the keeper (every 0.2 s) up to ``until``; the first stall and when it came."""
    dog = Watchdog(tmp_path, LIMIT_S)
    now, i, beats = rows[0][0], 0, rows[0][1]
    while now <= until:
        while i < len(rows) and rows[i][0] <= now:
            beats = rows[i][1]
            i += 1
        stall = dog.observe(beats, now)
        if stall is not None:
            return now, stall
        now = round(now + POLL_S, 6)
    return None


def test_the_recording_is_a_save_longer_than_the_limit() -> None:
    rows = recording()
    saving = [t for t, beats in rows if beats[0]["phase"] == "saving-result"]
    assert saving[-1] - saving[0] > 2 * LIMIT_S  # rank 0 saved for longer than the limit
    assert all(beats[1]["phase"] == "waiting" for t, beats in rows if t >= saving[0])
    steps = {beats[0]["step"] for t, beats in rows if t >= saving[0]}
    assert steps == {4}  # no step, no micro-step: only the beats' times change


def test_a_long_phase_that_beats_is_not_a_stall(tmp_path: Path) -> None:
    rows = recording()
    assert replay(rows, rows[-1][0] + 1.0, tmp_path) is None


def test_a_rank_that_stops_beating_in_its_long_phase_is_the_stalled_one(tmp_path: Path) -> None:
    """Rank 0 falls silent 3 s into its save; rank 1 keeps beating ``waiting`` (not progress)."""
    rows = recording()
    start = next(t for t, beats in rows if beats[0]["phase"] == "saving-result")
    frozen = next(beats[0] for t, beats in rows if t >= start + 3)
    silent = [(t, {**beats, 0: frozen}) if t >= start + 3 else (t, beats) for t, beats in rows]
    found = replay(silent, silent[-1][0], tmp_path)
    assert found is not None
    when, stall = found
    last_beat = next(t for t, beats in rows if beats[0] == frozen)
    assert last_beat + LIMIT_S <= when < last_beat + LIMIT_S + 2 * POLL_S
    assert stall.rank == 0 and stall.step == 4
    assert "stopped beating in its saving-result phase after step 4 while the others wait" in (
        stall.message
    )
    assert "no rank made progress for 6 s (train.watchdog_s = 6)" in stall.message


def test_a_silent_rank_is_named_while_the_others_still_beat(tmp_path: Path) -> None:
    """A checkpoint on both ranks (a beat thread each); rank 1 falls silent, rank 0 beats on."""
    rows = []
    for t, beats in recording():
        beats = copy.deepcopy(beats)
        if beats[0]["phase"] != "train":
            for b in beats.values():
                b["phase"] = "checkpoint"
        rows.append((t, beats))
    start = next(t for t, beats in rows if beats[1]["phase"] == "checkpoint")
    frozen = next(beats[1] for t, beats in rows if t >= start + 2)
    rows = [(t, {**beats, 1: frozen}) if t >= start + 2 else (t, beats) for t, beats in rows]
    found = replay(rows, rows[-1][0], tmp_path)
    assert found is not None
    _, stall = found
    assert stall.rank == 1
    assert "rank 1 (pid" in stall.message and "stopped beating in its checkpoint phase" in (
        stall.message
    )
    assert "while rank 0 still beat; no progress on rank 1 for 6 s" in stall.message


def test_in_training_only_a_new_micro_step_is_progress(tmp_path: Path) -> None:
    beat = {"rank": 0, "pid": os.getpid(), "step": 3, "micro": 1, "phase": "train", "time": 1.0}
    dog = Watchdog(tmp_path, LIMIT_S)
    assert dog.observe({0: beat}, 0.0) is None
    assert dog.observe({0: {**beat, "time": 5.0}}, 5.0) is None  # the same micro-step again
    stall = dog.observe({0: {**beat, "time": 6.0}}, 6.0)
    assert stall is not None and stall.step == 3
    assert progress_key({**beat, "phase": "merging"}) != progress_key(
        {**beat, "phase": "merging", "time": 2.0}
    )  # in a long phase every beat counts
    waiting = {**beat, "phase": "waiting"}
    assert progress_key(waiting) == progress_key({**waiting, "time": 2.0})


def test_waiting_ranks_alone_do_not_arm_it_and_are_never_the_culprit(tmp_path: Path) -> None:
    base = {"pid": os.getpid(), "step": 8, "micro": 0, "time": 1.0}
    dog = Watchdog(tmp_path, LIMIT_S)
    assert dog.observe({1: {**base, "rank": 1, "phase": "waiting"}}, 0.0) is None
    assert not dog.armed and dog.observe({1: {**base, "rank": 1, "phase": "waiting"}}, 60) is None
    beats = {0: {**base, "rank": 0, "phase": "train"}, 1: {**base, "rank": 1, "phase": "waiting"}}
    assert dog.observe(beats, 61.0) is None
    stall = dog.observe(beats, 67.0)
    assert stall is not None and stall.rank == 0
