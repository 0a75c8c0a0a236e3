"""GRPO under the real launcher (torchrun, gloo, 1 and 2 CPU processes) on presets/tiny-grpo.

Four launches in all, shared by the module's tests, in fp64 (what is left between runs is
summation order):

- 1 process, uninterrupted, ``grpo.iterations = 2`` (two optimizer steps on each generated
  batch): the mean reward rises; rollouts written at the generating steps 1, 3, 5; the first
  pass's ratio is 1 (nothing clipped), the second pass's is not (clipped share reported);
- 2 processes, the same, stopped after step 3 (HOMELAB_DP_STOP_AT_STEP: inside a batch's
  passes, so the checkpoint carries the batch and its old log-probabilities) and resumed: every
  generating step's rollouts are the same text as the 1-process run's (generation depends on
  the seed, the step and the prompt only: the resume saves no generator state), every step's
  loss and clipped share the same, and the adapters end equal;
- 2 processes, ``iterations = 1``, started from the 1-process run's result (``model.path`` =
  its run folder, as SFT → GRPO or SFT → DPO chain), with a KL term (beta > 0: the reference is
  that start model, the new adapters off) and a user reward that raises from step 2 on,
  rollouts off: step 1's KL is 0 (the adapters start at zero) and its completions are as short
  as the start run learned, then the run fails naming the function and the prompt, the
  checkpoint of step 1 kept, no rollouts written.

The finished runs are then read by ``status``, ``status --json``, ``runs compare`` and the
Monitor (Textual's pilot): the reward and the latest completions with their rewards.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import tomllib
from textual.widgets import Static

from homelab_dp.app.runs import make_controller
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.folder.run_folder import create_run_dir
from homelab_dp.runs.model_ref import with_local_model
from homelab_dp.runs.run_spec import Launch, Rendezvous, Resolved, RunSpec
from homelab_dp.tui.widgets.chart import Chart
from tests.conftest import run_cli
from tests.integration.conftest import ROOT, events, final_weights, max_abs_diff, run
from tests.tui.conftest import open_monitor, plain, shows_snapshot

pytestmark = pytest.mark.slow
STEPS, STOP, ITERATIONS = 6, 3, 2
GENERATING = [1, 3, 5]
"""The steps that generate (the others make the second pass over their batch)."""
WEIGHTS_TOL = 1e-10
RAISES = """
import os
from pathlib import Path

def flaky(prompts, completions, **columns):
    # each rank's reward process counts its calls: from the second on (step 2), a prompt
    # with "plus" in it raises
    calls = Path(__file__).with_suffix(f".{os.getppid()}")
    n = int(calls.read_text()) if calls.exists() else 0
    calls.write_text(str(n + 1))
    if n >= 1 and any("plus" in p for p in prompts):
        raise ValueError("no plus after step 1")
    return [0.0] * len(completions)
"""


def make_grpo_run(root: Path, name: str, *, world: int, accum: int, start: Path | None = None,
                  **grpo: Any) -> Path:  # fmt: skip
    """A run folder of presets/tiny-grpo.toml for ``world`` processes, fp64; ``start``: a run
    folder whose result it starts from (``model.path``, resolved as `homelab-dp run` does)."""
    doc: dict[str, Any] = tomllib.loads((ROOT / "presets" / "tiny-grpo.toml").read_text())
    doc["model"]["path"] = str(start or ROOT / doc["model"]["path"])
    doc["data"]["path"] = str(ROOT / doc["data"]["path"])
    doc["train"].update(max_steps=STEPS, checkpoint_every=grpo.pop("checkpoint_every", 0),
                        grad_accum=accum, sample_every="off")  # fmt: skip
    doc["grpo"].update(grpo)
    doc["hardware"]["nproc"] = world
    source = str(root / "preset.toml")  # user reward files are looked up beside it
    preset, _ = with_local_model(preset_from_dict(doc, source=source), root)
    t = preset.train
    resolved = Resolved(method="lora", distribution="ddp", activation_checkpointing=False,
                        device="cpu", world_size=world, dtype="fp64", micro_batch=t.micro_batch,
                        grad_accum=accum, lr=t.lr, offload="none",
                        offload_activations=False)  # fmt: skip
    launch = Launch(nproc_per_node=world, rendezvous=Rendezvous())
    return create_run_dir(RunSpec(run_id=name, preset=preset, resolved=resolved, launch=launch),
                          root)  # fmt: skip


def rollouts(run_dir: Path) -> list[list[dict[str, Any]]]:
    """Every step's rollouts, in step order."""
    files = sorted((run_dir / "rollouts").glob("step-*.jsonl"))
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("grpo")
    # micro 2 × 2: 4 prompts a step; two optimizer steps on each generated batch
    one = make_grpo_run(root, "one", world=1, accum=2, iterations=ITERATIONS)
    assert run(one, 1) == 0
    two = make_grpo_run(root, "two", world=2, accum=1, iterations=ITERATIONS)
    assert run(two, 2, stop_at=STOP) == 0
    stopped = events(two)
    assert run(two, 2, resume=True) == 0
    (root / "mine.py").write_text(RAISES)
    bad = make_grpo_run(root, "bad", world=2, accum=1, start=one, checkpoint_every=1,
                        beta=0.04, rewards=["mine.py:flaky"], rollouts=False)  # fmt: skip
    rc = run(bad, 2)
    return {"root": root, "one": one, "two": two, "stopped": stopped, "bad": bad, "bad_rc": rc}


@pytest.mark.timeout(900)  # four launches in the fixture
def test_the_reward_rises_and_1_process_equals_2_stopped_and_resumed(
    grpo_runs: dict[str, Any],
) -> None:
    one, two = grpo_runs["one"], grpo_runs["two"]
    assert events(one, "start")[0]["objective"] == "grpo"
    steps = events(one, "step")
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    rewards = [e["reward"] for e in steps]
    print("mean reward by step (1 process):", [round(r, 3) for r in rewards])
    assert sum(rewards[-2:]) / 2 > rewards[0] + 0.3  # rises clearly
    first = steps[0]
    assert first["reward_length"] == first["reward"]  # one reward of weight 1
    assert 1 <= first["completion_length_min"] <= first["completion_length"]
    assert first["completion_length"] <= first["completion_length_max"] <= 16
    assert 0 <= first["completion_truncated"] <= 1 and first["kl"] is None  # beta = 0
    for e in steps:  # iterations = 2: the odd steps generate, the even ones reuse their batch
        again = e["step"] not in GENERATING
        before = steps[e["step"] - 2] if again else None
        print(f"step {e['step']}: loss {e['loss']:.6f}, clipped {e['clipped']:.3f}")
        if not again:  # the first pass: ratio = 1 exactly (old log-probs = this policy's)
            assert e["clipped"] == 0 and e["generation_s"] > 0
        else:  # the second: the same batch, the ratio to the policy that generated it
            assert e["generation_s"] == 0 and e["reward"] == before["reward"]
            assert e["completion_length"] == before["completion_length"]
            assert e["loss"] != before["loss"]
    # the ratio moved past epsilon for some tokens in a second pass
    assert max(e["clipped"] for e in steps if e["step"] not in GENERATING) > 0

    a, b = rollouts(one), rollouts(two)
    assert sorted(p.name for p in (one / "rollouts").iterdir()) == [
        f"step-{s:06d}.jsonl" for s in GENERATING
    ]
    assert len(a) == len(b) == len(GENERATING)
    for step, (ra, rb) in enumerate(zip(a, b, strict=True), start=1):
        assert len(ra) == 4 * 4  # 4 prompts × 4 generations
        assert [r["completion"] for r in ra] == [r["completion"] for r in rb], step
        assert [r["prompt_index"] for r in ra] == [r["prompt_index"] for r in rb]
        assert [r["reward"] for r in ra] == [r["reward"] for r in rb]
    assert len({r["prompt_index"] for ra in a for r in ra}) == 4 * len(GENERATING)  # new each
    mean = sum(r["reward"] for r in a[0]) / len(a[0])
    assert abs(mean - steps[0]["reward"]) < 1e-12

    stopped = grpo_runs["stopped"]
    assert [e["reason"] for e in stopped if e["type"] == "end"] == ["stopped"]
    assert events(two, "start")[1]["start_step"] == STOP
    saved = json.loads((two / "checkpoints" / f"step-{STOP}" / "trainer.json").read_text())
    batch = saved["objective"]  # stopped between the two passes: the batch goes with it
    assert batch["step"] == STOP and len(batch["prompts"]) == 4
    steps2 = events(two, "step")
    for x, y in zip(steps, steps2, strict=True):
        assert x["world_size"] == 1 and y["world_size"] == 2
        assert abs(x["loss"] - y["loss"]) < 1e-9 and x["reward"] == y["reward"]
        assert abs(x["clipped"] - y["clipped"]) < 1e-12
    diff = max_abs_diff(final_weights(one), final_weights(two))
    print(f"adapter max abs diff, 1 process vs 2 processes stopped and resumed: {diff:.3g}")
    assert diff <= WEIGHTS_TOL


@pytest.mark.timeout(900)
def test_kl_to_the_adapters_off_and_a_reward_that_raises_ends_the_run(
    grpo_runs: dict[str, Any],
) -> None:
    bad, one = grpo_runs["bad"], grpo_runs["one"]
    assert grpo_runs["bad_rc"] != 0
    (step1,) = events(bad, "step")
    assert step1["kl"] == 0.0 and step1["reward"] == 0.0  # policy = reference; flaky gives 0
    # It started from the 1-process run's result (its adapter merged into the base at load):
    # its first completions are as short as that run learned, not the base's (which run on).
    start = events(bad, "start")[0]
    assert json.loads((bad / "spec.json").read_text())["preset"]["model"]["adapter"] == str(
        one / "final"
    )
    first_of_one = events(one, "step")[0]["completion_length"]
    print(f"mean completion length at step 1: base {first_of_one:.2f}, "
          f"chained {step1['completion_length']:.2f}")  # fmt: skip
    assert step1["completion_length"] < first_of_one - 3 and start["objective"] == "grpo"
    assert not (bad / "rollouts").exists()  # grpo.rollouts = false
    errors = events(bad, "error")
    assert errors, events(bad)
    assert len({e["message"] for e in errors}) == 1  # every rank ends with the same error
    message = errors[0]["message"]
    assert "reward flaky" in message and "mine.py" in message and "raised on prompt" in message
    assert "ValueError: no plus after step 1" in message and " plus " in message
    assert (bad / "checkpoints" / "step-1").is_dir()
    assert not (bad / "checkpoints" / "step-2").exists()


async def _monitor(root: Path, one: Path, bad: Path) -> None:
    """The Monitor of the finished runs: the reward charted beside the loss, the latest
    generating step's completions with their rewards (none for the run with rollouts off)."""
    controller = make_controller(root)
    steps = events(one, "step")
    latest = rollouts(one)[-1]
    async with open_monitor(controller, one.name, shows_snapshot) as (app, _, _):
        screen = app.screen
        reward = screen.query_one("#chart-reward", Chart)
        assert reward.display and reward.values == [e["reward"] for e in steps]
        assert screen.query_one("#chart-loss", Chart).values == [e["loss"] for e in steps]
        assert screen.query_one("#rollouts", Static).display
        text = plain(app, "#rollouts")
        assert f"completions at step {GENERATING[-1]} ({len(latest)} in all)" in text
        row = latest[0]
        assert (f"prompt {row['prompt_index']} reward {row['reward']:.3f} "
                f"(length {row['rewards']['length']:.3f})") in text  # fmt: skip
        assert " ".join(row["completion"].split())[:40] in " ".join(text.split())
        assert f"… {len(latest) - 8} more in" in text
    async with open_monitor(controller, bad.name, shows_snapshot) as (app, _, _):
        assert app.screen.query_one("#chart-reward", Chart).values == [0.0]
        assert not app.screen.query_one("#rollouts", Static).display  # grpo.rollouts = false


@pytest.mark.timeout(900)
def test_status_compare_and_the_monitor_show_the_reward_and_the_completions(
    grpo_runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    root, one, bad = grpo_runs["root"], grpo_runs["one"], grpo_runs["bad"]
    last = events(one, "step")[-1]
    rc, out, _ = run_cli(capsys, "status", str(one))
    assert rc == 0, out
    assert f"reward {last['reward']:.3f} ± {last['reward_std']:.3f}, completion " \
           f"{last['completion_length']:.1f} tokens" in out  # fmt: skip
    rc, out, _ = run_cli(capsys, "status", str(one), "--json")
    figures = json.loads(out)["objective_figures"]
    for name in ("reward", "reward_std", "reward_length", "completion_length",
                 "completion_length_min", "completion_length_max", "completion_truncated",
                 "clipped", "generation_s"):  # fmt: skip
        assert figures[name] == last[name], name
    rc, out, _ = run_cli(capsys, "runs", "compare", str(one), str(bad), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["sorted_by"] == "reward"  # no eval loss: the highest reward first
    assert [r["run_id"] for r in doc["runs"]] == ["one", "bad"]
    assert doc["runs"][0]["reward"] == last["reward"] and doc["runs"][1]["reward"] == 0.0
    rc, out, _ = run_cli(capsys, "runs", "compare", str(one), str(bad))
    assert rc == 0 and "2 runs, highest reward first" in out
    assert f"rewards: reward {last['reward']:.3f} ± {last['reward_std']:.3f}" in out
    asyncio.run(_monitor(root, one, bad))
