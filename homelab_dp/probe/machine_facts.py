"""What `homelab-dp doctor` looks at, gathered from this machine: torch, bitsandbytes, the disk of
the runs folder, /dev/shm and the open-file limit (the probe gives the GPUs).

torch and bitsandbytes are asked in a child process (`python -m homelab_dp.probe.machine_facts`):
asking initialises CUDA, and a CUDA context in the TUI or the CLI — processes that stay up while
a run trains — would hold memory on every card. The child prints one JSON document; the parent
reads it into `TorchFacts` and `BnbFacts`. Nothing here imports torch at module level.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from homelab_dp import json_safe
from homelab_dp.probe.hardware import HardwareReport

ASK_TIMEOUT_S = 120.0
"""How long the child that asks torch and bitsandbytes may take (importing them takes seconds)."""


@dataclass(frozen=True)
class TorchDevice:
    """One card as torch sees it."""

    name: str
    memory_total: int
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class TorchFacts:
    """What the installed torch says about CUDA."""

    version: str | None
    """torch.__version__, or None when torch cannot be imported."""
    cuda: str | None = None
    """torch.version.cuda: the CUDA the build was made for; None for a CPU-only build."""
    hip: str | None = None
    """torch.version.hip: set for a ROCm build (which cannot drive NVIDIA cards)."""
    cuda_available: bool = False
    devices: tuple[TorchDevice, ...] = ()
    nccl: bool = False
    """torch.distributed.is_nccl_available()."""
    error: str | None = None
    """Why torch could not be imported, or what CUDA said when it would not start."""
    visible_devices: str | None = None
    """CUDA_VISIBLE_DEVICES when torch was asked: torch sees only the cards it names, numbered
    in CUDA's order (the probe reads the same variable in PCI bus order)."""


@dataclass(frozen=True)
class BnbFacts:
    """Whether bitsandbytes imports and has loaded its CUDA kernels."""

    version: str | None
    """The installed version, or None when it is not installed."""
    imported: bool = False
    cuda_kernels: bool = False
    error: str | None = None


@dataclass(frozen=True)
class DiskFacts:
    path: str
    """The runs folder (measured at the nearest folder above it that exists)."""
    free: int
    total: int


@dataclass(frozen=True)
class Facts:
    """Everything the checks look at."""

    report: HardwareReport
    torch: TorchFacts
    bnb: BnbFacts
    disk: DiskFacts | None = None
    shm_bytes: int | None = None
    """Size of /dev/shm; None where there is none."""
    nofile: tuple[int, int] | None = None
    """RLIMIT_NOFILE (soft, hard); -1 is unlimited; None where it cannot be read."""
    kernels: frozenset[str] = frozenset()
    """The fast CUDA kernels of linear-attention and state-space layers installed, by module
    (fla, mamba_ssm, causal_conv1d; `planning.memory.layer_kinds.KERNELS`)."""


def _ask_torch() -> TorchFacts:
    """Ask the installed torch about CUDA, in this process (the child's side)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        import torch
    except Exception as exc:  # not installed, or a broken install (missing .so, ABI)
        return TorchFacts(None, error=f"{type(exc).__name__}: {exc}", visible_devices=visible)
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    nccl = False
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        nccl = bool(dist.is_available() and dist.is_nccl_available())
    available, devices, error = False, (), None
    if cuda:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                available = torch.cuda.is_available()
                if available:
                    props = [
                        torch.cuda.get_device_properties(i)
                        for i in range(torch.cuda.device_count())
                    ]
                    devices = tuple(
                        TorchDevice(p.name, int(p.total_memory), (p.major, p.minor)) for p in props
                    )
            except Exception as exc:  # CUDA refused to start: the driver, a lost card
                available, error = False, f"{type(exc).__name__}: {exc}"
        if not available and error is None and caught:
            error = " ".join(str(caught[-1].message).split())
    return TorchFacts(
        torch.__version__,
        cuda=cuda,
        hip=hip,
        cuda_available=available,
        devices=devices,
        nccl=nccl,
        error=error,
        visible_devices=visible,
    )


def _ask_bnb(want_cuda: bool) -> BnbFacts:
    """Import bitsandbytes (quietly: it prints about missing optional kernels) and see whether
    its CUDA library loaded (``want_cuda``: a GPU machine, where it should have)."""
    from importlib import metadata

    try:
        version = metadata.version("bitsandbytes")
    except metadata.PackageNotFoundError:
        return BnbFacts(None)
    noise = io.StringIO()
    try:
        with (
            contextlib.redirect_stdout(noise),
            contextlib.redirect_stderr(noise),
            warnings.catch_warnings(),  # its imports warn about torch APIs it still uses
        ):
            warnings.simplefilter("ignore")
            from bitsandbytes import cextension
    except Exception as exc:
        return BnbFacts(version, error=f"{type(exc).__name__}: {exc}")
    lib = getattr(cextension, "lib", None)
    # The library object answers any attribute, so read what it holds, not what it makes up
    held = vars(lib) if lib is not None and hasattr(lib, "__dict__") else {}
    loaded = bool(getattr(type(lib), "compiled_with_cuda", False)) and "error_msg" not in held
    error = None
    if want_cuda and not loaded:
        error = str(held.get("error_msg") or "").strip().splitlines()
        error = error[0] if error else "bitsandbytes loaded its CPU library only"
    return BnbFacts(version, imported=True, cuda_kernels=loaded, error=error)


def disk_facts(path: Path) -> DiskFacts | None:
    """Free space where ``path`` is (or will be: the nearest folder above it that exists)."""
    path = path.absolute()
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError:
        return None
    return DiskFacts(str(path), usage.free, usage.total)


def shm_bytes(path: str = "/dev/shm") -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def nofile_limit() -> tuple[int, int] | None:
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    return (-1 if soft == unlimited else soft, -1 if hard == unlimited else hard)


ANSWER_FRESH_S = 30.0
"""An answer of the child this recent serves again (`gather` asks torch and bitsandbytes one
after the other; the TUI's refresh a minute later asks anew)."""
_last_answer: tuple[float, tuple[TorchFacts, BnbFacts]] | None = None


def _ask_child() -> tuple[TorchFacts, BnbFacts]:
    """Ask torch and bitsandbytes in one child process (its answer reused for a few seconds)."""
    global _last_answer
    if _last_answer is not None and time.monotonic() - _last_answer[0] < ANSWER_FRESH_S:
        return _last_answer[1]
    cmd = [sys.executable, "-m", "homelab_dp.probe.machine_facts"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=ASK_TIMEOUT_S, check=True)
        doc = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        why = f"asking torch in a child process failed: {type(exc).__name__}: {exc}"
        return TorchFacts(None, error=why), BnbFacts(None, error=why)
    answer = _torch_from_json(doc["torch"]), BnbFacts(**doc["bnb"])
    _last_answer = (time.monotonic(), answer)
    return answer


def _torch_from_json(doc: dict[str, Any]) -> TorchFacts:
    devices = tuple(
        TorchDevice(
            d["name"], int(d["memory_total"]), tuple(d["capability"]) if d["capability"] else None
        )  # type: ignore[arg-type]
        for d in doc.pop("devices")
    )
    return TorchFacts(**doc, devices=devices)


def torch_facts() -> TorchFacts:
    """What the installed torch says about CUDA, asked in a child process.

    The one place torch is asked: tests replace this function to stand for another torch.
    """
    return _ask_child()[0]


def bnb_facts(want_cuda: bool) -> BnbFacts:
    """Whether bitsandbytes imports and (``want_cuda``: a GPU machine) loaded its CUDA kernels.

    The child always says why the CUDA kernels did not load; without a GPU that is no error."""
    facts = _ask_child()[1]
    return facts if want_cuda or not facts.imported else replace(facts, error=None)


def main() -> int:
    """The child: print torch's and bitsandbytes' facts as one JSON line."""
    doc = {"torch": asdict(_ask_torch()), "bnb": asdict(_ask_bnb(want_cuda=True))}
    print(json_safe.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
