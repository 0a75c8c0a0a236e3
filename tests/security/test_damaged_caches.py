"""Caches and calibration files are not trusted: what they hold is checked before it is used.

The speed calibration (``speed.json``), the memory calibration (``calibration.json``) and the
gloo link cache are tried with one bad record beside good ones (every field of every record:
wrong types, NaN and infinities, zero, negative, out of range, a bool for a number, missing,
not an object), and whole files that are damaged (truncated, not JSON, not UTF-8, deep nesting,
a 5,000-digit integer) or not files (a FIFO, a symlink to ``/dev/zero``, a file over the
bound). A bad record is left out, said, and gone from the file at the next write; a plan made
beside it prices compute at positive rates. A token cache entry is tried with every column and
metadata damage (types, nulls, lengths, negative ids, labels, count, format, padding id, an
edit under the old checksum) and as a file: each is no entry, and is written again. The shared reader and writer
(`homelab_dp.safe_files`) are tried on the same paths. The reference log-probability cache's
damage is tried in tests/unit/train/test_objectives.py (it needs the tiny model)."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from homelab_dp import safe_files
from homelab_dp.app.plan import make_plan
from homelab_dp.data import token_cache
from homelab_dp.data.tokenize import Example, PairExample
from homelab_dp.planning.links import read_cached_gloo, write_cached_gloo
from homelab_dp.planning.memory.device_memory import assumed_overhead
from homelab_dp.planning.memory.memory_calibration import (
    CalibrationStore,
    Measurement,
    config_key,
    torch_version,
)
from homelab_dp.planning.memory.train_shape import TrainShape
from homelab_dp.planning.speed_calibration import MODEL_KEYS, SpeedRecord, SpeedStore, record_speed
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.user_files import private_write
from homelab_dp.user_files.fingerprint_store import MAX_FILE_BYTES

from ..conftest import ROOT

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker

QWEN = ROOT / "assets" / "configs" / "qwen2-0.5b"
CPU_FP = "cpu | Test CPU | torch 2.13.0+cpu"
MODEL = {"model_type": "llama", "params": 10, "layers": 1, "hidden": 4, "vocab": 8}


def _speed(**kw: Any) -> dict[str, Any]:
    base = SpeedRecord(
        fingerprint=CPU_FP, kind="cpu", model=MODEL, method="full", distribution="ddp",
        activation_checkpointing=False, world_size=1, device="cpu", tokens_per_s=1000.0,
        flops_per_token=1e9, flops_per_s=1e12, threads=2, source="measure", time=1.0,
    )  # fmt: skip
    return {**base.to_json(), **kw}


def _measurement(**kw: Any) -> dict[str, Any]:
    shape = TrainShape(method="full", distribution="ddp", world_size=2, device="cpu",
                       dtype="fp32", micro_batch=2, seq_len=64)  # fmt: skip
    base = Measurement(
        fingerprint=CPU_FP, key=config_key(MODEL, shape), kind="live_tensor_bytes",
        estimate_tensor_bytes=100, estimate_peak_phase="backward", measured_tensor_bytes=120,
        measured_peak_phase="backward", estimate_phases={"backward": 100},
        measured_phases={"backward": 120}, process_peak_bytes=600, time=1.0,
    )  # fmt: skip
    return {**base.to_json(), **kw}


NAN, INF = float("nan"), float("inf")
BAD_SPEED = {
    "negative FLOP/s": {"flops_per_s": -1e12},
    "zero FLOP/s": {"flops_per_s": 0.0},
    "NaN FLOP/s": {"flops_per_s": NAN},
    "infinite FLOPs per token": {"flops_per_token": INF},
    "FLOP/s as text": {"flops_per_s": "1e12"},
    "FLOP/s as true": {"flops_per_s": True},
    "FLOP/s of 1e300": {"flops_per_s": 1e300},
    "negative tokens/s": {"tokens_per_s": -5.0},
    "zero threads": {"threads": 0},
    "threads as a float": {"threads": 2.5},
    "negative peak": {"peak_flops": -1.0},
    "world size 0": {"world_size": 0},
    "world size 10^12": {"world_size": 10**12},
    "unknown kind": {"kind": "tpu"},
    "checkpointing as 1": {"activation_checkpointing": 1},
    "model as a list": {"model": [1, 2]},
    "model with a nested value": {"model": {**MODEL, "params": {"x": 1}}},
    "empty fingerprint": {"fingerprint": ""},
    "fingerprint as a number": {"fingerprint": 7},
    "a megabyte of method": {"method": "x" * 2**20},
    "time NaN": {"time": NAN},
    "negative time": {"time": -1.0},
}
BAD_MEASUREMENT = {
    "negative measured bytes": {"measured_tensor_bytes": -1},
    "measured bytes as text": {"measured_tensor_bytes": "120"},
    "measured bytes as a float": {"measured_tensor_bytes": 120.5},
    "measured bytes of 2^70": {"measured_tensor_bytes": 2**70},
    "negative estimate": {"estimate_tensor_bytes": -5},
    "process peak negative": {"process_peak_bytes": -600},
    "process peak as true": {"process_peak_bytes": True},
    "runtime negative": {"runtime_bytes": -(2**50)},
    "unknown kind": {"kind": "tpu_bytes"},
    "phases as a list": {"measured_phases": [1, 2]},
    "a phase negative": {"measured_phases": {"backward": -1}},
    "key without shape": {"key": {"model": MODEL}},
    "key as text": {"key": "k"},
    "fingerprint as null": {"fingerprint": None},
    "time infinite": {"time": INF},
}
MISSING_SPEED = ["fingerprint", "kind", "model", "flops_per_s", "tokens_per_s"]
MISSING_MEASUREMENT = ["fingerprint", "key", "measured_tensor_bytes", "kind"]


def _write(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc), encoding="utf-8")  # json writes NaN as the file might


def _without(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != name}


SPEED_CASES = {
    **{k: _speed(**v) for k, v in BAD_SPEED.items()},
    **{f"{n} missing": _without(_speed(), n) for n in MISSING_SPEED},
    "not an object": ["a", "list"],
    "null": None,
}
MEASUREMENT_CASES = {
    **{k: _measurement(**v) for k, v in BAD_MEASUREMENT.items()},
    **{f"{n} missing": _without(_measurement(), n) for n in MISSING_MEASUREMENT},
    "not an object": 42,
}


@pytest.mark.parametrize("bad", list(SPEED_CASES))
def test_a_bad_speed_record_is_left_out_and_dropped_at_the_next_write(
    tmp_path: Path, bad: str
) -> None:
    path = tmp_path / "speed.json"
    good = [_speed(time=1.0), _speed(time=2.0, flops_per_s=2e12)]
    _write(path, {"version": 1, "records": [good[0], SPEED_CASES[bad], good[1]]})
    store = SpeedStore(path)
    assert [r.time for r in store.records] == [1.0, 2.0]
    assert store.problem and store.problem.startswith(f"{path}: 1 of 3 records left out")
    rate = store.rate_for(CPU_FP, "cpu", MODEL, "full", False, threads=2)
    assert rate.source == "calibrated" and rate.flops_per_thread == pytest.approx(0.75e12)
    store.save()
    again = SpeedStore(path)
    assert again.problem is None and again.records == store.records
    assert len(json.loads(path.read_text())["records"]) == 2


@pytest.mark.parametrize("bad", list(MEASUREMENT_CASES))
def test_a_bad_measurement_is_left_out_and_dropped_at_the_next_write(
    tmp_path: Path, bad: str
) -> None:
    path = tmp_path / "calibration.json"
    good = _measurement(time=3.0)
    _write(path, {"version": 1, "measurements": [MEASUREMENT_CASES[bad], good]})
    store = CalibrationStore(path)
    assert [m.time for m in store.measurements] == [3.0]
    assert store.problem and store.problem.startswith(f"{path}: 1 of 2 measurements left out")
    cal = store.for_hardware(CPU_FP, assumed_overhead("cpu"))
    assert cal.overhead is not None and cal.overhead.runtime_bytes >= 0
    store.save()
    again = CalibrationStore(path)
    assert again.problem is None and again.measurements == store.measurements


def _damage(path: Path, how: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "devzero":
        path.symlink_to("/dev/zero")
    elif how == "huge":
        with open(path, "wb") as fh:
            fh.truncate(MAX_FILE_BYTES + 1)
    elif how == "folder":
        path.mkdir()
    else:
        path.write_bytes(FILE_DAMAGE[how])


FILE_DAMAGE = {
    "truncated": b'{"version": 1, "records": [{"fingerprint": "cpu',
    "not UTF-8": b'{"version": 1, "records": []}\xff\xfe',
    "nested 100,000 deep": b'{"records": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a 5,000-digit integer": b'{"version": ' + b"9" * 5000 + b', "records": []}',
    "records not a list": b'{"version": 1, "records": {"a": 1}, "measurements": 3}',
    "a JSON string": b'"records"',
}


@pytest.mark.parametrize("how", [*FILE_DAMAGE, "fifo", "devzero", "huge", "folder"])
@pytest.mark.parametrize("store_kind", ["speed", "memory"])
def test_a_damaged_or_hostile_calibration_file_reads_as_empty_and_is_replaced(
    tmp_path: Path, how: str, store_kind: str
) -> None:
    path = tmp_path / "store.json"
    _damage(path, how)
    t0 = time.monotonic()
    store = SpeedStore(path) if store_kind == "speed" else CalibrationStore(path)
    assert time.monotonic() - t0 < 10  # a FIFO or /dev/zero is never waited on nor read out
    items = store.records if isinstance(store, SpeedStore) else store.measurements
    assert items == [] and store.problem and store.problem.startswith(f"{path}: unreadable")
    if how == "folder":
        return  # a folder at the path: nothing replaces it (the write's error is the caller's)
    if isinstance(store, SpeedStore):
        store.add(SpeedRecord.from_json(_speed()))
    else:
        store.add(Measurement.from_json(_measurement()))
    store.save()
    assert path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600
    again = SpeedStore(path) if store_kind == "speed" else CalibrationStore(path)
    assert again.problem is None
    assert [p.name for p in tmp_path.iterdir()] == ["store.json"]  # no temporary file left


def test_a_plan_beside_a_negative_flops_record_predicts_positive_speed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The issue's case: a record with negative FLOP/s made every plan predict negative
    tokens/s; it is left out and the plan is priced by the good record of the machine."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    write_cached_gloo(socket.gethostname(), torch_version(),
                      {"bytes_per_s": 5e8, "latency_s": 1e-3})  # fmt: skip
    preset = preset_from_dict({
        "model": {"path": str(QWEN)}, "data": {"path": "d", "seq_len": 256},
        "train": {"method": "full", "distribution": "ddp", "micro_batch": 1, "grad_accum": 1},
    })  # fmt: skip
    first = make_plan(preset, "cpu:1:8GiB", fetch=False).plan
    fp = first.calibration.fingerprint if first.calibration else None
    assert fp
    model = {k: first.spec.summary().get(k) for k in MODEL_KEYS}  # as record_speed keeps it
    good = _speed(fingerprint=fp, model=model, threads=1, flops_per_s=2e10, time=5.0)
    bad = {**good, "flops_per_s": -2e10, "time": 6.0}  # newer: it would be chosen
    _write(SpeedStore().path, {"version": 1, "records": [good, bad]})
    predicted = make_plan(preset, "cpu:1:8GiB", fetch=False).plan.chosen.predicted
    assert predicted is not None
    assert predicted.tokens_per_s > 0 and math.isfinite(predicted.tokens_per_s)
    assert predicted.assumptions["achieved_factor"]["source"] == "calibrated"


@pytest.mark.parametrize(
    "doc",
    [{"bytes_per_s": -5.0}, {"bytes_per_s": 0}, {"bytes_per_s": "fast"}, {"bytes_per_s": NAN},
     {"bytes_per_s": 1e300}, {"bytes_per_s": 5e8, "latency_s": -1.0},
     {"bytes_per_s": 5e8, "latency_s": "x"}, {"bytes_per_s": 5e8, "latency_s": INF}, [5e8]],
)  # fmt: skip
def test_a_bad_gloo_measurement_is_no_measurement(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, doc: Any
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = write_cached_gloo("h", "1", {"bytes_per_s": 5e8, "latency_s": 1e-3})
    assert read_cached_gloo("h", "1") == {"bytes_per_s": 5e8, "latency_s": 1e-3}
    path.write_text(json.dumps(doc), encoding="utf-8")
    assert read_cached_gloo("h", "1") is None


@pytest.mark.parametrize("how", [*FILE_DAMAGE, "fifo", "devzero", "huge"])
def test_a_damaged_or_hostile_gloo_cache_is_no_measurement(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = write_cached_gloo("h", "1", {"bytes_per_s": 5e8})
    path.unlink()
    _damage(path, how)
    assert read_cached_gloo("h", "1") is None
    write_cached_gloo("h", "1", {"bytes_per_s": 5e8})  # replaces it
    assert read_cached_gloo("h", "1") == {"bytes_per_s": 5e8}


@pytest.mark.parametrize("how", ["fifo", "devzero", "huge", "folder"])
def test_the_shared_reader_reads_regular_files_of_bounded_size_only(
    tmp_path: Path, how: str
) -> None:
    path = tmp_path / "f"
    _damage(path, how)
    with pytest.raises(safe_files.FileRefused) as err:
        safe_files.read_regular(path, MAX_FILE_BYTES)
    assert str(err.value).startswith(f"{path}: ")
    assert isinstance(err.value, OSError) and err.value.filename == str(path)


def test_the_shared_reader_reads_to_its_bound_and_follows_a_link_to_a_file(
    tmp_path: Path,
) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"x" * 100)
    link = tmp_path / "link"
    link.symlink_to(target)
    assert safe_files.read_regular(link, 100) == b"x" * 100
    with pytest.raises(safe_files.FileRefused, match="over the limit of 99"):
        safe_files.read_regular(target, 99)
    with pytest.raises(FileNotFoundError):
        safe_files.read_regular(tmp_path / "missing", 100)


@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_the_shared_writer_is_not_led_by_what_sits_at_its_temporary_name(
    tmp_path: Path, planted: str
) -> None:
    path = tmp_path / "speed.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    if planted == "fifo":
        os.mkfifo(tmp)  # an open for writing would wait for a reader forever
    else:
        tmp.symlink_to(victim)  # a write through it would land in another file
    private_write.write_private(path, b'{"records": []}\n')
    assert path.read_bytes() == b'{"records": []}\n' and path.stat().st_mode & 0o777 == 0o600
    assert victim.read_text() == "keep" and not tmp.exists() and not tmp.is_symlink()


@pytest.mark.parametrize(
    ("text", "says"),
    [("[" * 100_000, "nested too deeply"), ('{"a":' * 100_000, "nested too deeply"),
     ("9" * 5000, "an integer of 5000 digits"), ("[-" + "1" * 5000 + "]", "5000 digits"),
     ('{"a": NaN}', "NaN is not a JSON number"), ("[1,", "Expecting value, column 4"),
     ('"abc', "Unterminated string")],
)  # fmt: skip
def test_parse_names_what_is_wrong_without_a_traceback(text: str, says: str) -> None:
    with pytest.raises(safe_files.BadJson) as err:
        safe_files.parse(text, constants=False)
    assert says in err.value.reason
    assert safe_files.parse('{"a": NaN}')["a"] != 0  # read as a float where allowed
    assert safe_files.parse("-" + "9" * 4300) == -int("9" * 4300)


EXAMPLES = [Example([5, 6, 7], [6, 7, -100]), Example([8, 9], [-100, 9])]
KTO = [PairExample([1, 2], [3, 4], [], "f:1", 1), PairExample([1], [5], [], "f:2", 0)]


def _arrow(path: Path, columns: dict[str, Any], meta: dict[str, str], digest: bool = True) -> None:
    """An Arrow IPC file of ``columns`` (pyarrow arrays) with ``meta``, its digest made to
    match (``digest``) so that a check other than the checksum must catch it."""
    import pyarrow as pa

    table = pa.table(columns)
    if digest:
        meta = {**meta, "digest": token_cache._digest(table, tuple(columns))}
    table = table.replace_schema_metadata(meta)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _token_damage(path: Path, how: str) -> None:
    import pyarrow as pa

    ints, meta = pa.list_(pa.int32()), {"format": "text", "count": "2", "pad_id": "0"}
    ids = pa.array([[5, 6, 7], [8, 9]], type=ints)
    labels = pa.array([[6, 7, -100], [-100, 9]], type=ints)
    cols = {"input_ids": ids, "labels": labels}
    if how == "int64 columns":
        cols = {k: v.cast(pa.list_(pa.int64())) for k, v in cols.items()}
    elif how == "a null token":
        cols["input_ids"] = pa.array([[5, None, 7], [8, 9]], type=ints)
    elif how == "a null sample":
        cols["labels"] = pa.array([[6, 7, -100], None], type=ints)
    elif how == "labels shorter than ids":
        cols["labels"] = pa.array([[6, 7], [-100, 9]], type=ints)
    elif how == "a negative token id":
        cols["input_ids"] = pa.array([[5, -6, 7], [8, 9]], type=ints)
    elif how == "a label of -5":
        cols["labels"] = pa.array([[6, 7, -5], [-100, 9]], type=ints)
    elif how == "labels missing":
        cols = {"input_ids": ids}
    elif how == "count wrong":
        meta["count"] = "3"
    elif how == "unknown format":
        meta["format"] = "pickle"
    elif how == "padding id not a number":
        meta["pad_id"] = "zero"
    elif how == "padding id of 10^30":
        meta["pad_id"] = str(10**30)
    elif how == "a negative padding id":
        meta["pad_id"] = "-5"
    elif how == "padding id a superscript digit":
        meta["pad_id"] = "\u00b2"
    elif how == "a token edited, old checksum":
        _arrow(path, cols, meta)
        digest = pa.ipc.open_file(str(path)).schema.metadata[b"digest"].decode()
        edited = pa.array([[5, 6, 99], [8, 9]], type=ints)
        _arrow(path, {**cols, "input_ids": edited}, {**meta, "digest": digest}, digest=False)
        return
    elif how == "no checksum":
        _arrow(path, cols, meta, digest=False)
        return
    elif how in ("fifo", "devzero", "folder"):
        _damage(path, how)
        return
    elif how in ("truncated", "empty", "garbage"):
        _arrow(path, cols, meta)
        whole = path.read_bytes()
        path.write_bytes({"truncated": whole[: len(whole) // 2], "empty": b"",
                          "garbage": b"ARROW1" + b"\xff" * 200}[how])  # fmt: skip
        return
    _arrow(path, cols, meta)


TOKEN_DAMAGE = [
    "int64 columns", "a null token", "a null sample", "labels shorter than ids",
    "a negative token id", "a label of -5", "labels missing", "count wrong", "unknown format",
    "padding id not a number", "padding id of 10^30", "a negative padding id",
    "padding id a superscript digit", "a token edited, old checksum",
    "no checksum", "truncated", "empty", "garbage", "fifo", "devzero", "folder",
]  # fmt: skip


@pytest.mark.parametrize("how", TOKEN_DAMAGE)
def test_a_damaged_token_cache_entry_is_no_entry_and_is_written_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = token_cache.write("k", EXAMPLES, "text", "x", pad_id=0)
    good = token_cache.read("k")
    assert good is not None and good.examples == EXAMPLES  # the entry as written reads back
    path = folder / token_cache.FILE
    path.unlink()
    _token_damage(path, how)
    t0 = time.monotonic()
    assert token_cache.read("k") is None
    assert time.monotonic() - t0 < 10  # never waits on a FIFO nor reads /dev/zero out
    if how == "folder":
        return
    token_cache.write("k", EXAMPLES, "text", "x", pad_id=0)  # the preflight's rebuild
    again = token_cache.read("k")
    assert again is not None and again.examples == EXAMPLES and again.pad_id == 0


@pytest.mark.parametrize("how", ["a desirable of 7", "a pair's -1 in a KTO entry", "an edit"])
def test_a_damaged_kto_entry_is_no_entry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    import pyarrow as pa

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = token_cache.write_pairs("k", KTO, "kto", "x", pad_id=0)
    good = token_cache.read_pairs("k")
    assert good is not None and good.pairs == KTO
    path = folder / token_cache.PAIRS_FILE
    table = pa.ipc.open_file(str(path)).read_all()
    cols = {n: table.column(n).combine_chunks() for n in token_cache.PAIR_COLUMNS}
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    value = {"a desirable of 7": 7, "a pair's -1 in a KTO entry": -1, "an edit": 0}[how]
    cols["desirable"] = pa.array([value, 0], type=pa.int8())
    _arrow(path, cols, meta, digest=how != "an edit")  # an edit keeps the old checksum
    assert token_cache.read_pairs("k") is None


def test_a_damaged_uses_file_keeps_its_good_lines(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = token_cache.write("k", EXAMPLES, "text", "x", pad_id=0)
    token_cache.note_use(folder, "built")
    with open(folder / token_cache.USES, "ab") as fh:
        fh.write(b"[" * 100_000 + b"\n" + b"9" * 5000 + b"\n\xff\xfe\n[1]\n{torn\n")
    token_cache.note_use(folder, "hit")
    assert [u["use"] for u in token_cache.uses(folder)] == ["built", "hit"]
    (folder / token_cache.USES).unlink()
    os.mkfifo(folder / token_cache.USES)
    assert token_cache.uses(folder) == []


@pytest.mark.parametrize("tokens_per_s", [NAN, INF, -1.0, 0.0])
def test_a_speed_that_is_not_finite_and_positive_is_never_recorded(
    tmp_path: Path, tokens_per_s: float
) -> None:
    doc = {"calibration": {"fingerprint": CPU_FP}, "method": "full", "distribution": "ddp",
           "hardware": {"kind": "cpu"}, "model": MODEL, "training": {"world_size": 1},
           "predicted": {"flops_per_token": 1e9, "assumptions": {"threads_per_process": 1}}}  # fmt: skip
    path = tmp_path / "speed.json"
    assert record_speed(doc, tokens_per_s=tokens_per_s, path=path) is None
    assert not path.exists()
    assert record_speed(doc, tokens_per_s=100.0, path=path) == path
    assert SpeedStore(path).records[0].flops_per_s == pytest.approx(1e11)
