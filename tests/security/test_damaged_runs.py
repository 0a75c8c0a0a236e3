"""Damaged run folders and index: each command says what is wrong with that run, the others work.

Every kind of damage, through the CLI: a corrupt, empty or missing spec.json, a garbage event
line, a non-UTF-8 byte in the per-user index, a duplicate id in the index, a runs folder that
cannot be written (read-only, a file, a full disk at run creation). For the damaged run:
``error:`` + ``hint:``, exit 2, no traceback; for every other run: listed and readable. The runs
folder, not the index, is the truth for what exists: a folder without spec.json is "damaged",
never "gone"; a half-made run is never left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from homelab_dp.cli import main
from homelab_dp.runs.folder.run_index import index_path, register

from ..conftest import DATA, ROOT

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker

COMPLETED = DATA / "bad_input" / "runs" / "completed-run"


def _runs() -> Path:
    root = Path(os.environ["HOMELAB_DP_RUNS"])
    root.mkdir(parents=True, exist_ok=True)
    return root


def _copy(name: str, root: Path | None = None) -> Path:
    run = (root or _runs()) / name
    shutil.copytree(COMPLETED, run)
    for file in ("spec.json", "state.json"):
        doc = json.loads((run / file).read_text(encoding="utf-8"))
        doc["run_id"] = name
        (run / file).write_text(json.dumps(doc), encoding="utf-8")
    return run


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return rc, out.out, out.err


def _refused(capsys, needle: str, *argv: str) -> str:
    rc, out, err = _cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 2, (rc, out, err)
    assert lines[0].startswith("error: ") and needle in lines[0], lines
    assert lines[-1].startswith("hint: ") and len(lines[-1]) > 16, lines
    return lines[0]


def _listed(capsys) -> dict[str, dict]:
    rc, out, _ = _cli(capsys, "runs", "--json")
    assert rc == 0
    return {row["run_id"]: row for row in json.loads(out)}


DAMAGE = {
    "corrupt spec.json": ("spec.json", b'{"version": 1, "run_id": '),
    "empty spec.json": ("spec.json", b""),
    "spec.json that is no run spec": ("spec.json", b'["a", "list"]'),
    "spec.json not UTF-8": ("spec.json", b'{"run_id": "\xff"}'),
    "missing spec.json": ("spec.json", None),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_spec_is_an_error_for_that_run_only(kind: str, capsys) -> None:
    good = _copy("good-run")
    bad = _copy("bad-run")
    name, content = DAMAGE[kind]
    if content is None:
        (bad / name).unlink()
    else:
        (bad / name).write_bytes(content)
    for cmd in (["status", "bad-run"], ["status", "bad-run", "--json"], ["attach", "bad-run"],
                ["resume", "bad-run", "--detach"], ["status", str(bad)]):  # fmt: skip
        line = _refused(capsys, "bad-run", *cmd)
        assert "spec.json" in line and "gone" not in line, line
    rc, out, err = _cli(capsys, "stop", "bad-run")  # nothing running: said so, for that run
    assert rc == 2 and "bad-run" in err
    rows = _listed(capsys)
    assert rows["good-run"]["status"] == "completed" and rows["good-run"]["exists"] is True
    assert rows["bad-run"]["exists"] is True and rows["bad-run"]["status"] == "damaged"
    assert "spec.json" in rows["bad-run"]["reason"]
    rc, out, _ = _cli(capsys, "runs")
    assert rc == 0
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    assert "damaged" in lines["bad-run"] and "completed" in lines["good-run"]
    assert "gone" not in lines["bad-run"]
    assert _cli(capsys, "status", "good-run")[0] == 0
    assert good.is_dir() and bad.is_dir()  # nothing deleted


@pytest.mark.parametrize(
    "garbage",
    [b"garbage\xff{{\n", b'{"type": "step", "step": "many", "loss": "low"}\n', b"[1, 2]\n",
     b'{"type": "end", "time": "later", "reason": 7, "final_loss": {}}\n', b"\x00" * 40 + b"\n"],
)  # fmt: skip
def test_a_garbage_event_line_is_skipped(garbage: bytes, capsys) -> None:
    run = _copy("noisy-run")
    with open(run / "events.jsonl", "ab") as fh:
        fh.write(garbage)
        fh.write(b'{"type": "checkpoint", "time": 1795900058.0, "step": 40}\n')
    rc, out, _ = _cli(capsys, "status", "noisy-run", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["status"] == "completed" and doc["last_checkpoint_step"] == 40
    assert _listed(capsys)["noisy-run"]["status"] == "completed"
    assert _cli(capsys, "status", "noisy-run")[0] == 0


@pytest.mark.parametrize("content", [b"[]", b'"running"', b"{\xff}", b""])
def test_a_damaged_state_json_reads_as_unknown(content: bytes, capsys) -> None:
    run = _copy("stateless-run")
    (run / "state.json").write_bytes(content)
    rc, out, _ = _cli(capsys, "status", "stateless-run", "--json")
    assert rc == 0 and json.loads(out)["run_id"] == "stateless-run"
    assert "stateless-run" in _listed(capsys)


def test_a_non_utf8_byte_in_the_index_skips_that_line_only(tmp_path: Path, capsys) -> None:
    elsewhere = _copy("elsewhere-run", tmp_path)
    register(elsewhere)
    _copy("here-run")
    with open(index_path(), "ab") as fh:
        fh.write(b'{"id": "bad\xff", "path": "/tmp/\xfe\xff", "created": 1}\n\xff\xfe\n')
    register(_copy("later-run", tmp_path))
    rows = _listed(capsys)
    assert {"elsewhere-run", "here-run", "later-run"} <= set(rows), rows
    assert _cli(capsys, "status", "elsewhere-run")[0] == 0
    assert _cli(capsys, "runs")[0] == 0
    rc, out, _ = _cli(capsys, "runs", "--forget-gone")
    assert rc == 0
    assert _cli(capsys, "status", "later-run")[0] == 0


def test_a_duplicate_id_in_the_index_never_opens_another_run(tmp_path: Path, capsys) -> None:
    mine = _copy("twin-run")
    other = _copy("twin-run", tmp_path / "other-root")  # the same id in another runs folder
    register(other)
    stranger = _copy("stranger-run", tmp_path)
    with open(index_path(), "a", encoding="utf-8") as fh:  # an index line naming another folder
        fh.write(json.dumps({"id": "mine-run", "path": str(stranger), "created": 2}) + "\n")
    rc, out, _ = _cli(capsys, "status", "twin-run", "--json")
    assert rc == 0 and json.loads(out)["path"] == str(mine.resolve())  # this runs folder's
    _refused(capsys, "mine-run", "status", "mine-run")  # never the folder the line names
    rows = _listed(capsys)
    assert "mine-run" not in rows and "stranger-run" in rows


def _refuses_root(folder: Path) -> bool:
    try:
        (folder / ".homelab-dp-probe").mkdir()
    except OSError:
        return folder.is_dir()
    (folder / ".homelab-dp-probe").rmdir()
    return False


def test_a_run_folder_that_cannot_be_made_leaves_nothing(tmp_path: Path, in_repo, capsys) -> None:
    file = tmp_path / "a-file"
    file.write_text("", encoding="utf-8")
    _refused(capsys, str(file), "run", "tiny-demo", "--detach", "--runs", str(file))
    _refused(capsys, "a-file", "run", "tiny-demo", "--detach", "--runs", str(file / "runs"))
    assert file.read_text(encoding="utf-8") == ""
    if os.geteuid() != 0:
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o500)
    elif _refuses_root(Path("/sys/kernel")):  # sysfs: no new folder, even for root
        read_only = Path("/sys/kernel")
    else:  # root on a writable /sys: no folder refuses root here
        pytest.skip("no read-only folder for root")
    before = sorted(p.name for p in read_only.iterdir())
    _refused(capsys, str(read_only), "run", "tiny-demo", "--detach", "--runs", str(read_only))
    assert sorted(p.name for p in read_only.iterdir()) == before


def test_a_full_disk_at_run_creation_leaves_no_half_made_folder(tmp_path: Path) -> None:
    """A file-size limit (RLIMIT_FSIZE) makes every write past 400 bytes fail as a full disk
    would: the run's creation fails with an error and leaves no folder, hidden or not."""
    runs = tmp_path / "runs"
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "from homelab_dp.cli.main import main\n"
        "from homelab_dp.app.runs import make_controller\n"
        "c = make_controller()\n"
        "p = c.prepare('tiny-demo')\n"  # the preflight (and its token cache) before the limit
        "resource.setrlimit(resource.RLIMIT_FSIZE, (400, 400))\n"
        "sys.exit(main(['run', 'tiny-demo', '--detach']))\n"
    )
    env = {**os.environ, "HOMELAB_DP_RUNS": str(runs)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and str(runs) in lines[0], lines
    assert "File too large" in lines[0] or "space" in lines[0], lines
    assert lines[-1].startswith("hint: "), lines
    assert list(runs.iterdir()) == [], list(runs.iterdir())  # hidden half-made folders too
