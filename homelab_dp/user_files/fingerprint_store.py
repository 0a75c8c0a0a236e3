"""The fingerprinted store both calibrations keep: a JSON file of records, each made on one
machine (its hardware fingerprint), the newest `FingerprintStore.keep` of a fingerprint kept.

The memory calibration (``calibration.json``, `homelab_dp.planning.memory.memory_calibration`)
and the speed calibration (``speed.json``, `homelab_dp.planning.speed_calibration`) are each a
`FingerprintStore` of their own record type (a frozen dataclass that is a `StoredRecord`): the
file is ``{"version": 1, NAME: [record, …]}``, written private and atomically
(`private_write.write_private`).

The file is not trusted: it is read by `private_write.read_back` (a regular file of at most
`MAX_FILE_BYTES`; a FIFO or a link to ``/dev/zero`` there is no file) and every record is
checked field by field (`StoredRecord.CHECKS`: types, ranges, finite numbers). What cannot be
read is left out and said in `FingerprintStore.problem` (the whole file: "unreadable (why);
starting afresh"; some records: how many and why the first), and is gone from the file the
next time it is written. Pure standard library.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import MISSING, asdict
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from homelab_dp import json_safe
from homelab_dp.user_files.private_write import read_back, write_private

FILE_VERSION = 1
KEEP_PER_FINGERPRINT = 50
"""Older records of a fingerprint are dropped beyond this many."""
MAX_FILE_BYTES = 16 * 2**20
"""The largest calibration (or speed) file read: far more than `KEEP_PER_FINGERPRINT` records of
hundreds of fingerprints; a larger one is not ours and is ignored."""
MAX_TEXT = 1000
"""The longest string a record may hold."""

Check = Callable[[Any], bool]


def is_text(value: Any) -> bool:
    """A string of at most `MAX_TEXT` characters."""
    return isinstance(value, str) and len(value) <= MAX_TEXT


def is_int(lo: int, hi: int, optional: bool = False) -> Check:
    """A check: an integer (not a bool) in [lo, hi] (or None, when ``optional``)."""
    return lambda v: (optional and v is None) or (type(v) is int and lo <= v <= hi)


def is_number(lo: float, hi: float, *, above: bool = False, optional: bool = False) -> Check:
    """A check: a finite number (not a bool) in [lo, hi], or (lo, hi] with ``above`` (or None,
    when ``optional``)."""

    def check(v: Any) -> bool:
        if optional and v is None:
            return True
        if type(v) not in (int, float) or not math.isfinite(v):
            return False
        return (v > lo if above else v >= lo) and v <= hi

    return check


def is_scalar_map(value: Any) -> bool:
    """A JSON object of strings to strings, numbers, booleans or nulls (a model or shape key)."""
    return isinstance(value, dict) and all(
        is_text(k) and (v is None or is_text(v) or type(v) in (int, bool)
                        or (type(v) is float and math.isfinite(v)))
        for k, v in value.items()
    )  # fmt: skip


def field_problem(doc: Any, checks: dict[str, Check], required: Iterable[str]) -> str | None:
    """Why ``doc`` is not a record of ``checks`` (a field missing or failing its check), or
    None. Fields not in ``checks`` are ignored (a newer version's)."""
    if not isinstance(doc, dict):
        return "not an object"
    for name in required:
        if name not in doc:
            return f"{name!r} missing"
    for name, check in checks.items():
        if name in doc and not check(doc[name]):
            return f"{name!r} is {str(doc[name])[:40]!r}"
    return None


def required_fields(cls: Any) -> list[str]:
    """The fields of dataclass ``cls`` without a default."""
    fields = cls.__dataclass_fields__.values()
    return [f.name for f in fields if f.default is MISSING and f.default_factory is MISSING]


class StoredRecord:
    """What a record of a `FingerprintStore` is: a frozen dataclass with ``fingerprint`` and
    ``time`` fields whose class names the check of every stored field (`CHECKS`)."""

    CHECKS: ClassVar[dict[str, Check]] = {}
    """What each field of a stored record must be."""
    fingerprint: str
    time: float

    @classmethod
    def problem(cls, doc: Any) -> str | None:
        """Why ``doc`` is no record of this kind (a field missing, of the wrong type, out of
        range or not finite), or None when it is one."""
        return field_problem(doc, cls.CHECKS, required_fields(cls))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls: type[R], doc: dict[str, Any]) -> R:
        """The record of ``doc``; ValueError when `problem` finds one."""
        problem = cls.problem(doc)
        if problem:
            raise ValueError(problem)
        names = cls.__dataclass_fields__  # type: ignore[attr-defined]
        return cls(**{k: v for k, v in doc.items() if k in names})


R = TypeVar("R", bound=StoredRecord)


def read_records(path: Path, name: str, parse: Callable[[Any], R]) -> tuple[list[R], str | None]:
    """The records under ``name`` in the JSON file ``path``, each read by ``parse`` (which
    raises ValueError for a bad one), and what was wrong: the file unreadable (a FIFO, a device,
    over `MAX_FILE_BYTES`, not JSON: no records), or how many records were left out and why the
    first. A missing file is no problem."""
    got = read_back(path, MAX_FILE_BYTES)
    if got.problem is not None:
        return [], f"{path}: unreadable ({got.problem}); starting afresh"
    if not got.found:
        return [], None
    raw = got.doc.get(name) if isinstance(got.doc, dict) else None
    if not isinstance(raw, list):
        return [], f"{path}: unreadable (no list of {name}); starting afresh"
    records, bad = [], []
    for i, item in enumerate(raw):
        try:
            records.append(parse(item))
        except (ValueError, TypeError) as exc:
            bad.append(f"{name}[{i}]: {exc}")
    if not bad:
        return records, None
    return records, (
        f"{path}: {len(bad)} of {len(raw)} {name} left out as damaged (the first, {bad[0]}); "
        "the file is rewritten without them at the next record"
    )


class FingerprintStore(Generic[R]):
    """A file of records of every fingerprint seen on this account (see the module docstring).

    ``records`` in file order; ``problem`` why the file, or some of its records, could not be
    read (what could not is left out, and gone from the file at the next `save`)."""

    def __init__(
        self, path: Path, name: str, record: type[R], keep: int = KEEP_PER_FINGERPRINT
    ) -> None:
        self.path, self.name, self.keep = path, name, keep
        self.records: list[R]
        self.problem: str | None
        self.records, self.problem = read_records(path, name, record.from_json)

    def of(self, fingerprint: str | None) -> list[R]:
        """The records of ``fingerprint`` (none for None: hardware that is not here)."""
        return [r for r in self.records if fingerprint and r.fingerprint == fingerprint]

    def add(self, record: R, replaces: Callable[[R], bool] | None = None) -> None:
        """Keep ``record`` last, after dropping the records ``replaces`` names (an earlier
        record of the same thing); beyond `keep` records of its fingerprint the oldest go."""
        kept = [r for r in self.records if not (replaces and replaces(r))]
        kept.append(record)
        same = sorted((r for r in kept if r.fingerprint == record.fingerprint),
                      key=lambda r: r.time)  # fmt: skip
        drop = {id(r) for r in same[: max(len(same) - self.keep, 0)]}
        self.records = [r for r in kept if id(r) not in drop]

    def save(self) -> Path:
        """Write the file atomically, private to the user."""
        doc = {"version": FILE_VERSION, self.name: [r.to_json() for r in self.records]}
        return write_private(self.path, json_safe.dumps(doc, indent=1) + "\n")
