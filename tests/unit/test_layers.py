"""The layers only point down, and no module imports itself round a circle.

Every import counts: at module level, inside functions and under ``TYPE_CHECKING`` (a lazy
import still ties the two modules together). The layers, bottom first, are described in
docs/ARCHITECTURE.md; parts on the same layer do not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import homelab_dp

PACKAGE = Path(homelab_dp.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "__init__",
        "errors",
        "vocabulary",
        "json_safe",
        "safe_files",
        "nf4_quantization",
        "peft_targets",
        "byte_units",
    ),
    ("user_files",),
    ("hub", "probe"),
    ("presets", "data"),
    ("planning", "runs"),
    ("train", "supervise", "serving", "serving.front", "serving.replica"),
    ("measure",),
    ("app",),
    ("render",),
    ("tui",),
    ("cli",),
)
"""Parts of the package (its top-level modules and sub-packages, and the two halves of serving),
bottom layer first: one folder per subject (docs/ARCHITECTURE.md says what each owns)."""

LAYER_OF = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules that ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
            targets = [
                f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imported(name, path, set(mods)) for name, path in mods.items()}


def part_of(module: str) -> str:
    """The part a module belongs to: a two-level part where LAYERS names one (serving.front)."""
    parts = module.split(".")
    if len(parts) > 2 and ".".join(parts[1:3]) in LAYER_OF:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_belongs_to_a_layer() -> None:
    assert sorted(m for m in modules() if part_of(m) not in LAYER_OF) == []


def test_imports_point_down_or_stay_within_their_part() -> None:
    upward = []
    for module, targets in graph().items():
        for target in targets:
            a, b = part_of(module), part_of(target)
            if a != b and LAYER_OF.get(b, 99) >= LAYER_OF.get(a, -1) and b != "__init__":
                upward.append(f"{module} -> {target}")
    assert sorted(upward) == []


def test_no_import_circles() -> None:
    edges = graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert circles == []


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: an import inside a function is an edge like any other."""
    code = "def f():\n    from homelab_dp.presets import preset\n    from .plan_result import x\n"
    path = tmp_path / "planner.py"
    path.write_text(code)
    known = {"homelab_dp.presets.preset", "homelab_dp.planning.plan_result"}
    found = imported("homelab_dp.planning.planner", path, known)
    assert found == {"homelab_dp.presets.preset", "homelab_dp.planning.plan_result"}


MAX_MODULE_LINES = 800
"""A module holds one subject whole, sized by its subject rather than by a cap: it may grow to
about this when that keeps a subject in one place (a planner, a memory model). Past it, it
almost surely holds two subjects: split it along the seam between them (docs/ARCHITECTURE.md);
never cut one subject into fragments to fit."""


def test_no_module_is_over_the_line_limit() -> None:
    long = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_every_import_of_the_projects_names_resolves() -> None:
    """A lazy import (inside a function) of a name that moved fails only when that function
    runs, maybe in a worker under torchrun: check them all here."""
    import importlib

    missing = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if not node.module.startswith("homelab_dp"):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if (
                    not hasattr(module, alias.name)
                    and f"{node.module}.{alias.name}" not in modules()
                ):
                    missing.append(f"{name}: from {node.module} import {alias.name}")
    assert missing == []


FRONT_ENDS = ("cli", "render", "tui")
"""Front ends may mirror the name of the part they show (cli/plan.py, render/plan.py,
app/plan.py); nowhere else do two modules share a file name."""


def test_a_file_name_says_what_it_holds_without_its_folder() -> None:
    names: dict[str, list[str]] = {}
    for name, path in modules().items():
        if path.name == "__init__.py" or part_of(name) in FRONT_ENDS:
            continue
        names.setdefault(path.name, []).append(name)
    assert {n: m for n, m in names.items() if len(m) > 1} == {}
