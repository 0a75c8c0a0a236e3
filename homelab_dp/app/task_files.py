"""An lm_eval task file read as data: the one rule `bench`'s front end checks with and its
workers load with (`load_task_file`), so a file the check passed is the file that runs.

A task file is the user's (``bench --tasks FILE.yaml``, or a preset's ``train.bench_tasks``,
run by the run's keeper after training), and presets are data: nothing in a task file runs
Python unless the user said so (``bench --trust-task-code``, ``train.bench_trust_code``).
Without that switch a file is refused before anything starts when it carries code:

- a ``!function`` tag (lm_eval imports the named file next to the task and runs it), a
  ``class`` or a ``custom_dataset`` (those are functions too);
- a metric that is not one of lm_eval's own (lm_eval hands an unknown name, or one marked
  ``hf_evaluate``, to ``evaluate.load``, which runs a metric script found by that name);
- ``unsafe_code: true`` (the task runs the model's answers as code);
- a Jinja template that reaches for a ``_``-attribute or key (``{{ x.__class__ ... }}``, how
  a template escapes to Python); the workers also render every template in Jinja's sandbox.

Whatever the switch, a file is refused (error naming the file, the line where known, and the
key; exit 2) when it is not a regular file of at most `MAX_FILE_BYTES`, is not YAML, holds a tag
other than ``!function``, expands to more than `MAX_NODES` values or nests deeper than
`MAX_DEPTH` (an alias bomb: a few lines of ``&a``/``*a`` that expand to billions of values), or
refers to itself through an alias; when it names a key lm_eval's ``TaskConfig`` (or, for a
group, ``GroupConfig``) does not have, or gives a key a value of the wrong type; and when an
``include:`` names a file outside the task file's folder (its content is never shown), a file
included twice in one chain, or more than `MAX_FILES` files in all. Includes are merged as lm_eval
merges them: the included keys first (less its ``task_list``), the file's own keys winning.

`check_tasks` is the whole check of ``--tasks`` and of a preset's ``train.bench_tasks`` (which
`run` checks before a run starts): each item a task file read by this rule, or a name lm_eval's
task index knows.
"""

from __future__ import annotations

import difflib
import functools
import os
import stat
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from homelab_dp.errors import HomelabError

MAX_FILE_BYTES = 1 << 20
"""The largest task file (or included file) read: lm_eval's own are a few KB."""
MAX_NODES = 100_000
"""The most values (scalars, lists, mappings) a task file may expand to, its aliases followed."""
MAX_DEPTH = 64
"""The deepest nesting of lists and mappings in a task file."""
MAX_FILES = 32
"""The most files one task file may read through its ``include:`` chains."""
TASK_SUFFIXES = (".yaml", ".yml")
FUNCTION_TAG = "!function"
TRUST_HINT = (
    "a task file that runs code needs your explicit consent: `homelab-dp bench --trust-task-code` "
    "(a preset: train.bench_trust_code = true), only for files you have read"
)
TASK_HINT = (
    "an lm_eval task file is a YAML mapping with task:, dataset_path:, output_type:, "
    "doc_to_text: ... (see lm_eval's docs/task_guide.md)"
)
OUTPUT_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice", "generate_until")
STRUCTURAL = ("include", "tag", "group", "task_list", "class")
"""Keys lm_eval reads from a task file that are not ``TaskConfig`` fields."""
_RANGES = {"num_fewshot": (0, 10_000), "repeats": (1, 1_000)}


@dataclass(frozen=True)
class FunctionRef:
    """A ``!function MODULE.NAME`` tag, not imported: where it was written and what it names."""

    qualname: str
    folder: Path
    """The folder of the file it was written in (lm_eval looks for MODULE.py there)."""
    where: str
    """``FILE line N``."""


def load_task_file(
    path: str | Path, *, trust_code: bool, resolve: bool, field_name: str = "--tasks"
) -> dict[str, Any]:
    """``path`` read and checked (see the module docstring); HomelabError naming
    ``field_name``, the file and the problem. ``resolve`` (the workers): every ``!function``
    imported as lm_eval does (only with ``trust_code``; without it a tag is refused before)."""
    file = Path(path).expanduser().absolute()
    root = Path(os.path.realpath(file)).parent
    cfg = _load(file, root, field_name, chain=(), count=[0])
    check_config(cfg, file, field_name)
    if not trust_code:
        uses = code_uses(cfg)
        if uses:
            raise HomelabError(
                f"{field_name}: {file}: runs code ({uses[0]}"
                + (f"; and {len(uses) - 1} more" if len(uses) > 1 else "")
                + "), refused without --trust-task-code",
                hint=TRUST_HINT,
            )
    return _resolve(cfg) if resolve else cfg


def _fail(field_name: str, file: Path, problem: str, hint: str = TASK_HINT) -> HomelabError:
    return HomelabError(f"{field_name}: {file}: {problem}", hint=hint)


def read_bounded(file: Path, field_name: str) -> bytes:
    """A regular file's bytes, at most `MAX_FILE_BYTES`. Opened without blocking and checked on
    the open file (a FIFO, a device, a folder: refused, never read; a file swapped meanwhile is
    the one checked)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _fail(field_name, file, "not found",
                    "give the path of an lm_eval task .yaml file, or a task name") from None  # fmt: skip
    except IsADirectoryError:
        raise _fail(
            field_name, file, "not a regular file", "a task file is a YAML text file"
        ) from None
    except OSError as exc:
        raise _fail(field_name, file, f"not readable ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _fail(field_name, file, "not a regular file", "a task file is a YAML text file")
        if info.st_size > MAX_FILE_BYTES:
            raise _fail(field_name, file, f"{info.st_size:,} bytes; a task file is read up to "
                        f"{MAX_FILE_BYTES:,}")  # fmt: skip
        chunks, size = [], 0
        while size <= MAX_FILE_BYTES and (chunk := os.read(fd, 1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise _fail(field_name, file, f"not readable ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:  # grew since the stat
        raise _fail(field_name, file, f"more than {MAX_FILE_BYTES:,} bytes")
    return data


def _loader_class(file: Path) -> type:
    """yaml's safe loader (libyaml's where built) for ``file``, plus lm_eval's ``!function``
    as a `FunctionRef` (never imported here)."""
    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class TaskLoader(base):  # type: ignore[misc, valid-type]
        pass

    def function(loader: Any, node: yaml.Node) -> FunctionRef:
        value = loader.construct_scalar(node)
        return FunctionRef(str(value), file.parent, f"{file} line {node.start_mark.line + 1}")

    TaskLoader.add_constructor(FUNCTION_TAG, function)
    return TaskLoader


def parse_yaml(data: bytes, file: Path, field_name: str) -> Any:
    """The YAML document in ``data``, its size checked before it is built (`node_size`)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(field_name, file, f"not UTF-8 text (byte {exc.start})") from None
    loader = _loader_class(file)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise _fail(field_name, file, "empty; a task file is a YAML mapping")
        node_size(node, file, field_name)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = (getattr(exc, "problem", None) or str(exc).splitlines()[0])[:200]
        raise _fail(field_name, file, f"not a readable task file:{where} {problem}") from None
    except RecursionError:
        raise _fail(field_name, file, f"nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, OverflowError) as exc:  # a 5,000-digit integer, a bad date or base64
        raise _fail(field_name, file, f"a value YAML cannot read ({str(exc)[:120]})") from None
    finally:
        loader.dispose()


def node_size(root: yaml.Node, file: Path, field_name: str) -> None:
    """Refuse a document that expands (aliases followed) to more than `MAX_NODES` values or
    nests deeper than `MAX_DEPTH`, or whose alias refers to a node holding it. Each node is
    visited once (a shared node's size is remembered), so a bomb costs its size on disk."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            on_path.discard(key)
            size[key] = min(MAX_NODES + 1, 1 + sum(size[id(c)] for c in children))
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
            if size[key] > MAX_NODES:
                raise _fail(field_name, file, f"expands to more than {MAX_NODES:,} values "
                            f"(line {node.start_mark.line + 1}: aliases repeating aliases?)",
                            "write the values out; a task file is a few KB of settings")  # fmt: skip
            if depth[key] > MAX_DEPTH:
                raise _fail(field_name, file, f"nested deeper than {MAX_DEPTH} levels "
                            f"(line {node.start_mark.line + 1})")  # fmt: skip
            continue
        if key in size:
            continue
        if key in on_path:
            raise _fail(field_name, file, f"line {node.start_mark.line + 1}: an alias refers "
                        "to a value that holds it (an endless value)")  # fmt: skip
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)
        if len(on_path) > MAX_DEPTH:
            raise _fail(field_name, file, f"nested deeper than {MAX_DEPTH} levels "
                        f"(line {node.start_mark.line + 1})")  # fmt: skip


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _load(
    file: Path, root: Path, field_name: str, chain: tuple[Path, ...], count: list[int]
) -> dict[str, Any]:
    """``file`` and its includes, merged (see the module docstring)."""
    count[0] += 1
    if count[0] > MAX_FILES:
        raise _fail(field_name, chain[0], f"reads more than {MAX_FILES} files through include:")
    cfg = parse_yaml(read_bounded(file, field_name), file, field_name)
    if not isinstance(cfg, dict):
        raise _fail(
            field_name,
            file,
            f"not a readable task file (a YAML {type(cfg).__name__}, not a mapping of keys)",
        )
    bad = [k for k in cfg if not isinstance(k, str)]
    if bad:
        raise _fail(field_name, file, f"a key that is not a name: {str(bad[0])[:60]!r}")
    if "include" not in cfg:
        return cfg
    includes = cfg.pop("include")
    items = includes if isinstance(includes, list) else [includes]
    merged: dict[str, Any] = {}
    for inc in items:
        if not isinstance(inc, str) or not inc:
            raise _fail(field_name, file, f"include: expected a file name, got {str(inc)[:60]!r}")
        target = Path(os.path.realpath(file.parent / inc))
        if not target.is_relative_to(root):
            raise _fail(field_name, file, f"include: {inc[:200]} lies outside the task "
                        f"file's folder {root}",
                        "copy the included file into the task file's folder")  # fmt: skip
        if target in chain or target == Path(os.path.realpath(file)):
            raise _fail(field_name, file, f"include: {inc[:200]} includes itself (a cycle)")
        sub = _load(target, root, field_name, (*chain, Path(os.path.realpath(file))), count)
        sub.pop("task_list", None)
        merged.update(sub)
    merged.update(cfg)  # the file's own keys win
    return merged


@functools.cache
def _allowed() -> tuple[dict[str, str], dict[str, str]]:
    """``TaskConfig`` and ``GroupConfig`` fields with their annotations, from lm_eval."""
    from lm_eval.config.group import GroupConfig
    from lm_eval.config.task import TaskConfig

    def name(tp: Any) -> str:  # a string under postponed annotations, else a type or union
        return tp if isinstance(tp, str) else getattr(tp, "__name__", None) or str(tp)

    task = {f.name: name(f.type) for f in fields(TaskConfig)}
    group = {f.name: name(f.type) for f in fields(GroupConfig)}
    return task, group


def _type_ok(value: Any, annotation: str) -> bool:
    """Whether ``value`` has one of the types an lm_eval annotation string names, read as
    leniently as lm_eval's own task files need: a function anywhere (whether it may run is
    the trust switch's question), a number where a string is named (``doc_to_target: 0``),
    a mapping where a list is normalised from one (``aggregate_metric_list``)."""
    kinds = {part.strip().split("[")[0].removeprefix("typing.") for part in _union(annotation)}
    if "Any" in kinds or isinstance(value, FunctionRef):
        return True
    checks = {
        "None": value is None,
        "str": isinstance(value, (str, int, float)),
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "dict": isinstance(value, dict),
        "list": isinstance(value, list),
        "Callable": isinstance(value, FunctionRef),
        "FewshotConfig": isinstance(value, dict),
        "OutputType": value in OUTPUT_TYPES,
        "AggMetricConfig": isinstance(value, dict),
    }
    return any(checks.get(k, False) for k in kinds)


def _union(annotation: str) -> list[str]:
    """The members of a ``A | B[C | D] | None`` annotation (split outside brackets)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(annotation):
        depth += (c == "[") - (c == "]")
        if c == "|" and depth == 0:
            parts.append(annotation[start:i])
            start = i + 1
    return [*parts, annotation[start:]]


def check_config(cfg: dict[str, Any], file: Path, field_name: str, where: str = "") -> None:
    """Every key one lm_eval knows for a task (or a group), with a value of its type."""
    task_fields, group_fields = _allowed()
    is_group = "group" in cfg and not isinstance(cfg.get("task"), str)
    known = {**task_fields, **(group_fields if is_group else {})}
    if is_group:
        known["aggregate_metric_list"] = "list | dict | None"  # one item, as a mapping
    for key, value in cfg.items():
        if "class" in cfg:  # a task class of its own takes its own keys (and is code)
            break
        if key == "include":  # the top's were merged: lm_eval reads no other
            raise _fail(field_name, file, f"{where}include: only at the top of a task file")
        if key in STRUCTURAL and key not in known:
            continue
        if key not in known:
            kind = "group" if is_group else "task"
            raise _fail(field_name, file, f"{where}unknown key {key[:60]!r} (not a field of an "
                        f"lm_eval {kind})", TASK_HINT)  # fmt: skip
        annotation = known[key]
        if is_group and key == "task":
            annotation = "str | list"
        if not _type_ok(value, annotation):
            raise _fail(field_name, file, f"{where}{key}: expected {annotation}, got "
                        f"{type(value).__name__}")  # fmt: skip
        low, high = _RANGES.get(key, (None, None))
        if low is not None and value is not None and not low <= value <= high:
            raise _fail(field_name, file, f"{where}{key}: must be between {low} and {high}")
    for i, metric in enumerate(cfg.get("metric_list") or [] if "class" not in cfg else []):
        if not isinstance(metric, dict) or "metric" not in metric:
            raise _fail(field_name, file, f"{where}metric_list[{i}]: expected a mapping with a "
                        "metric: key")  # fmt: skip
    if is_group and isinstance(cfg.get("task"), list):
        for i, member in enumerate(cfg["task"]):
            if isinstance(member, dict):
                check_config(member, file, field_name, f"{where}task[{i}]: ")
            elif not isinstance(member, str):
                raise _fail(field_name, file, f"{where}task[{i}]: expected a task name or a "
                            f"mapping, got {type(member).__name__}")  # fmt: skip
    if not is_group and not (isinstance(cfg.get("task"), str) and cfg["task"]) and not where:
        raise _fail(field_name, file, "names no task (no `task:` key)", "add `task: NAME`")


def code_uses(cfg: Any, path: str = "") -> list[str]:
    """What in ``cfg`` would run code (see the module docstring), each as words naming where."""
    out: list[str] = []
    if isinstance(cfg, FunctionRef):
        return [f"{FUNCTION_TAG} {cfg.qualname[:80]} at {path or 'top'}, {cfg.where}"]
    if isinstance(cfg, str):
        bad = unsafe_template(cfg)
        return [f"{path}: a template reaching for {bad!r}"] if bad else []
    if isinstance(cfg, list):
        for i, item in enumerate(cfg):
            out += code_uses(item, f"{path}[{i}]")
        return out
    if not isinstance(cfg, dict):
        return out
    for key in ("class", "custom_dataset"):
        if cfg.get(key) is not None and not isinstance(cfg[key], FunctionRef):
            out.append(f"{path}{key}: a Python object")
    if cfg.get("unsafe_code") is True:
        out.append(f"{path}unsafe_code: true (it runs the model's answers)")
    metrics = cfg.get("metric_list") if cfg.get("process_results") is None else None
    for i, metric in enumerate(metrics or []):  # a process_results of its own: names unused
        if not isinstance(metric, dict):
            continue
        name = metric.get("metric")
        at = f"{path}metric_list[{i}]"
        if metric.get("hf_evaluate"):
            out.append(f"{at}: hf_evaluate (evaluate.load runs a metric script)")
        elif isinstance(name, str) and name not in _metric_names():
            out.append(f"{at}: metric {name[:80]!r} is not one of lm_eval's (evaluate.load "
                       "would run a script of that name)")  # fmt: skip
    for key, value in cfg.items():
        out += code_uses(value, f"{path}{key}" if not isinstance(value, dict) else f"{path}{key}.")
    return out


@functools.cache
def _metric_names() -> frozenset[str]:
    import lm_eval.api.metrics  # noqa: F401  (registers lm_eval's metrics)
    from lm_eval.api.registry import metric_registry

    return frozenset(metric_registry.keys())


def unsafe_template(text: str) -> str | None:
    """The first ``_``-attribute (``x.__class__``, ``x._private``) or dunder key
    (``x['__globals__']``) a Jinja template in ``text`` reaches for (how a template gets at
    Python), or None. A document's own ``_``-field (``{{ _id }}``, ``doc['_id']``) is data.
    Text that is no template, or no valid one, is None (lm_eval uses it as it is, or fails)."""
    if "{{" not in text and "{%" not in text:
        return None
    from jinja2 import Environment, nodes
    from jinja2.exceptions import TemplateSyntaxError

    try:
        tree = Environment().parse(text)
    except TemplateSyntaxError:
        return None
    for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
        if isinstance(node, nodes.Getattr):
            if node.attr.startswith("_"):
                return node.attr
            continue
        key = node.arg.value if isinstance(node.arg, nodes.Const) else None
        if isinstance(key, str) and key.startswith("__"):
            return key
    return None


def _resolve(value: Any) -> Any:
    """``value`` with every `FunctionRef` imported as lm_eval imports it (the trusted path)."""
    if isinstance(value, FunctionRef):
        from lm_eval.tasks._yaml_loader import _import_func_in_yml

        return _import_func_in_yml(value.qualname, value.folder)
    if isinstance(value, dict):
        return {k: _resolve(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    return value


def sandbox_templates() -> None:
    """Render lm_eval's Jinja templates in Jinja's sandbox (no ``_``-attributes, no unsafe
    callables) in this process: the workers of a bench whose task files are not trusted."""
    import lm_eval.utils as lm_utils
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment

    env = SandboxedEnvironment(loader=BaseLoader(), undefined=StrictUndefined,
                               keep_trailing_newline=True)  # fmt: skip
    env.filters.update(lm_utils.env.filters)
    lm_utils.env = env


# --- `--tasks` and `train.bench_tasks`: task names and task files ------------------------


@dataclass(frozen=True)
class TaskSpec:
    """One item of ``--tasks``: a task name, or a task file."""

    name: str
    """The task's name (a file's ``task:``)."""
    file: Path | None = None
    """The task file (absolute), or None for a name from lm_eval's index."""
    members: tuple[str, ...] = ()
    """The names of lm_eval's index a group file refers to (its workers load the index)."""


def split_tasks(tasks: str | list[str], field_name: str = "--tasks") -> list[str]:
    """The items of ``--tasks`` (comma-separated) or of ``train.bench_tasks`` (a list)."""
    items = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    out = [str(t).strip() for t in items if str(t).strip()]
    if not out:
        raise HomelabError(
            f"{field_name}: no task given",
            hint="give task names (e.g. hellaswag,arc_easy) or a task file (my_task.yaml)",
        )
    return out


def is_task_file(item: str) -> bool:
    """Whether a ``--tasks`` item names a file rather than a task (a .yaml name or a path)."""
    return item.lower().endswith(TASK_SUFFIXES) or "/" in item or Path(item).is_file()


def read_task_file(item: str, *, trust_code: bool = False, field_name: str = "--tasks") -> TaskSpec:
    """A task file checked as the workers will load it (`task_files.load_task_file`: the same
    rule, the same switch): a bounded regular file, safe YAML, lm_eval's keys and types, no
    include outside its folder, and no code unless ``trust_code``."""
    path = Path(item).expanduser().absolute()
    if not path.exists():
        raise HomelabError(f"{field_name}: task file {item} not found",
                           hint="give the path of an lm_eval task .yaml file, or a task name")  # fmt: skip
    cfg = load_task_file(path, trust_code=trust_code, resolve=False, field_name=field_name)
    if "group" in cfg and not isinstance(cfg.get("task"), str):
        refs = [m if isinstance(m, str) else m.get("task") for m in cfg.get("task") or []]
        return TaskSpec(str(cfg["group"]), path, tuple(r for r in refs if isinstance(r, str)))
    return TaskSpec(cfg["task"], path)


@functools.cache
def known_tasks() -> tuple[str, ...]:
    """Every task, group and tag name of lm_eval's index (built once per process: it reads
    lm_eval's thousands of task files, seconds)."""
    from lm_eval.tasks import TaskManager

    return tuple(TaskManager().all_tasks)


def check_task_names(names: list[str], field_name: str = "--tasks") -> None:
    """Every name is a task, group or tag of lm_eval's index (an unknown one: exit 2)."""
    known = list(known_tasks())
    known_set = set(known)
    for name in names:
        if name not in known_set:
            near = difflib.get_close_matches(name, known, n=5, cutoff=0.6) or known[:5]
            raise HomelabError(
                f"{field_name}: unknown task {name[:100]!r} (lm_eval {lm_eval_version()} knows "
                f"{len(known)} tasks)",
                hint=f"e.g. {', '.join(near)}; or give a task .yaml file "
                "(`python -m lm_eval ls tasks` lists every name)",
            )


def check_tasks(
    tasks: str | list[str], *, trust_code: bool = False, field_name: str = "--tasks"
) -> tuple[TaskSpec, ...]:
    """``--tasks`` (or a preset's ``train.bench_tasks``: ``field_name``) read and checked: files
    as the workers load them (``trust_code``: ``--trust-task-code``), names looked up (the
    index only when a name is given: building it reads lm_eval's thousands of task files)."""
    items = split_tasks(tasks, field_name)
    if not isinstance(tasks, str):  # a preset's list: its keeper passes them comma-joined
        for item in items:
            if "," in item:
                raise HomelabError(f"{field_name}: {item[:100]!r} holds a comma",
                                   hint="one task name or task file per item of the list")  # fmt: skip
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise HomelabError(
            f"{field_name}: lm-evaluation-harness (lm_eval) is not installed",
            hint="pip install 'homelab-dp[bench]'",
        ) from None
    specs = [
        read_task_file(i, trust_code=trust_code, field_name=field_name)
        if is_task_file(i) else TaskSpec(i)
        for i in items
    ]  # fmt: skip
    names = [s.name for s in specs if s.file is None] + [m for s in specs for m in s.members]
    if names:
        check_task_names(names, field_name)
    return tuple(specs)


def lm_eval_version() -> str:
    """The installed lm_eval's version, "?" when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        return "?"
