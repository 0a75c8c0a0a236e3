"""The per-user run index: where runs live, concurrent appends, dedup, old ./runs, lookups."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest

from homelab_dp.runs.folder import run_index as index
from homelab_dp.runs.folder.run_folder import open_runs_root
from homelab_dp.runs.folder.run_index import (
    RunAmbiguousError,
    RunGoneError,
    RunUnknownError,
    find_run,
    known_runs,
    register,
    runs_root,
)


def _run(root: Path, run_id: str) -> Path:
    """A minimal run folder (what makes a folder a run: its spec.json)."""
    folder = root / run_id
    folder.mkdir(parents=True)
    (folder / "spec.json").write_text("{}", encoding="utf-8")
    return folder


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_default_root_is_per_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HOMELAB_DP_RUNS")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert runs_root() == tmp_path / "data" / "homelab-dp" / "runs"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runs_root() == tmp_path / "home" / ".local" / "share" / "homelab-dp" / "runs"
    monkeypatch.setenv("HOMELAB_DP_RUNS", str(tmp_path / "elsewhere"))
    assert runs_root() == tmp_path / "elsewhere"


def test_folders_and_the_index_are_private(tmp_path: Path) -> None:
    root = open_runs_root(tmp_path / "a" / "b" / "runs")
    assert root.is_dir()
    assert [_mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", root)] == [0o700] * 3
    register(_run(root, "r1"))
    assert _mode(index.index_path()) == 0o600
    assert _mode(index.data_home()) == 0o700


def test_concurrent_appends_from_threads_keep_every_line_whole(tmp_path: Path) -> None:
    folders = [tmp_path / f"run-{i:03d}" for i in range(400)]
    chunks = [folders[i::8] for i in range(8)]
    barrier = threading.Barrier(len(chunks))

    def writer(chunk: list[Path]) -> None:
        barrier.wait()  # all threads append at the same moment
        for folder in chunk:
            register(folder)

    threads = [threading.Thread(target=writer, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = index.index_path().read_text(encoding="utf-8").splitlines()
    assert len(lines) == 400
    docs = [json.loads(line) for line in lines]  # every line parses: none torn or interleaved
    assert sorted(d["id"] for d in docs) == sorted(f.name for f in folders)
    assert {d["path"] for d in docs} == {str(f.resolve()) for f in folders}


def test_one_entry_per_folder_however_it_was_found(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    a = _run(root, "20260101-000000-a-0001")
    register(a)
    register(a)  # twice in the index
    (tmp_path / "link").symlink_to(root)
    register(tmp_path / "link" / a.name)  # and under another name of the same folder
    runs = known_runs(root)  # and found by the scan of the root
    assert [(r.id, r.path, r.exists) for r in runs] == [(a.name, a.resolve(), True)]


def test_runs_of_old_versions_in_dot_runs_are_found_and_then_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    old = _run(project / "runs", "20250101-000000-old-0001")  # made before the index existed
    monkeypatch.chdir(project)
    assert [r.path for r in known_runs(tmp_path / "root")] == [old.resolve()]
    monkeypatch.chdir(tmp_path)  # elsewhere: the index remembers it
    assert find_run("20250101-000000-old", tmp_path / "root") == old.resolve()


def test_find_by_id_prefix_or_path(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    a = _run(root, "20260101-000000-alpha-0001")
    b = _run(root, "20260101-000000-beta-0002")
    elsewhere = _run(tmp_path / "other", "20260102-000000-gamma-0003")
    register(elsewhere)
    assert find_run(a.name, root) == a.resolve()
    assert find_run("20260101-000000-b", root) == b.resolve()
    assert find_run("20260102", root) == elsewhere.resolve()  # not under the root: the index
    assert find_run(str(b), root) == b
    with pytest.raises(RunAmbiguousError) as err:
        find_run("20260101", root)
    assert "matches 2 runs" in err.value.message and a.name in err.value.message
    assert "more of the id" in err.value.hint
    for ref in ("2027", ""):
        with pytest.raises(RunUnknownError) as unknown:
            find_run(ref, root)
        assert "runs" in unknown.value.hint
    with pytest.raises(RunUnknownError):
        find_run(str(tmp_path / "no" / "such"), root)


def test_a_gone_folder_is_reported_not_a_crash(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    gone = _run(tmp_path / "moved", "20260101-000000-gone-0001")
    register(gone)
    shutil.rmtree(gone)
    with index.index_path().open("a", encoding="utf-8") as fh:
        fh.write('{"id": "torn", "pa')  # a crash mid-write: skipped
    runs = known_runs(root)
    assert [(r.id, r.exists) for r in runs] == [(gone.name, False)]
    with pytest.raises(RunGoneError) as err:
        find_run("20260101", root)
    assert err.value.message == f"run {gone.name} was at {gone.resolve()}; that folder is gone"
    # The same id in a folder that is there (say the run was copied back): that one is found.
    back = _run(root, gone.name)
    assert find_run(gone.name, root) == back.resolve()


def test_an_index_that_cannot_be_written_still_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("", encoding="utf-8")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "file"))  # a file where a folder must be
    a = _run(tmp_path / "runs", "20260101-000000-a-0001")
    assert [r.path for r in known_runs(tmp_path / "runs")] == [a.resolve()]
    with pytest.raises(OSError):
        register(a)
    assert os.path.isfile(tmp_path / "file")


def test_forget_gone_drops_only_gone_runs_and_loses_no_concurrent_append(tmp_path: Path) -> None:
    kept = [_run(tmp_path / "runs", f"kept-{i:03d}") for i in range(3)]
    gone = _run(tmp_path / "old", "gone-001")
    for folder in (*kept, gone, gone):
        register(folder)
    shutil.rmtree(gone)
    late = [_run(tmp_path / "late", f"late-{i:03d}") for i in range(300)]  # registered meanwhile
    barrier = threading.Barrier(3)

    def append(chunk: list[Path]) -> None:
        barrier.wait()
        for folder in chunk:
            register(folder)

    threads = [threading.Thread(target=append, args=(late[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    barrier.wait()
    forgotten = [index.forget_gone()]
    for i in range(30):  # rewrite after rewrite while the others append
        register(tmp_path / "nowhere" / f"never-{i}")
        forgotten.append(index.forget_gone())
    for t in threads:
        t.join()
    assert [r.id for r in forgotten[0]] == ["gone-001"]  # indexed twice, forgotten once
    assert [[r.id for r in batch] for batch in forgotten[1:]] == [[f"never-{i}"] for i in range(30)]
    ids = [json.loads(line)["id"] for line in index.index_path().read_text().splitlines()]
    # Every other line is there, the 300 appended during the rewrites included, each once.
    assert sorted(ids) == sorted(f.name for f in kept + late)
    assert _mode(index.index_path()) == 0o600
