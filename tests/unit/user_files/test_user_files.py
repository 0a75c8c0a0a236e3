"""The per-user files package: where the files live, the one atomic private write, the tolerant
read, and the fingerprinted store both calibrations keep."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from homelab_dp.user_files import paths
from homelab_dp.user_files.fingerprint_store import (
    Check,
    FingerprintStore,
    StoredRecord,
    is_number,
    is_text,
)
from homelab_dp.user_files.private_write import (
    read_back,
    replacing,
    temporary_name,
    write_private,
    write_whole,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_xdg_folders_and_their_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "k"))
    assert paths.data_home() == tmp_path / "d" / "homelab-dp"
    assert paths.config_home() == tmp_path / "c" / "homelab-dp"
    assert paths.cache_home() == tmp_path / "k" / "homelab-dp"
    assert paths.xdg_cache() == tmp_path / "k"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", "")  # empty counts as unset
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", "~/elsewhere")  # ~ expanded
    assert paths.data_home() == tmp_path / "home" / ".local" / "share" / "homelab-dp"
    assert paths.config_home() == tmp_path / "home" / ".config" / "homelab-dp"
    assert paths.cache_home() == tmp_path / "home" / "elsewhere" / "homelab-dp"


def test_private_write_makes_a_0600_file_in_0700_folders(tmp_path: Path) -> None:
    old = os.umask(0o022)  # the usual umask: 0700 and 0600 are asked for, not left to it
    try:
        path = tmp_path / "a" / "b" / "calibration.json"
        assert write_private(path, '{"x": 1}\n') == path
    finally:
        os.umask(old)
    assert path.read_text() == '{"x": 1}\n'
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700 and _mode(path.parent.parent) == 0o700
    write_private(path, b"second")  # replaces: still 0600
    assert path.read_bytes() == b"second" and _mode(path) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["calibration.json"]


def test_an_existing_folder_keeps_its_mode(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    write_private(folder / "f", b"x")
    assert _mode(folder) == 0o755 and _mode(folder / "f") == 0o600


def test_a_shared_write_gets_the_umask_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = write_whole(tmp_path / "spec.json", "{}", fsync=True)
    finally:
        os.umask(old)
    assert _mode(path) == 0o644 and path.read_text() == "{}"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="half way"), replacing(path) as fh:
        fh.write(b"new, but only")
        raise RuntimeError("half way")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_an_oserror_names_the_file_not_the_temporary(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")
    with pytest.raises(OSError) as err, replacing(path) as fh:
        fh.write(b"x")
        raise OSError(28, "No space left on device")  # what a full disk raises: no filename
    assert err.value.filename == str(path) and path.read_text() == "old"
    with pytest.raises(FileNotFoundError) as err:  # its folder is missing: no temporary made
        write_whole(tmp_path / "gone" / "state.json", b"new")
    assert err.value.filename == str(tmp_path / "gone" / "state.json")


def test_a_directory_at_the_path_fails_and_cleans_up(tmp_path: Path) -> None:
    path = tmp_path / "taken"
    path.mkdir()
    (path / "inside").write_text("keep")
    with pytest.raises(OSError):
        write_private(path, b"x")  # os.replace cannot put a file over a folder
    assert (path / "inside").read_text() == "keep"
    assert not temporary_name(path).exists()


def test_read_back_is_tolerant(tmp_path: Path) -> None:
    missing = read_back(tmp_path / "none.json", 100)
    assert (missing.doc, missing.found, missing.problem) == (None, False, None)
    good = tmp_path / "good.json"
    good.write_text('{"a": [1, 2]}')
    assert read_back(good, 100).doc == {"a": [1, 2]} and read_back(good, 100).found
    torn = tmp_path / "torn.json"
    torn.write_text('{"a": [1, ')
    got = read_back(torn, 100)
    assert got.doc is None and not got.found and "column 11" in (got.problem or "")
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 100 + "0]")
    assert "over the limit of 100" in (read_back(big, 100).problem or "")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert "a FIFO" in (read_back(fifo, 100).problem or "")
    (tmp_path / "bad-utf8.json").write_bytes(b'"\xff"')
    assert "utf-8" in (read_back(tmp_path / "bad-utf8.json", 100).problem or "")


@dataclass(frozen=True)
class Rate(StoredRecord):
    """A record for the store's test: a fingerprint, a figure, a time."""

    CHECKS: ClassVar[dict[str, Check]] = {
        "fingerprint": is_text,
        "value": is_number(0, 100),
        "time": is_number(0, 1e12),
    }
    fingerprint: str
    value: float
    time: float = 0.0
    note: str = ""


def test_the_fingerprint_store_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "data" / "rates.json"
    store = FingerprintStore(path, "rates", Rate, keep=3)
    assert store.records == [] and store.problem is None  # nothing yet: no problem
    for t in range(5):
        store.add(Rate("gpu-a", float(t), time=float(t)))
    store.add(Rate("gpu-b", 50.0, time=1.0))
    store.add(Rate("gpu-a", 9.0, time=9.0), replaces=lambda r: r.value == 4.0)
    assert [r.value for r in store.of("gpu-a")] == [2.0, 3.0, 9.0]  # the newest 3 kept
    assert store.of(None) == [] and [r.value for r in store.of("gpu-b")] == [50.0]
    assert store.save() == path
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and doc["rates"][0] == {
        "fingerprint": "gpu-a", "value": 2.0, "time": 2.0, "note": ""
    }  # fmt: skip
    again = FingerprintStore(path, "rates", Rate, keep=3)
    assert again.problem is None and again.records == store.records


def test_the_fingerprint_store_leaves_out_what_does_not_match(tmp_path: Path) -> None:
    path = tmp_path / "rates.json"
    good: dict[str, Any] = {"fingerprint": "gpu-a", "value": 1.0, "time": 1.0}
    path.write_text(json.dumps({"version": 1, "rates": [
        good, {**good, "value": 1000.0}, {"value": 1.0}, "text", {**good, "extra": 1},
    ]}))  # fmt: skip
    store = FingerprintStore(path, "rates", Rate)
    assert [r.value for r in store.records] == [1.0, 1.0]  # a newer version's field is ignored
    assert store.problem == (
        f"{path}: 3 of 5 rates left out as damaged (the first, rates[1]: 'value' is '1000.0'); "
        "the file is rewritten without them at the next record"
    )
    store.save()
    assert FingerprintStore(path, "rates", Rate).problem is None  # gone from the file
    path.write_text(json.dumps({"version": 1, "records": []}))  # another store's file
    assert FingerprintStore(path, "rates", Rate).problem == (
        f"{path}: unreadable (no list of rates); starting afresh"
    )
    path.write_text('{"rates": [')
    wrong = FingerprintStore(path, "rates", Rate)
    assert wrong.records == [] and wrong.problem is not None
    assert wrong.problem.startswith(f"{path}: unreadable (Expecting value, column")
