"""The token cache across runs: a Parquet data set with data.columns is tokenized once, by the
first run's preflight; its ranks and every process of a second run read the cache.

Measured, not assumed: every process that uses a cache entry notes ``built`` (it tokenized) or
``hit`` (it read the file) in the entry's ``uses.jsonl`` (`homelab_dp.data.token_cache`), and
the cache file is the very same file (inode and modification time) after the second run; each
rank's log line says ``data: token cache hit (train)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tomli_w

from homelab_dp.data import token_cache
from tests.integration.conftest import DEMO_DATA, events, run_detached

pytestmark = pytest.mark.slow


def test_a_second_run_tokenizes_nowhere(tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the workers inherit it
    rows = [json.loads(x) for x in DEMO_DATA.read_text(encoding="utf-8").splitlines()[:48]]
    table = [
        {"question": r["instruction"], "context": r["input"], "answer": r["output"]} for r in rows
    ]
    data = tmp_path / "qa.parquet"
    pq.write_table(pa.Table.from_pylist(table), data)
    doc = {
        "model": {"path": str(tiny_model)},
        "data": {"path": str(data), "seq_len": 64, "pack": True,
                 "columns": {"instruction": "question", "input": "context", "output": "answer"}},
        "train": {"method": "full", "distribution": "ddp", "micro_batch": 2, "grad_accum": 1,
                  "max_steps": 2, "lr": 1e-3},
        "hardware": {"devices": "cpu", "nproc": 2},
    }  # fmt: skip
    preset = tmp_path / "cached.toml"
    preset.write_text(tomli_w.dumps(doc), encoding="utf-8")

    def one_run() -> Path:  # the preflight runs in this process
        return run_detached(str(preset), guard_s=300)  # ~15 s on an idle 2-core machine

    first = one_run()
    (entry,) = token_cache.cache_root().iterdir()
    stored = (entry / token_cache.FILE).stat()
    uses = token_cache.uses(entry)
    ranks = events(first, "start")[0]["pids"]
    # The preflight (this process) tokenized; both ranks read what it wrote.
    assert uses[0] == {**uses[0], "use": "built", "pid": os.getpid()}
    assert sorted((u["pid"], u["use"]) for u in uses[1:]) == sorted((p, "hit") for p in ranks)

    second = one_run()
    again = token_cache.uses(entry)[len(uses) :]
    ranks = events(second, "start")[0]["pids"]
    assert [u["use"] for u in again] == ["hit"] * 3  # the preflight and both ranks
    assert {u["pid"] for u in again} == {os.getpid(), *ranks}
    after = (entry / token_cache.FILE).stat()
    assert (after.st_ino, after.st_mtime_ns) == (stored.st_ino, stored.st_mtime_ns)
    assert [p.name for p in token_cache.cache_root().iterdir()] == [entry.name]
    for run_dir in (first, second):  # each rank's log says so too
        log = "".join(f.read_text(encoding="utf-8") for f in (run_dir / "logs").glob("*.log"))
        assert log.count("data: token cache hit (train)") == 2, log[-3000:]
        assert "data: token cache built" not in log
    start = [events(r, "start")[0] for r in (first, second)]
    assert start[0]["samples"] == start[1]["samples"] > 0
    # The format "auto" resolved to (the columns make it instruction) is recorded for what
    # serves the result: chat and serve prompt it the way it learned.
    from homelab_dp.runs.model_ref import resolve_model
    from homelab_dp.serving.replica.prompt_templates import trained_format

    assert start[0]["data_format"] == "instruction"
    assert trained_format(resolve_model(str(second))) == "instruction"
