"""A data record has a size limit: one huge line is an error naming file:line, found in bounded
memory, before anything starts (a 100 MB record used to grow the preflight past 6 GB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from homelab_dp.data.reading import MAX_RECORD_BYTES
from homelab_dp.data.samples import read_with_lines
from homelab_dp.errors import DataError

from ..conftest import ROOT

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker

BIG = 30 * 2**20  # over the limit, and fast to write


def _jsonl(path: Path, big_at: int, size: int = BIG) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(1, 5):
            text = "x" * size if i == big_at else f"record {i} is a short one"
            fh.write(json.dumps({"text": text}) + "\n")
    return path


def test_a_huge_json_line_is_refused_naming_its_line(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "big.jsonl", big_at=3)
    with pytest.raises(DataError) as err:
        read_with_lines(data, "auto")
    assert err.value.message.startswith(f"{data}:3: the record is over ")
    assert str(MAX_RECORD_BYTES // 2**20) in err.value.message
    assert "split" in err.value.hint


def test_a_huge_paragraph_is_refused_too(tmp_path: Path) -> None:
    data = tmp_path / "big.txt"
    line = "word " * 200 + "\n"  # a paragraph of many ordinary lines
    data.write_text("a first paragraph\n\n" + line * (MAX_RECORD_BYTES // len(line) + 10))
    with pytest.raises(DataError) as err:
        read_with_lines(data, "auto")
    assert err.value.message.startswith(f"{data}:3: the record is over ")


def test_records_at_the_limit_are_read(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "fine.jsonl", big_at=2, size=MAX_RECORD_BYTES - 100)
    records, lines, fmt = read_with_lines(data, "auto")
    assert (len(records), lines, fmt) == (4, [1, 2, 3, 4], "text")


def test_the_cli_refuses_it_in_bounded_memory_before_anything_starts(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "big.jsonl", big_at=2)
    runs = tmp_path / "runs"
    code = (
        "import resource, sys\n"
        "from homelab_dp.cli.main import main\n"
        f"rc = main(['run', 'tiny-demo', '--detach', '--set', 'data.path={data}'])\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "HOMELAB_DP_RUNS": str(runs)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"error: {data}:2: the record is over"), lines
    assert lines[-1].startswith("hint: ")
    peak = int(proc.stdout.strip().splitlines()[-1])
    # The scan holds one line at most (the limit), never the 30 MB record nor the file whole.
    assert peak < 1.5 * 2**30, f"peak {peak / 2**20:.0f} MiB"
    assert not runs.exists() or list(runs.iterdir()) == []
