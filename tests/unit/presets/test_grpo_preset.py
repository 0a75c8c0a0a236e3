"""The ``[grpo]`` section and its rewards: every field documented, bad values one `error:` line
naming the field (exit 2, nothing started), user reward files looked up beside the preset and
their function found without running them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from homelab_dp.errors import PresetError
from homelab_dp.presets.grpo_section import GrpoSection
from homelab_dp.presets.preset import field_docs, load_preset, preset_from_dict
from homelab_dp.presets.reward_specs import parse_reward, reward_specs
from tests.conftest import run_cli

GRPO = ["--set", "train.objective=grpo", "--set", 'grpo.rewards=["exact_answer"]']

BAD = [
    (["grpo.generations=1"], "grpo.generations: must be at least 2"),
    (["grpo.generations=0"], "grpo.generations: must be at least 1"),
    (["grpo.max_completion_tokens=0"], "grpo.max_completion_tokens: must be at least 1"),
    (["grpo.temperature=0"], "grpo.temperature: must be greater than 0"),
    (["grpo.top_p=0"], "grpo.top_p: must be above 0 and at most 1"),
    (["grpo.top_p=1.5"], "grpo.top_p: must be above 0 and at most 1"),
    (["grpo.top_k=-1"], "grpo.top_k: must not be negative"),
    (["grpo.beta=-0.1"], "grpo.beta: must not be negative"),
    (["grpo.epsilon=0"], "grpo.epsilon: must be above 0 and below 1"),
    (["grpo.epsilon_high=-1"], "grpo.epsilon_high: must not be negative"),
    (["grpo.loss=ppo"], "grpo.loss: expected 'grpo' | 'dr_grpo' | 'dapo'"),
    (["grpo.scale_rewards=rank"], "grpo.scale_rewards: expected 'group' | 'batch' | 'none'"),
    (["grpo.iterations=0"], "grpo.iterations: must be at least 1"),
    (["train.distribution=fsdp-full"], "train.distribution: GRPO runs under ddp"),
    (["grpo.beta=0.04", "train.method=full"], "grpo.beta: the KL's reference is the base"),
    (["grpo.rewards=[]"], "grpo.rewards: required"),
    (["grpo.reward_weights=[1.0, 2.0]"], "grpo.reward_weights: 2 weight(s) for 1 reward(s)"),
    (['grpo.rewards=["regex:("]'], "grpo.rewards[0]: 'regex:(' is not a valid regular"),
    (['grpo.rewards=["length:9"]'], "grpo.rewards[0]: 'length:9': expected length:MIN,MAX"),
    (['grpo.rewards=["length:9,3"]'], "grpo.rewards[0]: 'length:9,3': needs 0 <= MIN <= MAX"),
    (['grpo.rewards=["f1"]'], "grpo.rewards[0]: 'f1' is not a reward"),
    (['grpo.rewards=["missing.py:f"]'], "grpo.rewards[0]: 'missing.py:f': no file"),
    (["grpo.engine=vllm"], "grpo.engine: expected 'auto' | 'transformers'"),
    (["data.format=completion"], "data.format: GRPO reads prompts"),
    (["data.eval_fraction=0.1"], "data.eval_path / data.eval_fraction: GRPO has no held-out"),
    (["train.sample_every=5"], "train.sample_every: GRPO samples its own prompts"),
]  # fmt: skip


@pytest.mark.parametrize(("sets", "message"), BAD, ids=[m.split(":")[0] + str(i)
                                                         for i, (_, m) in enumerate(BAD)])  # fmt: skip
def test_a_bad_grpo_setting_is_one_error_line_naming_the_field(
    in_repo: Path, capsys: pytest.CaptureFixture[str], sets: list[str], message: str
) -> None:
    argv = GRPO + [a for s in sets for a in ("--set", s)]
    rc, out, err = run_cli(capsys, "plan", "tiny-demo", *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and out == ""
    assert len(lines) == 2 and lines[0].startswith("error: ") and message in lines[0], err
    assert lines[1].startswith("hint: ") and "Traceback" not in err


def test_run_with_a_missing_reward_function_starts_nothing(
    in_repo: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "rewards.py").write_text(
        "def brevity(prompts, completions, **kw):\n    return []\n"
    )
    preset = tmp_path / "p.toml"
    preset.write_text(
        (in_repo / "presets" / "tiny-demo.toml").read_text().replace(
            'path = "assets/', f'path = "{in_repo}/assets/'
        ) + '\n[grpo]\nrewards = ["rewards.py:brevty"]\n'
    )  # fmt: skip
    rc, _, err = run_cli(capsys, "run", str(preset), "--set", "train.objective=grpo", "--detach")
    first = err.splitlines()[0]
    assert rc == 2 and "grpo.rewards[0]" in first and "no function 'brevty'" in first, err
    assert "brevity" in first  # the functions the file does define
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    assert not runs.exists() or not any(runs.iterdir())


def test_every_grpo_field_is_documented() -> None:
    docs = field_docs()
    names = list(GrpoSection.__dataclass_fields__)
    for name in ("generations", "max_completion_tokens", "temperature", "top_p", "top_k",
                 "beta", "epsilon", "epsilon_high", "loss", "scale_rewards", "iterations",
                 "rewards", "reward_weights"):  # fmt: skip
        assert name in names
    for name in names:
        assert docs.get(f"grpo.{name}"), name


def test_several_steps_on_each_batch_and_fsdp() -> None:
    """grpo.iterations > 1 is a setting like the others (it was refused before the loop reused
    a batch); a sharded strategy is refused naming the field and what to set instead."""
    doc = {"model": {"path": "m"}, "data": {"path": "d"},
           "train": {"objective": "grpo"}, "grpo": {"rewards": ["exact_answer"]}}  # fmt: skip
    assert preset_from_dict({**doc, "grpo": {**doc["grpo"], "iterations": 4}}).grpo.iterations == 4
    with pytest.raises(PresetError) as exc:
        preset_from_dict({**doc, "train": {**doc["train"], "distribution": "fsdp-full"}})
    (problem,) = exc.value.problems
    assert problem.startswith("train.distribution: GRPO runs under ddp")
    assert "set train.distribution = 'ddp'" in problem and "docs/grpo.md" in problem


def test_the_section_is_read_only_for_grpo() -> None:
    """Another objective ignores [grpo] (its defaults include an empty reward list)."""
    preset_from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "grpo": {"generations": 1}})
    with pytest.raises(PresetError) as exc:
        preset_from_dict({"model": {"path": "m"}, "data": {"path": "d"},
                          "train": {"objective": "grpo"}, "grpo": {"generations": 1}})  # fmt: skip
    assert [p.split(":")[0] for p in exc.value.problems] == ["grpo.generations", "grpo.rewards"]


def test_user_rewards_are_found_beside_the_preset_without_running_them(tmp_path: Path) -> None:
    folder = tmp_path / "presets"
    folder.mkdir()
    (folder / "mine.py").write_text(
        "raise SystemExit('never run')\n\ndef brevity(prompts, completions, **kw):\n"
        "    return [0.0] * len(completions)\n"
    )  # fmt: skip
    toml = folder / "p.toml"
    toml.write_text('[model]\npath = "m"\n[data]\npath = "d"\n[train]\nobjective = "grpo"\n'
                    '[grpo]\nrewards = ["mine.py:brevity", "exact_answer", "regex:^a", '
                    '"regex:b$", "length:2,5"]\nreward_weights = [0.5, 1, 1, 1, 1]\n')  # fmt: skip
    preset = load_preset(toml)
    specs = reward_specs(preset.grpo.rewards, preset.source)
    assert [s.name for s in specs] == ["brevity", "exact_answer", "regex", "regex_2", "length"]
    assert specs[0].file == str((folder / "mine.py").resolve()) and specs[0].function == "brevity"
    assert (specs[4].low, specs[4].high) == (2, 5)
    with pytest.raises(ValueError, match="no file"):  # relative to the preset, not the cwd
        parse_reward("mine.py:brevity", str(tmp_path / "elsewhere.toml"))
    (folder / "broken.py").write_text("def f(:\n")
    with pytest.raises(ValueError, match=r"broken.py:1 is not valid Python"):
        parse_reward("broken.py:f", str(toml))
    (folder / "nested.py").write_text("class A:\n    def f(self): ...\n")
    with pytest.raises(ValueError, match="defines no function 'f' at its top level"):
        parse_reward("nested.py:f", str(toml))
