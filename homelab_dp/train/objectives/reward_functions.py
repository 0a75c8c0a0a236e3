"""GRPO's rewards at run time: the built-ins, user functions in a process of their own, checks.

`Rewards` scores a batch of completions with every reward of ``grpo.rewards``
(`homelab_dp.presets.reward_specs.RewardSpec`) and returns one row per completion. The built-ins run
here; user functions (``FILE.py:FUNCTION``) run in one child process started for the run
(``spawn``: nothing of the trainer is inherited), which imports only the files the preset
names; each call must answer within ``grpo.reward_timeout_s``.

A reward that raises, times out, returns something that is not a list of the batch's length,
or a value that is not a finite number ends the run: `RewardError` (exit 1) names the function
and the prompt (for an exception, the batch is retried prompt by prompt to find the first one
that raises). The trainer checkpoints nothing after it, so the last checkpoint is kept.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import multiprocessing
import numbers
import re
import traceback
from typing import TYPE_CHECKING, Any

from homelab_dp.errors import RunFailedError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from homelab_dp.presets.reward_specs import RewardSpec

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardError(RunFailedError):
    """A reward function that failed on a batch: the run ends (exit 1), its checkpoints kept."""


def final_answer(text: str) -> str | None:
    """The completion's answer: its last ``\\boxed{...}``, else its last number (commas
    dropped), else None."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def same_answer(got: str | None, expected: Any) -> bool:
    """Whether ``got`` equals the ``answer`` column: as numbers when both read as numbers,
    else as stripped strings."""
    if got is None or expected is None:
        return False
    want = str(expected).strip().replace(",", "")
    try:
        return math.isclose(float(got), float(want), rel_tol=0.0, abs_tol=1e-9)
    except ValueError:
        return got.strip() == want


def exact_answer(prompts: Sequence[Any], completions: Sequence[str], **columns: Any) -> list[float]:
    """1.0 where the completion's `final_answer` equals the record's ``answer``, else 0.0."""
    answers = columns.get("answer")
    if answers is None:
        raise ValueError("exact_answer needs an 'answer' column in the data")
    return [float(same_answer(final_answer(c), a)) for c, a in zip(completions, answers,
                                                                     strict=True)]  # fmt: skip


def regex_reward(pattern: str) -> Callable[..., list[float]]:
    """1.0 where ``pattern`` is found in the completion (``re.search``, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(prompts: Sequence[Any], completions: Sequence[str], **_: Any) -> list[float]:
        return [float(compiled.search(c) is not None) for c in completions]

    return reward


def length_reward(low: int, high: int) -> Callable[..., list[float]]:
    """1.0 for a completion of ``low`` to ``high`` characters; 1 − d / high (not below 0) for
    one d characters outside."""

    def reward(prompts: Sequence[Any], completions: Sequence[str], **_: Any) -> list[float]:
        out = []
        for c in completions:
            d = max(low - len(c), len(c) - high, 0)
            out.append(max(0.0, 1.0 - d / high))
        return out

    return reward


def builtin(spec: RewardSpec) -> Callable[..., list[float]]:
    """The function of a built-in reward."""
    if spec.kind == "exact_answer":
        return exact_answer
    if spec.kind == "regex":
        return regex_reward(spec.pattern)
    if spec.kind == "length":
        return length_reward(spec.low, spec.high)
    raise ValueError(f"{spec.text!r} is not a built-in reward")


def load_user_function(file: str, function: str) -> Callable[..., Any]:
    """Import ``function`` from the file ``file`` (in the reward process only)."""
    module_spec = importlib.util.spec_from_file_location(f"homelab_dp_reward_{function}", file)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {file}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise AttributeError(f"{file} has no function {function!r}")
    return fn


def _serve(conn: Any, targets: list[tuple[str, str]]) -> None:
    """The reward process: import the user functions, then answer calls until told to stop."""
    functions: dict[str, Callable[..., Any]] = {}
    for file, name in targets:
        try:
            functions[f"{file}:{name}"] = load_user_function(file, name)
        except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which ends
            conn.send(("error", f"{file}:{name}", f"{type(exc).__name__}: {exc}"))
            return
    conn.send(("ready", "", ""))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the trainer is gone (it ended, or failed): end quietly
            return
        if message is None:
            return
        key, prompts, completions, columns = message
        try:
            conn.send(("ok", key, functions[key](prompts, completions, **columns)))
        except BaseException as exc:  # noqa: BLE001 - the caller names the function
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            conn.send(("error", key, last))


class UserRewards:
    """The process that runs the user reward functions (started once per run)."""

    def __init__(self, specs: Sequence[RewardSpec], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        targets = [(s.file, s.function) for s in specs if s.kind == "user"]
        self.process = None
        if not targets:
            return
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, targets), daemon=True)
        self.process.start()
        child.close()
        status, key, detail = self._receive("loading the reward functions")
        if status != "ready":
            self.close()
            raise RewardError(f"reward {key}: could not be loaded: {detail}",
                              hint="fix the reward file named in grpo.rewards")  # fmt: skip

    def _receive(self, what: str) -> tuple[str, str, Any]:
        if not self.conn.poll(self.timeout_s):
            self.close()
            raise RewardError(f"{what} took more than {self.timeout_s:g} s "
                              "(grpo.reward_timeout_s)",
                              hint="make the reward faster or raise grpo.reward_timeout_s")  # fmt: skip
        try:
            return self.conn.recv()
        except EOFError:
            self.close()
            raise RewardError(f"{what}: the reward process died",
                              hint="a reward function must not exit the process") from None  # fmt: skip

    def call(self, spec: RewardSpec, prompts: list[Any], completions: list[str],
             columns: dict[str, list[Any]], what: str) -> tuple[bool, Any]:  # fmt: skip
        """(True, the function's result) or (False, the exception's last line); ``what``
        names the call in a timeout's error."""
        key = f"{spec.file}:{spec.function}"
        self.conn.send((key, prompts, completions, columns))
        status, _, result = self._receive(what)
        return status == "ok", result

    def close(self) -> None:
        """Stop the reward process (it is a daemon: it also ends with the trainer)."""
        if self.process is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process = None


def _describe(prompt: Any, index: int) -> str:
    text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))
    short = text if len(text) <= 60 else text[:57] + "..."
    return f"prompt {index} ({short!r})"


class Rewards:
    """Every reward of ``grpo.rewards`` over a batch of completions (see the module docstring)."""

    def __init__(self, specs: Sequence[RewardSpec], timeout_s: float) -> None:
        self.specs = list(specs)
        self.names = [s.name for s in self.specs]
        self.users = UserRewards(self.specs, timeout_s)

    def score(self, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]],
              prompt_index: list[int]) -> list[list[float]]:  # fmt: skip
        """``[completion][reward]``: each reward of each completion. ``prompts``,
        ``completions``, each column and ``prompt_index`` (the data's index of each
        completion's prompt, for errors) have one entry per completion."""
        per_reward = [self._one(s, prompts, completions, columns, prompt_index) for s in self.specs]
        return [list(row) for row in zip(*per_reward, strict=True)] if per_reward else []

    def _run(self, spec: RewardSpec, prompts: list[Any], completions: list[str],
             columns: dict[str, list[Any]], where: list[int]) -> tuple[bool, Any]:  # fmt: skip
        if spec.kind == "user":
            what = (f"reward {spec.function} ({spec.file}) on prompts "
                    f"{min(where)}..{max(where)}")  # fmt: skip
            return self.users.call(spec, prompts, completions, columns, what)
        try:
            return True, builtin(spec)(prompts, completions, **columns)
        except Exception as exc:  # noqa: BLE001 - named with the prompt below
            return False, f"{type(exc).__name__}: {exc}"

    def _one(self, spec: RewardSpec, prompts: list[Any], completions: list[str],
             columns: dict[str, list[Any]], prompt_index: list[int]) -> list[float]:  # fmt: skip
        who = f"reward {spec.name}" + (f" ({spec.file})" if spec.kind == "user" else "")
        ok, result = self._run(spec, prompts, completions, columns, prompt_index)
        if not ok:  # find the first prompt it raises on
            for i in range(len(completions)):
                one = {k: v[i : i + 1] for k, v in columns.items()}
                ok_i, res_i = self._run(spec, prompts[i : i + 1], completions[i : i + 1], one,
                                        prompt_index[i : i + 1])  # fmt: skip
                if not ok_i:
                    raise RewardError(f"{who} raised on {_describe(prompts[i], prompt_index[i])}:"
                                      f" {res_i}", hint="fix the reward function; the run's last "
                                      "checkpoint is kept (`homelab-dp resume`)")  # fmt: skip
            raise RewardError(f"{who} raised on the batch of prompts {min(prompt_index)}.."
                              f"{max(prompt_index)}: {result}",
                              hint="fix the reward function")  # fmt: skip
        if not isinstance(result, (list, tuple)) or len(result) != len(completions):
            got = f"{len(result)} values" if isinstance(result, (list, tuple)) else (
                type(result).__name__)  # fmt: skip
            raise RewardError(f"{who} returned {got} for {len(completions)} completions "
                              f"(prompts {min(prompt_index)}..{max(prompt_index)})",
                              hint="a reward returns a list with one float per completion")  # fmt: skip
        out = []
        for i, value in enumerate(result):
            if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise RewardError(f"{who} returned {value!r} for a completion of "
                                  f"{_describe(prompts[i], prompt_index[i])}",
                                  hint="a reward must be a finite number")  # fmt: skip
            out.append(float(value))
        return out

    def close(self) -> None:
        """Stop the user rewards' process."""
        self.users.close()
