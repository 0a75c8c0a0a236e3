"""`homelab-dp sweep`: every point of a grid of preset values planned, then queued as ordinary
runs tagged with one sweep id.

The grid is the preset's ``[sweep] grid`` with each ``--grid KEY=V1,V2`` replacing that key's
values (a key the table lacks is added). Values are split on the commas outside brackets,
braces and quotes (``lora.target_modules=["q_proj","v_proj"],["q_proj"]`` is two lists); each
is read as ``--set`` reads it (a TOML value, else a string) and checked by the preset's own
type checks, so a wrong type names its key. A key given twice (two ``--grid``, or ``--grid``
and ``--set``) is refused, and so is a grid of more than `MAX_POINTS` combinations, counted
before any value is checked or any point planned.
Every point is planned with the functions `plan` uses, on idle cards (it will wait for them);
points that do not fit are refused with the plan's reason, and when none fits nothing is
queued (exit 2). The fitting points then pass the run preflight (`RunController.prepare`), all
of them before the first is queued, and are queued in grid order.
"""

from __future__ import annotations

import difflib
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import tomli_w

from homelab_dp.app.plan import make_plan, on_idle_cards
from homelab_dp.app.runs import Prepared, RunController, SweepTag, check_run_gpus
from homelab_dp.errors import HomelabError, PresetError
from homelab_dp.presets.preset import Preset, parse_override, preset_from_dict
from homelab_dp.presets.preset_store import open_preset

GRID_HINT = "e.g. --grid train.lr=1e-4,2e-4 --grid lora.r=8,16 (or a [sweep] grid in the preset)"
MAX_POINTS = 1000
"""The most combinations one sweep plans (each is planned, about 40 ms, and queued as a run)."""
SHOWN_REFUSALS = 3
"""How many refused points the error of a sweep none of whose points fits names one by one."""
REASON_CHARS = 300
"""The most characters of one refused point's reason in that error."""
_CLOSE = {"[": "]", "{": "}"}


@dataclass
class SweepPoint:
    """One combination of the grid and what became of it."""

    settings: dict[str, Any]
    """Dotted preset key → value."""
    fits: bool = False
    reason: str = ""
    """The plan's chosen line (fits) or why it does not fit."""
    run_id: str | None = None
    """The queued run (None: refused)."""

    def to_json(self) -> dict[str, Any]:
        """One point of `sweep --json`."""
        return {"settings": self.settings, "fits": self.fits, "reason": self.reason,
                "run_id": self.run_id}  # fmt: skip


@dataclass
class Sweep:
    """A planned and queued sweep."""

    sweep_id: str
    preset: str
    grid: dict[str, list[Any]]
    points: list[SweepPoint] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """`sweep --json`: the id, the grid, and each point's settings, fit and run id."""
        return {"sweep_id": self.sweep_id, "preset": self.preset, "grid": self.grid,
                "points": [p.to_json() for p in self.points],
                "queued": sum(1 for p in self.points if p.run_id)}  # fmt: skip


def new_sweep_id(name: str) -> str:
    """``sweep-<yyyymmdd-hhmmss>-<preset>-<4 hex>``."""
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-")[:32]
    return f"sweep-{time.strftime('%Y%m%d-%H%M%S')}-{slug or 'preset'}-{secrets.token_hex(2)}"


def preset_keys(preset: Preset) -> list[str]:
    """Every dotted key a grid may name (``sweep.*`` excluded: a point is not a sweep)."""
    return [f"{section}.{key}" for section, table in preset.to_dict().items()
            if section != "sweep" for key in table]  # fmt: skip


def check_key(key: str, preset: Preset, where: str) -> None:
    """A grid key must be a preset field; otherwise an error listing the close names."""
    known = preset_keys(preset)
    if key in known:
        return
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    tail = key.split(".", 1)[-1]  # "train.lora.r" → "lora.r"
    if tail in known and tail not in close:
        close.insert(0, tail)
    raise PresetError(
        f"{where}: {key!r} is not a preset field",
        hint=(f"did you mean {', '.join(close)}? " if close else "")
        + "`homelab-dp presets show PRESET` lists the fields (section.key)",
    )


def check_value(key: str, value: Any, preset: Preset, where: str) -> Any:
    """``value`` for ``key`` through the preset's own checks; the converted value."""
    section, name = key.split(".", 1)
    data = preset.to_dict()
    data[section][name] = value
    try:
        checked = preset_from_dict(data, source=preset.source)
    except PresetError as exc:
        problems = getattr(exc, "problems", None) or [exc.message]
        mine = [p for p in problems if key in p] or problems
        text = mine[0].removeprefix(f"{preset.source}: ") if preset.source else mine[0]
        raise PresetError(
            f"{where}: value {value!r} refused: {text}",
            hint=f"each value of {key} must be valid for it on its own; {GRID_HINT}",
        ) from None
    return checked.to_dict()[section][name]


def split_values(raw: str, where: str) -> list[str]:
    """``V1,V2,...`` split on the commas outside brackets, braces and quotes; each stripped."""
    items: list[str] = []
    stack: list[str] = []
    quote = ""
    start = 0
    for i, c in enumerate(raw):
        if quote:
            if c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c in "]}":
            if not stack or stack.pop() != c:
                raise PresetError(f"{where}: unbalanced {c!r} at character {i + 1}", hint=GRID_HINT)
        elif c == "," and not stack:
            items.append(raw[start:i].strip())
            start = i + 1
    if quote or stack:
        what = f"quote {quote}" if quote else f"{stack[-1]!r}"
        raise PresetError(f"{where}: an unclosed {what}", hint=GRID_HINT)
    items.append(raw[start:].strip())
    if not raw.strip() or any(not item for item in items):
        raise PresetError(f"{where}: an empty value", hint=GRID_HINT)
    return items


def _split_grid(texts: list[str], preset: Preset) -> dict[str, tuple[str, list[str]]]:
    """``--grid KEY=V1,V2`` options as key → (the option, its raw values); keys checked, a
    key given twice refused."""
    raw: dict[str, tuple[str, list[str]]] = {}
    for text in texts:
        where = f"--grid {_cut(text, 80)}"
        if "=" not in text:
            raise PresetError(f"{where}: expected KEY=V1,V2,...", hint=GRID_HINT)
        key, values = (part.strip() for part in text.split("=", 1))
        check_key(key, preset, where)
        if key in raw:
            raise PresetError(f"{where}: {key} is given twice (also as --grid {raw[key][0]})",
                              hint=f"give every value of {key} in one --grid {key}=V1,V2,...")  # fmt: skip
        items = split_values(values, where)
        check_count([len(v) for _, v in raw.values()], len(items), where)
        raw[key] = (text, items)
    return raw


def check_count(counts: list[int], more: int, where: str) -> None:
    """Refuse a grid of more than `MAX_POINTS` points (``counts``: the values per key so far,
    ``more``: the values of the key being added; a key's values bound its count from above)."""
    total = more
    for n in counts:
        total *= max(1, n)
    if total > MAX_POINTS:
        raise PresetError(
            f"{where}: the grid has {total:,} points or more; a sweep plans and queues at "
            f"most {MAX_POINTS:,}",
            hint="sweep fewer values at a time (a coarse grid first, then a fine one around "
            "the best point), or split it into several sweeps",
        )


def parse_grid(texts: list[str], preset: Preset) -> dict[str, list[Any]]:
    """``--grid KEY=V1,V2`` options as key → checked values (in the order given)."""
    grid: dict[str, list[Any]] = {}
    for key, (text, items) in _split_grid(texts, preset).items():
        where = f"--grid {_cut(text, 80)}"
        values = [parse_override(f"{key}={item}")[1] for item in items]
        grid[key] = [check_value(key, v, preset, where) for v in values]
    return grid


def grid_size(grid: dict[str, list[Any]]) -> int:
    """How many points ``grid`` expands to (duplicated values once)."""
    total = 1
    for values in grid.values():
        total *= max(1, len(set(map(repr, values))))
    return total


def effective_grid(preset: Preset, cli: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The preset's ``[sweep] grid`` (checked like ``--grid``) with the ``--grid`` keys
    replacing theirs and adding new ones. Raises when the result is empty or larger than
    `MAX_POINTS` (counted before the preset's values are checked)."""
    kept = {k: v for k, v in preset.sweep.grid.items() if k not in cli}
    counts = [len(v) for v in cli.values()]
    for key, values in kept.items():
        check_count(counts, len(values), f"{preset.source or 'preset'}: [sweep] grid {key}")
        counts.append(len(values))
    grid: dict[str, list[Any]] = {}
    for key, values in preset.sweep.grid.items():
        where = f"{preset.source or 'preset'}: [sweep] grid {key}"
        check_key(key, preset, where)
        if not values:
            raise PresetError(f"{where}: no values", hint=GRID_HINT)
        if key not in cli:
            grid[key] = [check_value(key, v, preset, where) for v in values]
    grid.update(cli)
    if not grid:
        raise PresetError("sweep: no grid (no --grid and no [sweep] grid in the preset)",
                          hint=GRID_HINT)  # fmt: skip
    check_count([], grid_size(grid), "sweep")
    return grid


def check_sets_against_grid(overrides: list[str], grid: dict[str, list[Any]]) -> None:
    """A key set by ``--set`` and swept too, or set twice by ``--set``: refused (the sweep
    would silently use one of them)."""
    seen: dict[str, str] = {}
    for text in overrides:
        key = parse_override(text)[0]
        if key in grid:
            raise PresetError(f"--set {text}: {key} is also swept (--grid or [sweep] grid)",
                              hint=f"leave {key} out of --set, or out of the grid")  # fmt: skip
        if key in seen:
            raise PresetError(f"--set {text}: {key} is given twice (also --set {seen[key]})",
                              hint=f"set {key} once")  # fmt: skip
        seen[key] = text


def expand(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination, the first key varying slowest (duplicated values once)."""
    keys = list(grid)
    unique = [list({repr(v): v for v in grid[k]}.values()) for k in keys]  # lists: unhashable
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*unique)]


def point_overrides(settings: dict[str, Any]) -> list[str]:
    """A point as ``--set`` overrides (TOML values), with the sweep table emptied."""
    sets = [
        tomli_w.dumps({"v": v}).strip().replace("v = ", f"{k}=", 1) for k, v in settings.items()
    ]
    return [*sets, "sweep.grid={}"]


def plan_point(preset_ref: str, overrides: list[str], gpus: str | None) -> tuple[bool, str]:
    """Whether a point fits on idle cards (it will wait for them), and the plan's words."""
    planned = on_idle_cards(make_plan(open_preset(preset_ref, overrides), gpus), gpus)
    plan = planned.plan
    chosen = [r for r in plan.reasons if r.startswith("Chosen:")]
    if plan.fits:
        return True, chosen[0] if chosen else "fits"
    why = chosen[0] if chosen else (plan.reasons[-1] if plan.reasons else "does not fit")
    advice = "; ".join(plan.advice)
    return False, f"does not fit: {why}" + (f" ({advice})" if advice else "")


def sweep(
    controller: RunController,
    preset_ref: str,
    grid_texts: list[str],
    *,
    overrides: list[str] | None = None,
    gpus: str | None = None,
    notify: str | None = None,
) -> Sweep:
    """Plan every point, refuse those that do not fit, preflight the rest and queue them
    (nothing is queued when a check fails or no point fits: HomelabError, exit 2)."""
    overrides = list(overrides or [])
    check_run_gpus(gpus)
    base = open_preset(preset_ref, overrides)
    grid = effective_grid(base, parse_grid(grid_texts, base))
    check_sets_against_grid(overrides, grid)
    name = base.source.rsplit("/", 1)[-1].removesuffix(".toml") if base.source else preset_ref
    result = Sweep(new_sweep_id(name), preset_ref, grid)
    for settings in expand(grid):
        point = SweepPoint(settings)
        try:
            point.fits, point.reason = plan_point(
                preset_ref, overrides + point_overrides(settings), gpus
            )
        except PresetError as exc:  # a combination the preset's cross checks refuse
            point.reason = f"refused: {exc.message}"
        result.points.append(point)
    fitting = [p for p in result.points if p.fits]
    if not fitting:
        raise HomelabError(
            f"sweep: no point of the grid fits, nothing queued ({refusals(result.points)})",
            hint="`homelab-dp plan PRESET --set KEY=VALUE` shows one point's plan; use more "
            "cards, a smaller micro-batch or lora/qlora",
        )
    prepared: list[tuple[SweepPoint, Prepared]] = []
    for p in fitting:  # every preflight before the first run is queued: all or nothing
        sets = overrides + point_overrides(p.settings)
        prepared.append((p, controller.prepare(preset_ref, overrides=sets, gpus=gpus, queue=True)))
    for p, ready in prepared:
        tag = SweepTag(result.sweep_id, p.settings)
        p.run_id = controller.start(ready, queue=True, sweep=tag, notify=notify)
    return result


def refusals(points: list[SweepPoint]) -> str:
    """The refused points in one bounded line: each of the first `SHOWN_REFUSALS` with its
    reason (at most `REASON_CHARS`), then how many more and how many share the first reason."""
    shown = [f"{_words(p.settings)}: {_cut(p.reason)}" for p in points[:SHOWN_REFUSALS]]
    rest = len(points) - len(shown)
    if rest <= 0:
        return "; ".join(shown)
    same = sum(1 for p in points[SHOWN_REFUSALS:] if p.reason == points[0].reason)
    return "; ".join(shown) + (f"; and {rest} more point{'s' * (rest > 1)} of {len(points)} "
                               f"({same} refused for the first reason)")  # fmt: skip


def _cut(text: str, limit: int = REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _words(settings: dict[str, Any]) -> str:
    return _cut(", ".join(f"{k}={v}" for k, v in settings.items()), 200)
