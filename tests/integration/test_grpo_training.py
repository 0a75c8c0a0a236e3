"""GRPO under the real launcher (torchrun, gloo, 1 and 2 CPU processes) on presets/tiny-grpo.

Four launches in all, shared by the module's tests, in fp64 (what is left between runs is
summation order):

- 1 process, uninterrupted: the mean reward rises; every step's rollouts and event figures;
- 2 processes, stopped after step 3 (HOMELAB_DP_STOP_AT_STEP) and resumed: every step's
  rollouts are the same text as the 1-process run's (generation depends on the seed, the step
  and the prompt only: the resume saves no generator state) and the adapters end equal;
- 2 processes with a KL term (beta > 0: the reference is the base with the adapters off) and a
  user reward that raises from step 2 on, rollouts off: step 1's KL is 0 (the adapters start
  at zero), then the run fails naming the function and the prompt, the checkpoint of step 1
  kept, no rollouts written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tomllib

from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.folder.run_folder import create_run_dir
from homelab_dp.runs.run_spec import Launch, Rendezvous, Resolved, RunSpec
from tests.integration.conftest import ROOT, events, final_weights, max_abs_diff, run

pytestmark = pytest.mark.slow
STEPS, STOP = 6, 3
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


def make_grpo_run(root: Path, name: str, *, world: int, accum: int, **grpo: Any) -> Path:
    """A run folder of presets/tiny-grpo.toml for ``world`` processes, fp64."""
    doc: dict[str, Any] = tomllib.loads((ROOT / "presets" / "tiny-grpo.toml").read_text())
    doc["model"]["path"] = str(ROOT / doc["model"]["path"])
    doc["data"]["path"] = str(ROOT / doc["data"]["path"])
    doc["train"].update(max_steps=STEPS, checkpoint_every=grpo.pop("checkpoint_every", 0),
                        grad_accum=accum, sample_every="off")  # fmt: skip
    doc["grpo"].update(grpo)
    doc["hardware"]["nproc"] = world
    source = str(root / "preset.toml")  # user reward files are looked up beside it
    preset = preset_from_dict(doc, source=source)
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
    one = make_grpo_run(root, "one", world=1, accum=2)  # micro 2 × 2: 4 prompts a step
    assert run(one, 1) == 0
    two = make_grpo_run(root, "two", world=2, accum=1)
    assert run(two, 2, stop_at=STOP) == 0
    stopped = events(two)
    assert run(two, 2, resume=True) == 0
    (root / "mine.py").write_text(RAISES)
    bad = make_grpo_run(root, "bad", world=2, accum=1, checkpoint_every=1, beta=0.04,
                        rewards=["mine.py:flaky"], rollouts=False)  # fmt: skip
    rc = run(bad, 2)
    return {"one": one, "two": two, "stopped": stopped, "bad": bad, "bad_rc": rc}


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
    assert 0 <= first["completion_truncated"] <= 1 and first["generation_s"] > 0
    assert first["clipped"] == 0 and first["kl"] is None  # iterations = 1, beta = 0

    a, b = rollouts(one), rollouts(two)
    assert len(a) == len(b) == STEPS
    for step, (ra, rb) in enumerate(zip(a, b, strict=True), start=1):
        assert len(ra) == 4 * 4  # 4 prompts × 4 generations
        assert [r["completion"] for r in ra] == [r["completion"] for r in rb], step
        assert [r["prompt_index"] for r in ra] == [r["prompt_index"] for r in rb]
        assert [r["reward"] for r in ra] == [r["reward"] for r in rb]
    mean = sum(r["reward"] for r in a[0]) / len(a[0])
    assert abs(mean - steps[0]["reward"]) < 1e-12

    stopped = grpo_runs["stopped"]
    assert [e["reason"] for e in stopped if e["type"] == "end"] == ["stopped"]
    assert events(two, "start")[1]["start_step"] == STOP
    steps2 = events(two, "step")
    for x, y in zip(steps, steps2, strict=True):
        assert x["world_size"] == 1 and y["world_size"] == 2
        assert abs(x["loss"] - y["loss"]) < 1e-9 and x["reward"] == y["reward"]
    diff = max_abs_diff(final_weights(one), final_weights(two))
    print(f"adapter max abs diff, 1 process vs 2 processes stopped and resumed: {diff:.3g}")
    assert diff <= WEIGHTS_TOL


@pytest.mark.timeout(900)
def test_kl_to_the_adapters_off_and_a_reward_that_raises_ends_the_run(
    grpo_runs: dict[str, Any],
) -> None:
    bad = grpo_runs["bad"]
    assert grpo_runs["bad_rc"] != 0
    (step1,) = events(bad, "step")
    assert step1["kl"] == 0.0 and step1["reward"] == 0.0  # policy = reference; flaky gives 0
    assert not (bad / "rollouts").exists()  # grpo.rollouts = false
    errors = events(bad, "error")
    assert errors, events(bad)
    assert len({e["message"] for e in errors}) == 1  # every rank ends with the same error
    message = errors[0]["message"]
    assert "reward flaky" in message and "mine.py" in message and "raised on prompt" in message
    assert "ValueError: no plus after step 1" in message and " plus " in message
    assert (bad / "checkpoints" / "step-1").is_dir()
    assert not (bad / "checkpoints" / "step-2").exists()
