"""The README and the user guide in docs/: every relative link and anchor resolves, the README
stays a short entry page, and every guide page is reachable from the guide's index."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
README_MAX_LINES = 250


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of ``page`` (headings inside code fences do not count)."""
    out: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_is_a_short_entry_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_every_guide_page_is_in_the_index() -> None:
    index = set(_links(ROOT / "docs" / "README.md"))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= {t.partition("#")[0] for t in index}


def test_the_architecture_page_names_every_folder_and_module() -> None:
    """docs/ARCHITECTURE.md matches the tree: each package folder (`planning/memory/`) and each
    module's file name outside the front ends is named there, so a newcomer finds every part."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    package = ROOT / "homelab_dp"
    missing = []
    for folder in sorted(p for p in package.rglob("*") if (p / "__init__.py").is_file()):
        rel = folder.relative_to(package).as_posix()
        if rel.split("/")[0] in ("cli", "render", "tui"):
            continue
        if f"{rel}/" not in text and f"**{rel.rsplit('/', 1)[-1]}/**" not in text:
            missing.append(f"{rel}/")
    for module in sorted(package.rglob("*.py")):
        rel = module.relative_to(package)
        if module.name == "__init__.py" or rel.parts[0] in ("cli", "render", "tui"):
            continue
        if f"`{module.name}`" not in text and f"{rel.as_posix()}" not in text:
            missing.append(rel.as_posix())
    for front in ("cli/", "render/", "tui/"):
        if front not in text:
            missing.append(front)
    assert missing == []
