"""lm_eval task files are data: code in them runs only with the user's explicit switch, and a
damaged or hostile file is refused before anything starts.

Hostile values tried: ``!function`` (at the top, nested in a metric and a fewshot config, in an
included file), ``class``, ``unsafe_code``, a metric that is not lm_eval's (a path, a name for
``evaluate.load``, ``hf_evaluate``), Jinja templates that reach for Python (``__class__``,
``['__globals__']``, ``_private``), YAML's own Python tags, an alias bomb, an alias that holds
itself, nesting 200 deep, a 5,000-digit integer, an unknown key, wrong types, out-of-range
counts, a list instead of a mapping, non-UTF-8 bytes, a key that is no name, a file over the
size bound, a FIFO, ``/dev/zero``, a folder; includes of a file outside the folder (``../``,
absolute, a symlink out), an include cycle, a chain of 40 files. Each: exit 2, the file and the
problem named, nothing imported or started, the outside file's content never shown. The worker
loads with the same rule (a file swapped after the check is refused there, its code not run), and
renders untrusted templates in Jinja's sandbox. With the switch, ``!function`` is imported."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from homelab_dp.app import task_files
from homelab_dp.app.bench import check_tasks, evaluate_job, task_config
from homelab_dp.app.task_files import MAX_FILE_BYTES, MAX_FILES, load_task_file, read_task_file
from homelab_dp.errors import HomelabError
from tests.conftest import DATA, run_cli
from tests.integration.conftest import DEMO_MODEL

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker

ARITH = DATA / "bench" / "tiny_arith.jsonl"
BASE = f"""task: t
dataset_path: json
dataset_kwargs:
  data_files:
    test: {ARITH}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
doc_to_choice: "{{{{choices}}}}"
"""
EVIL = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('x')\n" \
       "def fn(docs):\n    return docs\n"  # fmt: skip


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "evil.py").write_text(EVIL, encoding="utf-8")
    return tasks


def _refused(file: Path, *, trust: bool = False) -> str:
    with pytest.raises(HomelabError) as caught:
        check_tasks(str(file), trust_code=trust, field_name="train.bench_tasks")
    message = caught.value.message
    assert message.startswith(f"train.bench_tasks: {file}") or "train.bench_tasks: " in message
    assert caught.value.hint and caught.value.exit_code == 2
    assert not (file.parent / "RAN").exists()  # nothing of the file's code ran
    return message


CODE = {
    "function": "process_docs: !function evil.fn\n",
    "metric-function": "metric_list:\n  - metric: !function evil.fn\n",
    "fewshot-function": "fewshot_config:\n  sampler: first_n\n  process_docs: !function evil.fn\n",
    "class": "class: !function evil.fn\n",
    "unsafe": "unsafe_code: true\n",
    "metric-path": "metric_list:\n  - metric: /tmp/evil_metric\n",
    "metric-name": "metric_list:\n  - metric: my_evaluate_script\n",
    "hf-evaluate": "metric_list:\n  - metric: acc\n    hf_evaluate: true\n",
    "template-class": 'doc_to_target: "{{ answer.__class__.__mro__[1] }}"\n',
    "template-item": "doc_to_target: \"{{ cycler['__init__']['__globals__'] }}\"\n",
    "template-private": 'gen_prefix: "{% for x in doc._secret %}{% endfor %}"\n',
}


@pytest.mark.parametrize("extra", CODE.values(), ids=CODE.keys())
def test_code_in_a_task_file_is_refused_without_the_switch(folder: Path, extra: str) -> None:
    file = folder / "t.yaml"
    file.write_text(BASE + extra, encoding="utf-8")
    message = _refused(file)
    assert "runs code" in message and "refused without --trust-task-code" in message


def test_a_function_in_an_included_file_is_refused_too(folder: Path) -> None:
    (folder / "_base.yaml").write_text("process_docs: !function evil.fn\n", encoding="utf-8")
    file = folder / "t.yaml"
    file.write_text("include: _base.yaml\n" + BASE, encoding="utf-8")
    message = _refused(file)
    assert "!function evil.fn" in message and "_base.yaml line 1" in message


def test_with_the_switch_the_function_is_imported_by_the_worker_only(folder: Path) -> None:
    file = folder / "t.yaml"
    file.write_text(BASE + CODE["function"], encoding="utf-8")
    (spec,) = check_tasks(str(file), trust_code=True)  # the front end: checked, not imported
    assert spec.name == "t" and not (folder / "RAN").exists()
    cfg = task_config(file, trust_code=True)  # the worker: imported as lm_eval does
    assert (folder / "RAN").exists() and cfg["process_docs"]([1, 2]) == [1, 2]


def test_the_worker_refuses_a_file_swapped_after_the_check(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lm_eval.utils

    monkeypatch.setattr(lm_eval.utils, "env", lm_eval.utils.env)  # the worker sandboxes it
    file = folder / "t.yaml"
    file.write_text(BASE, encoding="utf-8")
    check_tasks(str(file))  # passed: no code
    file.write_text(BASE + CODE["function"], encoding="utf-8")  # swapped before the worker
    job = {"tasks": [{"name": "t", "file": str(file)}], "trust_code": False,
           "pretrained": str(DEMO_MODEL), "tokenizer": str(DEMO_MODEL), "dtype": "fp32",
           "peft": None, "device": "cpu", "batch_size": 1, "limit": 1}  # fmt: skip
    with pytest.raises(HomelabError, match="runs code"):
        evaluate_job(job)
    assert not (folder / "RAN").exists()


def test_untrusted_templates_render_in_the_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    import lm_eval.utils
    from jinja2.exceptions import SecurityError

    hostile = "{{ answer.__class__ }}"  # the first step to __globals__ and os
    assert lm_eval.utils.apply_template(hostile, {"answer": 1}) == "<class 'int'>"  # lm_eval's
    monkeypatch.setattr(lm_eval.utils, "env", lm_eval.utils.env)  # restored after the test
    task_files.sandbox_templates()
    with pytest.raises(SecurityError):
        lm_eval.utils.apply_template(hostile, {"answer": 1})
    ok = "{{ q | regex_replace('a', 'b') }} {{ choices[0].upper() }}"
    assert lm_eval.utils.apply_template(ok, {"q": "aa", "choices": ["x"]}) == "bb X"


BOMB = "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdef", "bcdefg", strict=True)
)
DAMAGED = {
    "python-tag": ("!!python/object/apply:os.system ['touch RAN']\n", "not a readable task file"),
    "bomb": ("a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + BOMB + "task: t\n"
             "metadata: {x: *g}\n", "expands to more than 100,000 values"),
    "self-alias": ("task: t\nmetadata: &a {x: [1, *a]}\n", "an alias refers to a value that holds"),
    "deep": ("task: t\nmetadata: {x: " + "[" * 200 + "]" * 200 + "}\n", "nested deeper than 64"),
    "huge-int": (BASE + "num_fewshot: 1" + "0" * 5000 + "\n", "a value YAML cannot read"),
    "unknown-key": (BASE + "bogus_key: 3\n", "unknown key 'bogus_key'"),
    "wrong-type": (BASE + "num_fewshot: five\n", "num_fewshot: expected int | None, got str"),
    "bad-output": (BASE.replace("multiple_choice", "fancy"), "output_type: expected"),
    "range": (BASE + "repeats: 100000000\n", "repeats: must be between 1 and 1000"),
    "list": ("- a\n- b\n", "a YAML list, not a mapping"),
    "no-task": ("dataset_path: json\n", "names no task"),
    "not-utf8": (b"task: \xff\xfe\n", "not UTF-8 text"),
    "key-not-name": (BASE + "1: one\n", "a key that is not a name"),
    "empty": ("", "empty"),
    "include-type": ("include: [1]\n" + BASE, "include: expected a file name"),
    "nested-include": ("group: g\ntask:\n  - task: x\n    include: /etc/passwd\n",
                       "task[0]: include: only at the top of a task file"),
    "metric-no-name": (BASE + "metric_list:\n  - aggregation: mean\n", "metric_list[0]: expected a mapping"),
}  # fmt: skip


@pytest.mark.parametrize(("content", "error"), DAMAGED.values(), ids=DAMAGED.keys())
def test_damaged_task_files_are_refused_with_the_problem_named(
    folder: Path, content: str | bytes, error: str
) -> None:
    file = folder / "t.yaml"
    if isinstance(content, bytes):
        file.write_bytes(content)
    else:
        file.write_text(content, encoding="utf-8")
    for trust in (False, True):  # the switch lets code run, never a damaged file
        message = _refused(file, trust=trust)
        assert error in message, message


def test_files_that_are_not_regular_or_too_large_are_never_read(folder: Path) -> None:
    big = folder / "big.yaml"
    big.write_text("task: t\n" + "#" * MAX_FILE_BYTES, encoding="utf-8")
    assert "bytes; a task file is read up to" in _refused(big)
    fifo = folder / "fifo.yaml"
    os.mkfifo(fifo)  # opening it would block forever
    assert "not a regular file" in _refused(fifo)
    zero = folder / "zero.yaml"
    zero.symlink_to("/dev/zero")  # reading it would never end
    assert "not a regular file" in _refused(zero)
    sub = folder / "sub.yaml"
    sub.mkdir()
    assert "not a regular file" in _refused(sub)


def test_an_include_outside_the_folder_is_refused_without_its_content(
    folder: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("task: SECRET-LINE-1234\n", encoding="utf-8")
    (folder / "link.yaml").symlink_to(secret)
    for inc in ("../secret.txt", str(secret), "link.yaml", "/etc/passwd"):
        file = folder / "t.yaml"
        file.write_text(f"include: {inc}\n" + BASE, encoding="utf-8")
        message = _refused(file)
        assert "lies outside the task file's folder" in message, message
        assert "SECRET-LINE" not in message and "root:" not in message


def test_include_cycles_and_long_chains_are_refused(folder: Path) -> None:
    (folder / "a.yaml").write_text("include: b.yaml\ntask: t\n", encoding="utf-8")
    (folder / "b.yaml").write_text("include: a.yaml\n", encoding="utf-8")
    assert "includes itself (a cycle)" in _refused(folder / "a.yaml")
    for i in range(40):
        (folder / f"c{i}.yaml").write_text(f"include: c{i + 1}.yaml\n", encoding="utf-8")
    (folder / "c40.yaml").write_text(BASE, encoding="utf-8")
    assert f"reads more than {MAX_FILES} files" in _refused(folder / "c0.yaml")


def test_includes_inside_the_folder_merge_as_lm_eval_merges_them(folder: Path) -> None:
    (folder / "common").mkdir()
    (folder / "common" / "_t.yaml").write_text(BASE + "task_list: [x]\nnum_fewshot: 3\n",
                                               encoding="utf-8")  # fmt: skip
    file = folder / "t.yaml"
    file.write_text("include: common/_t.yaml\ntask: mine\nnum_fewshot: 0\n", encoding="utf-8")
    cfg = load_task_file(file, trust_code=False, resolve=False)
    assert cfg["task"] == "mine" and cfg["num_fewshot"] == 0 and "task_list" not in cfg
    assert cfg["output_type"] == "multiple_choice"


def test_the_cli_refuses_code_before_anything_starts(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    jobs = tmp_path / "tmp"
    jobs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(jobs))
    file = folder / "t.yaml"
    file.write_text(BASE + CODE["function"], encoding="utf-8")
    rc, out, err = run_cli(capsys, "bench", str(DEMO_MODEL), "--tasks", str(file),
                           "--gpus", "cpu:1")  # fmt: skip
    assert rc == 2 and out == "" and "Traceback" not in err
    first, second = err.strip().splitlines()[:2]
    assert first.startswith(f"error: --tasks: {file}: runs code (!function evil.fn")
    assert second.startswith("hint: ") and "--trust-task-code" in second
    assert list(jobs.iterdir()) == [] and not (folder / "RAN").exists()


def test_group_files_and_lenient_types_pass(folder: Path) -> None:
    group = folder / "g.yaml"
    group.write_text("group: g\ntask:\n  - hellaswag\n  - task: x\n    num_fewshot: 2\n"
                     "aggregate_metric_list:\n  metric: acc\n", encoding="utf-8")  # fmt: skip
    spec = read_task_file(str(group))
    assert (spec.name, spec.members) == ("g", ("hellaswag", "x"))  # checked against the index
    file = folder / "t.yaml"
    file.write_text(BASE.replace("doc_to_target: answer", "doc_to_target: 0")
                    + "gen_prefix: \"{{ _id }} {{ doc['_id'] }}\"\n", encoding="utf-8")  # fmt: skip
    assert load_task_file(file, trust_code=False, resolve=False)["doc_to_target"] == 0


def test_lm_evals_own_task_files_pass_the_damage_checks() -> None:
    """A sample of lm_eval's ~14,000 task files (with the switch: many carry functions): the
    only refusals are lm_eval's own includes of a parent folder's template and the templates
    themselves (no task). Every one of them was checked once this way: 401 of 13,986 refused,
    all for those two reasons."""
    import glob

    import lm_eval

    root = Path(lm_eval.__file__).parent / "tasks"
    files = sorted(glob.glob(str(root / "**" / "*.yaml"), recursive=True))[::40]
    assert len(files) > 200
    for f in files:
        try:
            load_task_file(f, trust_code=True, resolve=False)
        except HomelabError as exc:
            assert "lies outside the task file's folder" in exc.message or (
                "names no task" in exc.message
            ), exc.message
