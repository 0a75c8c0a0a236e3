"""GRPO's reward list (``grpo.rewards``): what each entry means, checked before anything runs.

An entry is a built-in or a user function:

- ``exact_answer``: 1 when the completion's answer (its last ``\\boxed{...}``, else its last
  number) equals the record's ``answer`` column, else 0;
- ``regex:PATTERN``: 1 when the regular expression PATTERN is found in the completion, else 0
  (anchor it with ``^...$`` to ask for the whole completion);
- ``length:MIN,MAX``: 1 for a completion of MIN to MAX characters, and 1 − d / MAX (not below
  0) for one d characters outside that range;
- ``FILE.py:FUNCTION``: ``FUNCTION(prompts, completions, **columns) -> list[float]`` defined at
  the top level of FILE. FILE is looked up relative to the preset file (the current folder for
  a preset without one), never in a model repository; the function is found by reading the
  file (``ast``), not by running it: the worker imports it, in a process of its own.

Each reward is reported as ``reward_<name>`` in the step events: the built-in's name
(``exact_answer``, ``regex``, ``length``) or the function's; a name used twice gets ``_2``,
``_3``... Pure: stdlib only.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from homelab_dp.errors import PresetError

BUILTINS = ("exact_answer", "regex:PATTERN", "length:MIN,MAX")
"""The built-in rewards as written in a preset."""


@dataclass(frozen=True)
class RewardSpec:
    """One entry of ``grpo.rewards``, parsed."""

    text: str
    """The entry as written."""
    kind: str
    """exact_answer | regex | length | user."""
    name: str
    """The event's ``reward_<name>`` suffix (unique within the list)."""
    pattern: str = ""
    """regex: the pattern."""
    low: int = 0
    """length: MIN."""
    high: int = 0
    """length: MAX."""
    file: str = ""
    """user: the file's absolute path."""
    function: str = ""
    """user: the function's name."""


def _base(source: str) -> Path:
    """The folder user reward files are looked up from: the preset file's, else the current."""
    return Path(source).absolute().parent if source else Path.cwd()


def parse_reward(text: str, source: str = "") -> RewardSpec:
    """The `RewardSpec` of one entry; ``source`` is the preset file. Raises ValueError with
    the problem (without the key) for an entry that is not usable."""
    if text == "exact_answer":
        return RewardSpec(text, "exact_answer", "exact_answer")
    if text.startswith("regex:"):
        pattern = text[len("regex:") :]
        if not pattern:
            raise ValueError("regex: needs a pattern, e.g. 'regex:^<answer>.*</answer>$'")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{text!r} is not a valid regular expression: {exc}") from None
        return RewardSpec(text, "regex", "regex", pattern=pattern)
    if text.startswith("length:"):
        parts = text[len("length:") :].split(",")
        try:
            low, high = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"{text!r}: expected length:MIN,MAX in characters, "
                             "e.g. 'length:20,200'") from None  # fmt: skip
        if not 0 <= low <= high or high < 1:
            raise ValueError(f"{text!r}: needs 0 <= MIN <= MAX and MAX >= 1")
        return RewardSpec(text, "length", "length", low=low, high=high)
    if ":" in text and text.rsplit(":", 1)[0].endswith(".py"):
        return _user_reward(text, source)
    raise ValueError(f"{text!r} is not a reward (built-ins: {', '.join(BUILTINS)}; "
                     "or FILE.py:FUNCTION)")  # fmt: skip


def _user_reward(text: str, source: str) -> RewardSpec:
    """``FILE.py:FUNCTION``: the file beside the preset, defining FUNCTION at its top level."""
    file, function = text.rsplit(":", 1)
    if not function.isidentifier():
        raise ValueError(f"{text!r}: {function!r} is not a Python function name")
    path = Path(file).expanduser()
    path = path if path.is_absolute() else _base(source) / path
    if not path.is_file():
        raise ValueError(f"{text!r}: no file {path} (looked up relative to the preset file)")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
        line = getattr(exc, "lineno", None)
        where = f"{path}:{line}" if line else str(path)
        raise ValueError(f"{text!r}: {where} is not valid Python ({exc})") from None
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    if function not in names:
        defined = ", ".join(sorted(names)) or "none"
        raise ValueError(f"{text!r}: {path} defines no function {function!r} at its top level "
                         f"(functions: {defined})")  # fmt: skip
    return RewardSpec(text, "user", function, file=str(path.resolve()), function=function)


def reward_specs(texts: list[str], source: str = "") -> list[RewardSpec]:
    """Every entry parsed, with unique names; raises PresetError (exit 2) naming the first bad
    entry's index."""
    problems = reward_problems(texts, source)
    if problems:
        raise PresetError(problems[0], hint="see `homelab-dp presets show` for grpo.rewards",
                          problems=problems)  # fmt: skip
    specs = [parse_reward(t, source) for t in texts]
    seen: dict[str, int] = {}
    out = []
    for spec in specs:
        seen[spec.name] = seen.get(spec.name, 0) + 1
        n = seen[spec.name]
        out.append(spec if n == 1 else RewardSpec(**{**spec.__dict__, "name": f"{spec.name}_{n}"}))
    return out


def reward_problems(texts: list[str], source: str = "") -> list[str]:
    """One line per unusable entry, naming ``grpo.rewards[i]``."""
    out = []
    for i, text in enumerate(texts):
        try:
            parse_reward(text, source)
        except ValueError as exc:
            out.append(f"grpo.rewards[{i}]: {exc}")
    return out
