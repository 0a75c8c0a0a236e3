"""What would fail after a run starts is refused before it: ``lora.target_modules`` naming no
module of the model (planned as "fits, 0 trainable", then peft failed in rank 0) and
``train.bench_tasks`` naming unknown tasks or task files that would not load (the whole run
trained, then the benchmark failed in the keeper's log). Both: exit 2 with the field named, in
`plan` and `run`, nothing started.

Hostile values: a misspelt name, one typo among good names, a single name as a string, an
empty list, an empty name, "all-linear" inside a list, routed experts on a dense model; an
unknown task name, a task file that is missing, damaged, or runs code without
``train.bench_trust_code``. Accepted as peft accepts them: a name, a dotted tail, a full path,
the output layer, the experts of a MoE model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from homelab_dp.app.plan import check_bench_tasks
from homelab_dp.errors import HomelabError, PresetError
from homelab_dp.planning.lora_target_check import check_lora_targets, known_targets
from homelab_dp.planning.model_spec import hand_written_spec
from homelab_dp.presets.preset_store import open_preset
from homelab_dp.train.model.lora import lora_targets
from tests.conftest import DATA, ROOT, run_cli
from tests.integration.conftest import DEMO_MODEL

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker

CONFIGS = ROOT / "assets" / "configs"
DENSE = hand_written_spec(CONFIGS / "qwen2-0.5b")
MOE = hand_written_spec(CONFIGS / "qwen3-30b-a3b")


def _nothing_started() -> bool:
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    return not runs.exists() or not any(runs.iterdir())


def _sets(value: str) -> list[str]:
    return ["--set", "train.method=lora", "--set", f"lora.target_modules={value}"]


BAD_TARGETS = {
    "misspelt": ('["q_prj"]', "'q_prj' names no module of the model (llama)"),
    "one-typo": ('["q_proj", "v_prj"]', "'v_prj' names no module"),
    "string": ('"q_prj"', "'q_prj' names no module"),
    "empty-list": ("[]", "an empty list adapts nothing"),
    "empty-name": ('["q_proj", ""]', "'' is not a module name"),
    "all-linear-in-list": ('["all-linear"]', '"all-linear" is a value of its own'),
    "experts-on-dense": ('["experts"]', "'experts' names routed experts, but llama has none"),
}


@pytest.mark.parametrize(("value", "error"), BAD_TARGETS.values(), ids=BAD_TARGETS.keys())
@pytest.mark.parametrize("command", ["plan", "run"])
def test_targets_naming_no_module_exit_2_before_anything_starts(
    capsys: pytest.CaptureFixture[str], command: str, value: str, error: str
) -> None:
    extra = ["--gpus", "cpu:1"] + (["--detach"] if command == "run" else [])
    rc, out, err = run_cli(capsys, command, "tiny-demo", *_sets(value), *extra)
    assert rc == 2 and "Traceback" not in err, err
    first, second = err.strip().splitlines()[:2]
    assert first.startswith("error: ") and "lora.target_modules: " in first and error in first
    assert second.startswith("hint: ") and "q_proj" in second and "all-linear" in second
    assert _nothing_started()


@pytest.mark.parametrize(
    "value",
    ['"all-linear"', '"q_proj"', '["q_proj", "v_proj"]', '["self_attn.o_proj"]',
     '["model.layers.0.mlp.down_proj"]', '["lm_head", "q_proj"]'],
)  # fmt: skip
def test_targets_peft_accepts_plan(capsys: pytest.CaptureFixture[str], value: str) -> None:
    rc, out, err = run_cli(capsys, "plan", "tiny-demo", *_sets(value), "--gpus", "cpu:1",
                           "--json")  # fmt: skip
    assert rc == 0, err


def test_the_check_knows_each_models_own_names() -> None:
    assert known_targets(DENSE) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"]  # fmt: skip
    assert "experts" in known_targets(MOE)
    for ok in (["experts"], ["experts.down_proj", "q_proj"], ["all-linear", "experts"]):
        check_lora_targets(MOE, ok)
    with pytest.raises(PresetError, match="'experts.up' names no module"):
        check_lora_targets(MOE, ["experts.up"])
    with pytest.raises(PresetError, match="'c_attn' names no module"):
        check_lora_targets(DENSE, ["c_attn"])  # GPT-2's name on a Qwen2 model


def test_a_single_name_reaches_peft_as_the_plan_reads_it() -> None:
    """A string other than "all-linear" is one module name for the worker too (peft would read
    it as a regular expression over full paths, which "q_proj" never matches)."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    assert lora_targets(model, "q_proj") == (["q_proj"], [])
    assert lora_targets(model, "all-linear") == ("all-linear", [])


@pytest.fixture
def task_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "evil.py").write_text("def fn(docs):\n    return docs\n", encoding="utf-8")
    text = (DATA / "bench" / "tiny_arith.yaml").read_text(encoding="utf-8")
    (folder / "code.yaml").write_text(text + "process_docs: !function evil.fn\n",
                                      encoding="utf-8")  # fmt: skip
    (folder / "bad.yaml").write_text("task: t\nbogus_key: 1\n", encoding="utf-8")
    (folder / "group.yaml").write_text("group: g\ntask:\n  - arc_easy\n  - task: arc_easyy\n",
                                       encoding="utf-8")  # fmt: skip
    return folder


@pytest.mark.parametrize(
    ("tasks", "error"),
    [
        ('["hellaswg"]', "train.bench_tasks: unknown task 'hellaswg'"),
        ('["{folder}/missing.yaml"]', "train.bench_tasks: task file {folder}/missing.yaml not found"),
        ('["{folder}/bad.yaml"]', "train.bench_tasks: {folder}/bad.yaml: unknown key 'bogus_key'"),
        ('["{folder}/code.yaml"]', "train.bench_tasks: {folder}/code.yaml: runs code"),
        ('[""]', "train.bench_tasks: no task given"),
        ('["{folder}/group.yaml"]', "train.bench_tasks: unknown task 'arc_easyy'"),
        ('["arc_easy,hellaswag"]', "train.bench_tasks: 'arc_easy,hellaswag' holds a comma"),
    ],
    ids=["unknown-name", "missing-file", "damaged-file", "code", "empty", "group-member",
         "comma"],
)  # fmt: skip
@pytest.mark.parametrize("command", ["plan", "run"])
def test_bench_tasks_that_would_fail_after_training_exit_2_before_the_run(
    capsys: pytest.CaptureFixture[str], task_folder: Path, tasks: str, error: str, command: str
) -> None:
    value = tasks.format(folder=task_folder)
    extra = ["--detach"] if command == "run" else []
    rc, out, err = run_cli(capsys, command, "tiny-demo", "--set", f"train.bench_tasks={value}",
                           "--gpus", "cpu:1", *extra)  # fmt: skip
    assert rc == 2 and "Traceback" not in err, err
    first, second = err.strip().splitlines()[:2]
    assert first.startswith("error: ") and error.format(folder=task_folder) in first, first
    assert second.startswith("hint: ")
    assert _nothing_started()


def test_code_in_bench_tasks_passes_with_the_presets_switch(task_folder: Path) -> None:
    sets = [f'train.bench_tasks=["{task_folder}/code.yaml"]']
    with pytest.raises(HomelabError, match="runs code"):
        check_bench_tasks(open_preset("tiny-demo", sets))
    check_bench_tasks(open_preset("tiny-demo", [*sets, "train.bench_trust_code=true"]))


def test_a_relative_task_file_is_read_from_the_presets_folder(tmp_path: Path) -> None:
    preset_dir = tmp_path / "presets"
    preset_dir.mkdir()
    (preset_dir / "t.yaml").write_text("task: t\n", encoding="utf-8")
    text = (ROOT / "presets" / "tiny-demo.toml").read_text(encoding="utf-8")
    (preset_dir / "p.toml").write_text(text, encoding="utf-8")
    preset = open_preset(str(preset_dir / "p.toml"),
                         ['train.bench_tasks=["t.yaml", "hellaswag"]'])  # fmt: skip
    assert preset.train.bench_tasks == [str(preset_dir / "t.yaml"), "hellaswag"]
