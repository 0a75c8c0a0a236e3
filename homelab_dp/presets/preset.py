"""Presets: the TOML schema of a fine-tune as typed dataclasses.

A preset is data, never code: it is parsed with `tomllib`, every key is checked against the
dataclasses below, unknown keys and wrong types are rejected, and every problem is reported at
once, each naming its key (``train.micro_batch``).
"""

from __future__ import annotations

import math
import sys
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from homelab_dp.core.preset_sections import (
    CostSection,
    DataSection,
    HardwareSection,
    LogSection,
    LoraSection,
    ModelSection,
    Preset,
    TrainSection,
)
from homelab_dp.errors import PresetError

# The sections are defined beside this module; importers take them from here.
__all__ = ["SECTIONS", "CostSection", "DataSection", "HardwareSection", "LogSection", "LoraSection",
           "ModelSection", "Preset", "TrainSection", "apply_overrides", "field_docs", "load_preset",
           "parse_override", "preset_from_dict"]  # fmt: skip

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "lora": LoraSection,
    "hardware": HardwareSection,
    "cost": CostSection,
    "log": LogSection,
}

# Sizes that must be at least 1 (0 and negatives are rejected); values that must not be negative.
_POSITIVE = {"data.seq_len", "train.micro_batch", "train.grad_accum", "train.log_every",
             "train.keep_checkpoints", "lora.r", "lora.alpha", "hardware.nproc"}  # fmt: skip
_NON_NEGATIVE = {
    "train.max_steps", "train.epochs", "train.warmup_steps", "train.checkpoint_every",
    "train.weight_decay", "train.max_grad_norm", "train.reference_batch", "train.watchdog_s",
    "train.collective_timeout_s", "cost.per_kwh", "lora.dropout", "train.min_lr_ratio",
    "train.eval_every", "train.early_stopping_patience",
}  # fmt: skip
_POSITIVE_FLOAT = {"train.lr"}
_RANGES = {"data.eval_fraction": (0.0, 0.5)}


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) if isinstance(a, str) else str(a).lower() for a in get_args(tp))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return "a table of strings"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, str(tp)
    )


def _check_value(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return (ok, converted) for a TOML value against a type annotation."""
    origin = get_origin(tp)
    if origin is Literal:
        for option in get_args(tp):
            if type(value) is type(option) and value == option:
                return True, value
        return False, value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for option in get_args(tp):
            ok, conv = _check_value(value, option)
            if ok:
                return True, conv
        return False, value
    if origin is list:
        if not isinstance(value, list):
            return False, value
        (inner,) = get_args(tp)
        out = []
        for item in value:
            ok, conv = _check_value(item, inner)
            if not ok:
                return False, value
            out.append(conv)
        return True, out
    if origin is dict:  # dict[str, str] only: [data] columns
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        )
        return ok, dict(value) if ok else value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    return False, value


def _non_finite(value: Any) -> bool:
    """Whether ``value`` is, or holds at any depth, a NaN or an infinity."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_non_finite(v) for v in value)
    return False


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # the section module's own names resolve the annotations


def preset_from_dict(data: dict[str, Any], source: str = "") -> Preset:
    """Validate nested dicts (as TOML gives them) into a Preset; every problem raised at once."""
    problems: list[str] = []
    sections: dict[str, Any] = {}
    for key in data:
        if key not in SECTIONS:
            problems.append(
                f"unknown section [{key}] (known: {', '.join('[' + s + ']' for s in SECTIONS)})"
            )
    for name, cls in SECTIONS.items():
        raw = data.get(name, {})
        if not isinstance(raw, dict):
            problems.append(f"{name}: expected a [{name}] table, got {type(raw).__name__}")
            sections[name] = cls()
            continue
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for key, value in raw.items():
            dotted = f"{name}.{key}"
            if key not in hints:
                known = ", ".join(hints)
                problems.append(f"{dotted}: unknown key (known in [{name}]: {known})")
                continue
            if _non_finite(value):  # TOML's inf/nan (or 1e999): never a usable setting
                problems.append(f"{dotted}: must be a finite number, got {value!r}")
                continue
            ok, conv = _check_value(value, hints[key])
            if not ok:
                problems.append(f"{dotted}: expected {_type_name(hints[key])}, got {value!r}")
                continue
            if dotted in _POSITIVE and conv < 1:
                problems.append(f"{dotted}: must be at least 1, got {value!r}")
                continue
            if dotted in _NON_NEGATIVE and conv < 0:
                problems.append(f"{dotted}: must not be negative, got {value!r}")
                continue
            if dotted in _POSITIVE_FLOAT and conv <= 0:
                problems.append(f"{dotted}: must be greater than 0, got {value!r}")
                continue
            low, high = _RANGES.get(dotted, (-math.inf, math.inf))
            if dotted in _RANGES and not low <= conv <= high:
                problems.append(f"{dotted}: must be between {low} and {high}, got {value!r}")
                continue
            values[key] = conv
        sections[name] = cls(**values)
    preset = Preset(**sections, source=source)
    problems.extend(_cross_checks(preset, data))
    if problems:
        where = f"{source}: " if source else ""
        first = f"{where}{problems[0]}"
        if len(problems) > 1:
            first += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
        raise PresetError(
            first,
            hint="fix each key named; `homelab-dp presets show tiny-demo` shows a valid preset",
            problems=[f"{where}{p}" for p in problems],
        )
    return preset


def _cross_checks(preset: Preset, data: dict[str, Any]) -> list[str]:
    problems = []
    if not preset.model.path and isinstance(data.get("model", {}), dict):
        problems.append("model.path: required (a local Hugging Face model folder or a model id)")
    if not preset.data.path and isinstance(data.get("data", {}), dict):
        problems.append("data.path: required (a data file or folder, or a dataset id)")
    if preset.train.max_steps == 0 and preset.train.epochs <= 0:
        problems.append("train.epochs: must be greater than 0 when train.max_steps is 0")
    devices = preset.hardware.devices
    if isinstance(devices, list):
        if not devices:
            problems.append("hardware.devices: the list of GPU indices is empty")
        elif any(i < 0 for i in devices) or len(set(devices)) != len(devices):
            problems.append(f"hardware.devices: indices must be distinct and >= 0, got {devices}")
    train = preset.train
    if train.method == "qlora" and train.distribution == "zero1":
        problems.append("train.distribution: qlora runs under ddp, fsdp-grad-op or fsdp-full "
                        "(ZeRO-1 shards only the adapters' tiny optimizer state), got 'zero1'")  # fmt: skip
    if train.offload in ("optimizer", "params"):
        if train.distribution in ("ddp", "zero1"):
            problems.append(f"train.offload = {train.offload!r} needs FSDP: set train.distribution "
                            f"= 'fsdp-grad-op', 'fsdp-full' or 'auto', got {train.distribution!r}")  # fmt: skip
        if train.optimizer != "adamw":
            problems.append(f"train.offload = {train.offload!r} steps AdamW in host memory: set "
                            f"train.optimizer = 'adamw', got {train.optimizer!r}")  # fmt: skip
    return problems + _eval_checks(preset)


def _eval_checks(preset: Preset) -> list[str]:
    """Validation: one source of eval data, and the fields that need one only with it."""
    d, t = preset.data, preset.train
    if d.eval_path and d.eval_fraction > 0:
        both = f"both set ({d.eval_path!r} and {d.eval_fraction})"
        return [f"data.eval_path and data.eval_fraction: {both}; evaluate on one or the other"]
    if d.eval_path or d.eval_fraction > 0:
        return []
    asked = {"train.eval_every": t.eval_every, "train.keep_best": t.keep_best,
             "train.early_stopping_patience": t.early_stopping_patience}  # fmt: skip
    return [f"{key}: set to {str(v).lower()}, but there is no eval data (set data.eval_path "
            "or data.eval_fraction)" for key, v in asked.items() if v]  # fmt: skip


def load_preset(path: str | Path) -> Preset:
    """Read and validate a preset file. Raises PresetError naming the file and key."""
    p = Path(path)
    if not p.is_file():
        raise PresetError(
            f"{p}: no such preset file", hint="`homelab-dp presets list` shows the known presets"
        )
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise PresetError(
            f"{p}: not valid TOML: {exc}", hint="check the quoting and brackets on that line"
        ) from None
    except UnicodeDecodeError:
        raise PresetError(f"{p}: not a UTF-8 text file", hint="a preset is a TOML file") from None
    return preset_from_dict(data, source=str(p))


def parse_override(text: str) -> tuple[str, Any]:
    """Parse one ``--set section.key=VALUE``; VALUE is read as a TOML value, else as a string."""
    if "=" not in text:
        raise PresetError(
            f"--set {text}: expected KEY=VALUE", hint="e.g. --set train.micro_batch=2"
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.count(".") != 1 or not all(key.split(".")):
        raise PresetError(
            f"--set {text}: the key must be section.key", hint="e.g. --set train.micro_batch=2"
        )
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def apply_overrides(preset: Preset, overrides: list[str]) -> Preset:
    """Return a new Preset with ``--set`` overrides applied and validated."""
    if not overrides:
        return preset
    data = preset.to_dict()
    for text in overrides:
        key, value = parse_override(text)
        section, name = key.split(".")
        if section not in SECTIONS:
            raise PresetError(
                f"--set {key}: unknown section [{section}]",
                hint=f"sections are {', '.join(SECTIONS)}",
            )
        if name not in _hints(SECTIONS[section]):
            raise PresetError(
                f"--set {key}: unknown key",
                hint=f"keys in [{section}] are {', '.join(_hints(SECTIONS[section]))}",
            )
        data[section][name] = value
    return preset_from_dict(data, source=preset.source)


def field_docs() -> dict[str, str]:
    """Each ``section.key`` with the first line of its docstring (for `presets show`, the TUI)."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    for name, cls in SECTIONS.items():
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[f"{name}.{node.target.id}"] = " ".join(nxt.value.value.split())
    return docs
