"""Resumable checkpoints with ``torch.distributed.checkpoint`` (DCP), stored as safetensors.

Also writes the run's result (`save_result`). Layout of ``checkpoints/step-N/``::

    shard-0000R-model-00001-of-00001.safetensors   DCP shards, one per rank (trainable weights and
                                                   optimizer state, keyed by parameter name)
    rng-rank-R.json                                each rank's torch / CUDA / python RNG state
    trainer.json                                   step, epoch, offset, tokens, scheduler state
    COMPLETE                                       JSON {step, world_size, time, files}, last

``checkpoints/BEST`` (``train.keep_best``, `mark_best`): JSON {step, loss, path} naming the
checkpoint of the lowest eval loss; rotation keeps it beside the ``keep_checkpoints`` newest.

A checkpoint is written into ``checkpoints/.tmp-step-N/`` and renamed to ``step-N`` only after its
marker is on disk, so a folder named ``step-N`` is complete unless damaged afterwards. The marker
lists every shard with its size; `check_checkpoint` (in `checkpoint_check`) verifies them, the
shards' DCP metadata and ``trainer.json`` before a resume trusts a checkpoint, and resume falls
back to the newest usable one, naming each file it skipped. A failed write (disk full, I/O
error) removes its temporary folder and fails the run with `CheckpointError`, older checkpoints
untouched; a damaged ``step-N`` is moved aside (``damaged-step-N-…``) before it is rewritten.

Nothing is pickled: DCP's safetensors storage (``HuggingFaceStorageWriter/Reader``) keeps its metadata as JSON
inside each file, and the rest is JSON. Shards are keyed by parameter names and global offsets, so
a checkpoint written by N ranks loads on M ranks (DDP and FSDP2; zero1 as well, its optimizer
state being saved per parameter).

Which checkpoint may a resume trust? Checks that read files only — no torch, nothing unpickled.

A checkpoint folder ``checkpoints/step-N/`` is usable when its ``COMPLETE`` marker reads back,
``trainer.json`` reads back, every shard the marker lists is there with the size it had when it
was written, and every shard is a whole safetensors file whose header carries DCP's sharding
metadata for each of its tensors. The safetensors header is parsed by hand (8-byte length, then
JSON), so a damaged file is named without loading a tensor; pickle files are never opened.

`find_usable` walks the ``step-N`` folders newest first and says why it skipped each one, so the
worker can tell the user which file was wrong and which checkpoint it fell back to. Temporary
``.tmp-step-N`` folders (a write that never finished) are never candidates.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from homelab_dp.errors import HomelabError
from homelab_dp.runs.folder.heartbeats import MERGING
from homelab_dp.runs.folder.run_folder import write_json_atomic
from homelab_dp.train.loop.rank_guard import inject_slow_result, inject_write_fault
from homelab_dp.train.model.trainable_model import merge_adapter, save_adapter, save_full_model
from homelab_dp.train.parallelism.strategy import Strategy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MARKER = "COMPLETE"
DCP_METADATA_KEY = "DCP_SHARDING_INFO"  # torch's key for the shard offsets in each header
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".distcp", ".metadata")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``step-N`` folders under ``root``, newest first."""
    found = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def read_marker(path: Path) -> dict[str, Any] | None:
    """The completion marker of a checkpoint folder, or None when missing or unreadable."""
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and "step" in marker else None


def is_complete(path: Path) -> bool:
    """True when the folder holds a readable completion marker."""
    return read_marker(path) is not None


def shard_files(path: Path) -> dict[str, int]:
    """``{file name: size}`` of the safetensors shards in a folder (what the marker records)."""
    return {p.name: p.stat().st_size for p in sorted(path.glob("*.safetensors"))}


def check_shard(shard: Path) -> str | None:
    """Why a safetensors shard is unusable (truncated, bad header, no DCP metadata), or None."""
    try:
        size = shard.stat().st_size
        with open(shard, "rb") as fh:
            length = int.from_bytes(fh.read(8), "little")
            if size < 8 or not 0 < length <= min(_MAX_HEADER, size - 8):
                return (
                    f"{shard}: truncated or not a safetensors file "
                    f"(header length {length}, file {size} bytes)"
                )
            header = json.loads(fh.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"{shard}: unreadable safetensors header ({exc})"
    if not isinstance(header, dict):
        return f"{shard}: the safetensors header is not a JSON object"
    meta = header.pop("__metadata__", None) or {}
    ends = [t.get("data_offsets", [0, 0])[1] for t in header.values() if isinstance(t, dict)]
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return f"{shard}: truncated ({size} bytes, its header describes {expected})"
    try:
        sharding = json.loads(meta[DCP_METADATA_KEY])
    except (KeyError, TypeError, ValueError):
        return f"{shard}: missing its checkpoint metadata ({DCP_METADATA_KEY} in the header)"
    missing = [k for k in header if k not in sharding]
    if missing:
        return f"{shard}: no checkpoint metadata for {len(missing)} tensors (e.g. {missing[0]})"
    return None


def check_checkpoint(path: Path) -> str | None:
    """Why the checkpoint cannot be used (naming the file), or None when every check passes."""
    marker = read_marker(path)
    if marker is None:
        return f"{path / MARKER}: missing or unreadable completion marker"
    try:
        trainer = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{path / 'trainer.json'}: missing (the checkpoint's step and schedule)"
    except (OSError, ValueError) as exc:
        return f"{path / 'trainer.json'}: unreadable ({exc})"
    if not isinstance(trainer, dict) or "step" not in trainer:
        return f"{path / 'trainer.json'}: no step recorded"
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        return f"{path / pickles[0]}: a pickle file in a checkpoint; refused, never loaded"
    found = shard_files(path)
    listed = marker.get("files")
    if not isinstance(listed, dict):  # written before the marker listed its shards
        listed = found
    missing = sorted(set(listed) - set(found))
    if missing:
        return f"{path / missing[0]}: missing (the completion marker lists it)"
    if not found:
        return f"{path}: no safetensors shards"
    for name in found:  # the most specific message first: truncated, no metadata
        problem = check_shard(path / name)
        if problem:
            return problem
    for name, size in sorted(listed.items()):
        if found[name] != size:
            return f"{path / name}: changed since it was written ({found[name]} bytes, was {size})"
    extra = sorted(set(found) - set(listed))
    return f"{path / extra[0]}: not part of the checkpoint as written" if extra else None


def find_usable(root: Path) -> tuple[Path | None, list[str]]:
    """(the newest usable checkpoint under ``root`` or None, why each newer one was skipped)."""
    skipped = []
    for _, path in step_dirs(root):
        problem = check_checkpoint(path)
        if problem is None:
            return path, skipped
        skipped.append(f"skipped checkpoint {path.name}: {problem}")
    return None, skipped


log = logging.getLogger(__name__)

# Only trainable weights are saved: LoRA/QLoRA checkpoints hold the adapters, not the frozen base.
_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _is_zero(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazy state with one zero-gradient, zero-lr step.

    Loading fills existing state tensors in place, so a fresh optimizer needs them first. With lr 0
    and zero gradients, AdamW, SGD and 8-bit AdamW leave every weight bitwise unchanged.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None


def _zero_state(strategy: Strategy, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """This rank's ZeRO-1 shard of optimizer state, keyed by parameter name (world-size free)."""
    names = {id(p): n for n, p in strategy.inner.named_parameters()}
    local = optimizer.optim
    _init_state(local)
    return {
        names[id(p)]: local.state[p]
        for group in local.param_groups
        for p in group["params"]
        if p in local.state
    }


def _tensorize(state: Any) -> Any:
    """Plain numbers (e.g. bitsandbytes' integer ``step``) become 0-d tensors for safetensors.

    Nested dicts (bitsandbytes' ``__bnb_optimizer_quant_state__``) keep their nesting.
    """
    if isinstance(state, dict):
        return {k: _tensorize(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return state
    if isinstance(state, (bool, int, float)):
        return torch.tensor(state)
    raise TypeError(f"optimizer state holds a {type(state).__name__}; only tensors and numbers")


def _untensorize(original: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Write loaded values back into ``original`` where it held plain numbers."""
    for k, v in original.items():
        if isinstance(v, dict):
            _untensorize(v, loaded[k])
        elif not isinstance(v, torch.Tensor):
            original[k] = type(v)(loaded[k].item())


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _collect(
    strategy: Strategy, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the DCP state: tensors only, the optimizer state dict in the shape ``set_*`` expects).

    The tensors are the live ones (no copies), so ``dcp.load`` fills model and optimizer in place.
    """
    model_sd = _without_quant_state(
        strategy, get_model_state_dict(strategy.model, options=_OPTIONS)
    )
    if _is_zero(optimizer):
        optim_sd: dict[str, Any] = {"state": _zero_state(strategy, optimizer)}
    else:
        optim_sd = get_optimizer_state_dict(strategy.model, optimizer, options=_OPTIONS)
    state = {"model": _dedup_storage(model_sd), "optim": _tensorize(optim_sd["state"])}
    return state, optim_sd


def _without_quant_state(strategy: Strategy, sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` without the entries a parameter adds beside itself: bitsandbytes' 4-bit layers
    save their quantization state (``weight.absmax``, ``weight.quant_map``, ``weight.nested_*``,
    ``weight.quant_state.*``) even when ``ignore_frozen_params`` drops the frozen weight. It is
    rebuilt from the base model at every start (resume quantizes the base again), so a QLoRA
    checkpoint keeps only the adapters. A key that names no such extra is kept."""
    params = {n for n, _ in strategy.inner.named_parameters()}
    named = params | {n for n, _ in strategy.inner.named_buffers()}

    def extra(key: str) -> bool:
        if key in named:
            return False
        parts = key.split(".")
        return any(".".join(parts[:i]) in params for i in range(1, len(parts)))

    return {k: v for k, v in sd.items() if not extra(k)}


def _dedup_storage(sd: dict[str, Any]) -> dict[str, Any]:
    """safetensors refuses tensors sharing memory (tied weights): give repeats their own copy."""
    seen: set[int] = set()
    out = {}
    for k, v in sd.items():
        local = v.to_local() if hasattr(v, "to_local") else v
        ptr = local.untyped_storage().data_ptr() if local.numel() else -1
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


class CheckpointError(HomelabError):
    """A checkpoint that cannot be written (disk full, I/O error) or loaded: the run fails."""

    exit_code = 1


_WRITE_FAILURE = re.compile(
    r"os error (28|27|122|5|30)\b|no space left|file too large|quota exceeded|"
    r"read-only file system|input/output error",
    re.I,
)
"""What a failed write says when a library wraps the OSError (safetensors' Rust writer:
"Error while serializing: I/O error: No space left on device (os error 28)")."""


_WRITE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EIO)


def is_write_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a file write that failed (a full disk, a quota, a file-size limit, a
    read-only or failing disk), as an OSError or wrapped by the library that wrote."""
    if isinstance(exc, OSError):
        return exc.errno in _WRITE_ERRNOS
    return bool(_WRITE_FAILURE.search(str(exc)[:2000]))


def _write_reason(exc: BaseException) -> str:
    code = exc.errno if isinstance(exc, OSError) else None
    text = str(exc)[:2000].lower()
    if code == errno.ENOSPC or "os error 28" in text or "no space left" in text:
        return "no space left on device"
    if code == errno.EFBIG or "os error 27" in text or "file too large" in text:
        return "file too large (a file-size limit)"
    if code == errno.EDQUOT or "os error 122" in text or "quota exceeded" in text:
        return "disk quota exceeded"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[-1][:200] if first else 'write failed'}"


def result_write_error(
    exc: BaseException, run_dir: Path, where: Path, step: int
) -> CheckpointError:
    """The result (``final/``, its merge) could not be written: where, why, what is kept, and
    what to do; the raw library error (safetensors' "Error while serializing") is not it."""
    return CheckpointError(
        f"the result: writing {where} failed ({_write_reason(exc)}); training finished at step "
        f"{step} and its checkpoints are kept; no final/ was written",
        hint=f"free space on the disk of {run_dir} (df -h), then `homelab-dp resume "
        f"{run_dir.name}`: it continues from its newest checkpoint and writes final/",
    )


class _GuardedWriter(HuggingFaceStorageWriter):
    """DCP's safetensors writer with the test-only write faults of `homelab_dp.train.loop.rank_guard`."""

    def __init__(self, path: Path, run_dir: Path, step: int) -> None:
        super().__init__(str(path), save_distributed=True)
        self._where = (run_dir, dist.get_rank(), step)

    def write_data(self, plan: Any, planner: Any) -> Any:
        inject_write_fault(*self._where, after_shard=False)
        written = super().write_data(plan, planner)
        written.wait()  # the shard is on disk (the thread-count-1 writer writes synchronously)
        inject_write_fault(*self._where, after_shard=True)
        return written


def save_checkpoint(
    root: Path,
    step: int,
    strategy: Strategy,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    """Write ``root/step-<step>`` (a collective: every rank calls it). Returns its path.

    Raises `CheckpointError` (on every rank whose write failed, and on every rank for a failure
    inside DCP's collective save) with the temporary folder removed and older checkpoints kept.
    """
    final = root / f"step-{step}"
    if final.exists():
        damaged = check_checkpoint(final)
        if damaged is None:  # e.g. stopped again right after resuming from this very step
            dist.barrier()
            return final
        dist.barrier()  # every rank has looked before the damaged folder is moved aside
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and final.exists():
            aside = root / f"damaged-{final.name}-{int(time.time())}"
            final.rename(aside)
            log.warning("%s; moved to %s and written again", damaged, aside)
    tmp = root / f".tmp-step-{step}"
    try:
        _write(root, tmp, final, step, strategy, optimizer, trainer_state, keep)
    except (OSError, CheckpointException) as exc:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs back
        raise _write_error(exc, root, step, tmp) from None
    return final


def _write(
    root: Path, tmp: Path, final: Path, step: int, strategy: Strategy, optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any], keep: int,
) -> None:  # fmt: skip
    rank, world = dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one per node: leftovers of a crash
        for stale in root.glob(".tmp-step-*"):
            if stale != tmp:
                shutil.rmtree(stale, ignore_errors=True)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    tmp.mkdir(parents=True, exist_ok=True)  # nodes without a shared run folder need their own
    state, _ = _collect(strategy, optimizer)
    dcp.save(state, storage_writer=_GuardedWriter(tmp, root.parent, step))
    write_json_atomic(tmp / f"rng-rank-{rank}.json", _rng_state())
    dist.barrier()
    if rank == 0:
        write_json_atomic(tmp / "trainer.json", trainer_state)
        files = shard_files(tmp)  # the marker lists every shard: resume checks each one
        marker = {"step": step, "world_size": world, "time": time.time(), "files": files}
        write_json_atomic(tmp / MARKER, marker)
        _fsync_dir(tmp)
        tmp.rename(final)
        _fsync_dir(root)
        _rotate(root, keep)
    dist.barrier()


def _write_error(exc: BaseException, root: Path, step: int, tmp: Path) -> CheckpointError:
    """One clear message for a failed write: what failed, where, and what was kept."""
    cause: BaseException = exc
    if isinstance(exc, CheckpointException):  # DCP gathers every rank's failure
        rank, (cause, _) = next(iter(sorted(exc.failures.items())))
        where = f"rank {rank}"
    else:
        where = f"rank {dist.get_rank()}"
    kept = [p.name for _, p in step_dirs(root) if is_complete(p)]
    previous = f"the previous checkpoint {kept[0]} is kept" if kept else "no earlier checkpoint"
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        return CheckpointError(
            f"checkpoint step-{step}: no space left on device writing {tmp} ({where}); {previous}",
            hint=f"free space on the disk of {root} (df -h), then `homelab-dp resume` the run",
        )
    return CheckpointError(
        f"checkpoint step-{step}: writing {tmp} failed ({where}: {type(cause).__name__}: "
        f"{cause}); {previous}",
        hint=f"check that {root} is writable and its disk healthy, then `homelab-dp resume`",
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rotate(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` usable checkpoints and the one `BEST` names; drop older ones
    and stale temporaries."""
    usable = [p for _, p in step_dirs(root) if check_checkpoint(p) is None]
    best = read_best(root)
    for old in usable[keep:]:
        if best is None or old.name != best.get("path"):
            shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(".tmp-step-*"):
        shutil.rmtree(tmp, ignore_errors=True)


BEST = "BEST"
"""``checkpoints/BEST``: which checkpoint holds the lowest eval loss (``train.keep_best``)."""


def read_best(root: Path) -> dict[str, Any] | None:
    """``checkpoints/BEST`` as written by `mark_best` ({step, loss, path}), or None."""
    try:
        best = json.loads((root / BEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return best if isinstance(best, dict) else None


def mark_best(root: Path, step: int, loss: float, keep: int) -> Path:
    """Name ``step-<step>`` (written already) the best checkpoint, then rotate: the previous
    best goes unless it is among the ``keep`` newest. Rank 0 only (as rotation is)."""
    path = root / f"step-{step}"
    write_json_atomic(root / BEST, {"step": step, "loss": loss, "path": path.name})
    _rotate(root, keep)
    return path


def _flat_keys(prefix: str, value: Any) -> list[str]:
    """DCP's flattened keys of one nested state entry (``optim.<name>.step``, ...)."""
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in _flat_keys(f"{prefix}.{key}", v)]
    return [prefix]


def _keep_saved_state(state: dict[str, Any], optim_sd: dict[str, Any], saved: set[str]) -> None:
    """Leave out of the load the optimizer state of parameters the checkpoint holds none for.

    A trainable parameter that never gets a gradient (ERNIE 4.5's router
    ``e_score_correction_bias``, which the forward uses outside autograd) never gets AdamW state
    in a real step, so the checkpoint has none, while `_init_state` gave the fresh optimizer one:
    DCP refused the checkpoint as missing keys. Such a parameter loads with no state, as it was
    saved (the optimizer skips it as before: it still has no gradient). An entry the checkpoint
    holds only part of stays, and DCP names what is missing."""
    for name, entry in list(state["optim"].items()):
        if not any(k in saved for k in _flat_keys(f"optim.{name}", entry)):
            del state["optim"][name]
            optim_sd["state"].pop(name, None)


def load_checkpoint(
    path: Path, strategy: Strategy, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load weights, optimizer state and this rank's RNG from ``path``; returns trainer.json.

    A collective: every rank calls it. The scheduler is restored by the caller from the step.
    """
    rank = dist.get_rank()
    state, optim_sd = _collect(strategy, optimizer)
    reader = HuggingFaceStorageReader(str(path))
    _keep_saved_state(state, optim_sd, set(reader.read_metadata().state_dict_metadata))
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as exc:  # a BaseException: would escape the worker's handlers
        rank, (cause, _) = next(iter(sorted(exc.failures.items())))
        raise CheckpointError(
            f"{path}: cannot be loaded (rank {rank}: {type(cause).__name__}: {cause})",
            hint=f"move {path.name} out of {path.parent}; resume then uses the one before it",
        ) from None
    set_model_state_dict(strategy.model, state["model"], options=_OPTIONS)
    _untensorize(optim_sd["state"], state["optim"])
    if not _is_zero(optimizer):  # ZeRO's shard was filled in place by dcp.load
        set_optimizer_state_dict(strategy.model, optimizer, optim_sd, options=_OPTIONS)
    rng = path / f"rng-rank-{rank}.json"
    if rng.is_file():
        _set_rng_state(json.loads(rng.read_text(encoding="utf-8")))
    else:
        log.warning("%s has no RNG state for rank %d; keeping this rank's seeded RNG", path, rank)
    return json.loads((path / "trainer.json").read_text(encoding="utf-8"))


def save_result(
    run_dir: Path,
    strategy: Strategy,
    is_peft: bool,
    tokenizer: PreTrainedTokenizerBase,
    preset: Any,
    *,
    step: int = 0,
    on_rank0: Callable[[Callable[[Callable[[str], None]], None]], Any] | None = None,
) -> Path:
    """Write ``run_dir/final``: an HF model folder, or a peft adapter (+ ``final/merged``).

    A collective for FSDP2 (the shards are gathered onto rank 0's CPU); rank 0 writes into
    ``.final-tmp`` and renames it, so ``final/`` is never half written. ``on_rank0(work)`` (a
    `RankGuard.on_rank0`, called on every rank) runs the writing on rank 0 while every rank
    keeps beating and waits in short collectives, however long the save and the merge take;
    without it rank 0 writes and the other ranks return at once. ``step`` is the run's last
    step (heartbeats, the test-only ``slow-result`` fault).
    """

    out, tmp = run_dir / "final", run_dir / ".final-tmp"
    state_dict = None
    if strategy.is_fsdp:
        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=is_peft
        )
        state_dict = get_model_state_dict(strategy.model, options=options)

    def write(set_phase: Callable[[str], None]) -> None:  # rank 0 only
        inject_slow_result(run_dir, 0, step)
        shutil.rmtree(tmp, ignore_errors=True)
        save = save_adapter if is_peft else save_full_model
        target = tmp
        try:
            save(strategy.inner, state_dict, tokenizer, tmp)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
            if is_peft and preset.train.merge:
                set_phase(MERGING)
                target = out / "merged"
                merge_adapter(preset, out, tokenizer, target)
        except Exception as exc:
            if not is_write_failure(exc):
                raise
            shutil.rmtree(target, ignore_errors=True)  # a half-written folder is no result
            raise result_write_error(exc, run_dir, target, step) from None

    if on_rank0 is not None:
        on_rank0(write)
    elif dist.get_rank() == 0:
        write(lambda phase: None)
    return out
