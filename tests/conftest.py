"""Shared test fixtures and helpers: the repository root, recorded hardware, small presets."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from homelab_dp.cli import main

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from the repository root, with runs and user presets in temporary folders."""
    monkeypatch.chdir(ROOT)
    return ROOT


_SESSION_HOME: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Private data, config and runs folders for the whole session too: module- and
    session-scoped fixtures run before `_private_dirs`, and a run they start must not land in
    the user's run index (``$XDG_DATA_HOME/homelab-dp/index.jsonl``) or runs folder."""
    import tempfile

    home = tempfile.mkdtemp(prefix="homelab-dp-tests-")
    _SESSION_HOME.append(home)
    for var, sub in (("XDG_DATA_HOME", "data"), ("XDG_CONFIG_HOME", "config"),
                     ("XDG_CACHE_HOME", "cache"), ("HOMELAB_DP_RUNS", "runs")):  # fmt: skip
        os.environ[var] = os.path.join(home, sub)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything but the unit tests, the tests marked ``beside`` and the modules that name
    their own group is one xdist group (`--dist loadgroup` in pyproject): the integration
    tests' runs, servers and TUI sessions take one worker, one at a time, in order. A module
    of runs whose claims are their results (no timing, no server) names the group
    ``results`` (``pytestmark``): the other worker takes it first, then, like the first
    worker once its group is done, whatever unit and ``beside`` tests are left."""
    unit = Path(__file__).parent / "unit"
    for item in items:
        if unit in item.path.parents or item.get_closest_marker("beside"):
            continue
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("one-at-a-time"))


def _lock_file(name: str) -> Any:
    """A lock file every worker of this session (xdist's run id) opens: in the temp folder."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"pid{os.getpid()}")
    return open(os.path.join(tempfile.gettempdir(), f"homelab-dp-tests-{run}.{name}"), "a")  # noqa: SIM115


@contextlib.contextmanager
def _machine_share(alone: bool) -> Iterator[None]:
    """Every test holds a shared lock on the machine; a test marked ``alone`` (one that times
    real runs against a prediction) holds it exclusively, so nothing else of the session runs
    beside it. The turnstile, held by a waiting ``alone`` test, stops new shared holders from
    starving it."""
    with _lock_file("turnstile") as turnstile, _lock_file("machine") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: no timeout runs while it waits
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Each test's setup, call and teardown (module fixtures' runs included) under its share
    of the machine (`_machine_share`)."""
    with _machine_share(item.get_closest_marker("alone") is not None):
        yield


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    for home in _SESSION_HOME:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(autouse=True)
def _private_dirs(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Never touch the user's real runs folder, saved presets or memory calibration, and see
    every recorded GPU (a CUDA_VISIBLE_DEVICES of the machine running the tests would hide some).
    The token cache is the session's (`pytest_configure`): shared by every test, as a user's is
    by every run, so a run's preflight after the first reads it instead of importing
    transformers to tokenize; a test that counts the cache's uses sets its own XDG_CACHE_HOME."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg")))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
    monkeypatch.setenv("HOMELAB_DP_RUNS", str(tmp_path_factory.mktemp("runs")))
    monkeypatch.delenv("HOMELAB_DP_PRESETS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def default_sigint() -> None:
    """``preexec_fn`` for a child a test sends Ctrl-C (SIGINT): the default disposition, so
    Python turns it into KeyboardInterrupt. A test session started in the background of a
    non-interactive shell (``cmd &``) has SIGINT ignored, and children inherit that."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def write_preset(
    folder: Path,
    name: str,
    model: Path,
    data: Path,
    *,
    seq_len: int = 32,
    pack: bool = False,
    nproc: int = 2,
    **train: Any,
) -> Path:
    """``folder/name.toml``: a small preset for ``nproc`` CPU processes on a local model and data.

    [train] is a full DDP fine-tune, micro-batch 2 × accumulation 2, lr 1e-3, with any other
    [train] key given as a keyword (``max_steps=8``, ``watchdog_s=4``, ...). The first line is the
    command that runs it, as in every shipped preset.
    """
    doc = {
        "model": {"path": str(model)},
        "data": {"path": str(data), "seq_len": seq_len, "pack": pack},
        "train": {
            "method": "full",
            "distribution": "ddp",
            "micro_batch": 2,
            "grad_accum": 2,
            "lr": 1e-3,
            **train,
        },
        "hardware": {"devices": "cpu", "nproc": nproc},
    }
    path = folder / f"{name}.toml"
    path.write_text(f"# homelab-dp run {path}\n" + tomli_w.dumps(doc), encoding="utf-8")
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``homelab-dp ARGV`` in this process: (exit code, stdout, stderr); argparse's own errors
    (SystemExit) give their exit code too."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = int(exc.code)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The folder of a tiny random model of a 2026 family by ``model_type``
    (`tests.tiny_hybrids`), built on first use, once per session."""
    from tests.tiny_hybrids import build_tiny

    built: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = build_tiny(model_type, tmp_path_factory.mktemp(model_type))
        return built[model_type]

    return get
