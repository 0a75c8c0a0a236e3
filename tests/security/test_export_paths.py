"""`export --out` never writes where it must not (issue 28 point 9), through the real CLI.

- Into the run or the model folders the export reads, however a link leads there: the check
  is made on the real path (a linked parent, a linked run folder, a chain of links, a relative
  link, a link at DIR itself, a dangling link into final/).
- Under /proc, /sys or /dev, under a file, or where the user cannot write: an ``error:`` and a
  ``hint:`` with exit 2, never a traceback.

Each case checks that nothing was written anywhere under the test's folder (the run included)
and at DIR. The run is a full fine-tune's folder (``final/`` holds the tiny model), whose
``--format hf`` export is a plain copy: no torch is needed to see where it would go.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from homelab_dp.cli import main
from tests.integration.conftest import DEMO_DATA, DEMO_MODEL, make_run

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker


def _tree(root: Path) -> list[tuple[str, int]]:
    """Every path under ``root`` (links not followed) with its size: what was written."""
    out = []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            out.append((str(path), path.lstat().st_size))
    return sorted(out)


@pytest.fixture
def full_run(tmp_path: Path) -> Path:
    run = make_run(tmp_path / "runs", DEMO_MODEL, DEMO_DATA, name="20260101-000000-full-aaaa")
    shutil.copytree(DEMO_MODEL, run / "final")
    (run / "final" / "empty").mkdir()
    return run


def _refused(capsys: pytest.CaptureFixture[str], root: Path, run: Path, out: str) -> str:
    """`export RUN --format hf --out OUT`: exit 2, one error and one hint, nothing written."""
    before = _tree(root)
    rc = main(["export", str(run), "--format", "hf", "--out", out])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and "\nhint: " in err and "Traceback" not in err, err
    assert _tree(root) == before
    return err


LINKS: dict[str, Callable[[Path, Path], str]] = {
    # link → final/, DIR a new folder behind it
    "parent": lambda tmp, run: (tmp / "l").symlink_to(run / "final") or str(tmp / "l" / "new"),
    # link → the run folder
    "run": lambda tmp, run: (tmp / "r").symlink_to(run) or str(tmp / "r" / "final" / "x"),
    # link → link → final/
    "chain": lambda tmp, run: ((tmp / "b").symlink_to(run / "final"),
                               (tmp / "a").symlink_to(tmp / "b")) and str(tmp / "a" / "n"),
    # a relative link with ..
    "relative": lambda tmp, run: (tmp / "sub").mkdir()
    or (tmp / "sub" / "rel").symlink_to(Path("..") / "runs" / run.name / "final")
    or str(tmp / "sub" / "rel" / "new"),
    # DIR itself a link to an empty folder inside final/
    "dir-is-link": lambda tmp, run: (tmp / "d").symlink_to(run / "final" / "empty")
    or str(tmp / "d"),
    # DIR a dangling link into final/
    "dangling": lambda tmp, run: (tmp / "g").symlink_to(run / "final" / "nothing")
    or str(tmp / "g"),
    # .. after a link: the real parent of final/x/.. is final/
    "dotdot": lambda tmp, run: (tmp / "e").symlink_to(run / "final" / "empty")
    or str(tmp / "e" / ".." / "new"),
}  # fmt: skip


@pytest.mark.parametrize("shape", sorted(LINKS))
def test_a_link_into_the_run_is_refused(
    shape: str, full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = LINKS[shape](tmp_path, full_run)
    err = _refused(capsys, tmp_path, full_run, out)
    assert "link" in err or str(full_run) in err, err


def test_a_link_to_the_base_model_of_an_adapter_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "base"
    shutil.copytree(DEMO_MODEL, base)
    run = make_run(
        tmp_path / "runs", base, DEMO_DATA, name="20260101-000000-lora-bbbb", method="lora"
    )
    (run / "final").mkdir()
    config = {"peft_type": "LORA", "base_model_name_or_path": str(base), "r": 4}
    (run / "final" / "adapter_config.json").write_text(json.dumps(config))
    (run / "final" / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "to-base").symlink_to(base)
    before = _tree(tmp_path)
    rc = main(["export", str(run), "--format", "merged", "--out", str(tmp_path / "to-base" / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and f"inside {base}" in err and "Traceback" not in err, err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize(
    "out",
    ["/proc/self/export", "/proc/new-folder", "/sys/kernel/export", "/sys", "/dev/export",
     "CWD-DOTDOT"],
)  # fmt: skip
def test_special_places_are_refused(
    out: str, full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if out == "CWD-DOTDOT":  # a link, then enough .. to climb from the working folder to /
        out = "/proc/self/cwd/" + "../" * (len(Path.cwd().resolve().parts) - 1) + "proc/x"
    err = _refused(capsys, tmp_path, full_run, out)
    assert "kernel file system" in err, err
    assert not Path(out).exists() or out == "/sys"


def test_a_path_under_a_file_is_refused(
    full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("x")
    for out in (tmp_path / "a-file" / "x", tmp_path / "a-file" / "x" / "y"):
        err = _refused(capsys, tmp_path, full_run, str(out))
        assert "is a file" in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_an_unwritable_folder_is_refused(
    full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        err = _refused(capsys, tmp_path, full_run, str(locked / "out"))
    finally:
        locked.chmod(0o700)
    assert "not writable" in err, err


def test_a_plain_folder_beside_the_run_still_exports(
    full_run: Path, tmp_path: Path, capsys
) -> None:
    """The checks refuse only the class: a real folder reached through a link outside the
    run is written (the link resolved), with the model's files."""
    (tmp_path / "exports").mkdir()
    (tmp_path / "ex").symlink_to(tmp_path / "exports")
    assert (
        main(["export", str(full_run), "--format", "hf", "--out", str(tmp_path / "ex" / "m")]) == 0
    )
    assert (tmp_path / "exports" / "m" / "model.safetensors").is_file()
    assert (tmp_path / "ex").is_symlink()
