"""The reference model's log-probabilities (DPO, KTO): adapters off, precomputed, or a copy.

``train.reference`` (auto → adapters for LoRA/QLoRA, precompute for a full fine-tune):

- **adapters**: the policy's own base with its adapters disabled (`peft`'s ``disable_adapter``),
  a no-grad forward per micro-batch; no second copy of anything.
- **precompute**: one data-parallel no-grad pass over every block before step 1 (rank r takes
  blocks r, r + W, ...; each rank the same number of forwards, FSDP2's gathers pair up), the
  rows summed into every rank's table by one all-reduce (the rows are disjoint: exact), and
  cached as safetensors beside the token cache (``$XDG_CACHE_HOME/homelab-dp/references/``),
  keyed by the model's config and weight files, the tokens of the blocks, the dtype, device
  and attention kernel (`reference_key`). It runs before a resumed run loads its checkpoint,
  so it is always the starting model's; a resumed run, or a second run on the same model and
  data, reads the file. No copy is held while training. The file is not trusted
  (`cached_tables`): only a regular file of the size its tables need is read, and it is used
  only when it holds exactly the tables expected (names, float64, ``[blocks, 2 · max pairs]``),
  finite log-probabilities (at most 0) exactly where a block has sequences and NaN elsewhere,
  the key it was made for, and the sha256 of its tables as written; anything else (a torn,
  edited, narrower or foreign file, a FIFO or a device at its path) is computed again and
  rewritten, with a warning naming the reason.
- **copy**: a frozen copy of the starting model on every device (full fine-tune, not FSDP2).

The reference forward runs in eval mode (no dropout): the reference log-probabilities are a
function of the data alone, whatever the split, so the loss stays exact across ranks.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from homelab_dp import safe_files
from homelab_dp.errors import HomelabError
from homelab_dp.train.evaluation.eval_loss import rank_batches
from homelab_dp.train.objectives.pair_batch import PairBatch, PairData, batch_of, forward_logps
from homelab_dp.user_files.paths import cache_home
from homelab_dp.user_files.private_write import write_private

log = logging.getLogger("homelab_dp.worker")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class AdapterReference:
    """The policy with its adapters disabled (LoRA/QLoRA)."""

    kind = "adapters"

    def logps(self, model: Any, pairs: PairData, batch: PairBatch) -> torch.Tensor:
        """The reference log-probability of every sequence of ``batch`` (no grad)."""
        inner = model.strategy.inner  # no DDP wrapper: no buffer broadcast, no reducer
        with torch.no_grad(), _eval_mode(inner), model.loaded.model.disable_adapter():
            logps, _ = forward_logps(inner, batch, autocast=model.autocast,
                                     dtype=model.loss_dtype)  # fmt: skip
        return logps


class PrecomputedReference:
    """Looked up in `PairData.ref_logps` (filled by `prepare_precomputed`)."""

    kind = "precompute"

    def logps(self, model: Any, pairs: PairData, batch: PairBatch) -> torch.Tensor:
        """The precomputed log-probabilities of ``batch``'s sequences, in its order."""
        assert pairs.ref_logps is not None, "the reference pass has not run"
        n = pairs.n_pairs[batch.idx].tolist()
        rows = pairs.ref_logps[batch.idx]
        flat = torch.cat([rows[i, : 2 * k] for i, k in enumerate(n)])
        return flat.to(device=batch.input_ids.device, dtype=model.loss_dtype)


class CopyReference:
    """A frozen copy of the starting model, held on this device."""

    kind = "copy"

    def __init__(self, module: Any) -> None:
        self.module = module

    def logps(self, model: Any, pairs: PairData, batch: PairBatch) -> torch.Tensor:
        """The copy's log-probability of every sequence of ``batch`` (no grad)."""
        with torch.no_grad():
            logps, _ = forward_logps(self.module, batch, autocast=model.autocast,
                                     dtype=model.loss_dtype)  # fmt: skip
        return logps


class _eval_mode:  # noqa: N801 (a context manager used like a function)
    """Eval mode inside, the module's own mode restored after."""

    def __init__(self, module: Any) -> None:
        self.module, self.was = module, module.training

    def __enter__(self) -> None:
        self.module.eval()

    def __exit__(self, *exc: object) -> None:
        self.module.train(self.was)


def build_reference(kind: str | None, model: Any, rank: Any, distribution: str) -> Any:
    """The reference object of ``kind`` (None: no reference). ``copy`` copies the model now:
    call it before a resume loads the checkpoint."""
    if kind is None:
        return None
    if kind == "adapters":
        return AdapterReference()
    if kind == "precompute":
        return PrecomputedReference()
    if model.reference_copy is None:
        raise HomelabError(
            f"train.reference = 'copy' is not supported with {distribution} (a sharded model)",
            hint="set train.reference = 'precompute'",
        )
    return CopyReference(model.reference_copy)


def frozen_copy(module: Any) -> Any:
    """A frozen copy of ``module`` in eval mode (the ``copy`` reference), made before the
    strategy wraps it."""
    frozen = copy.deepcopy(module)
    frozen.requires_grad_(False)
    frozen.eval()
    return frozen


def model_identity(model_path: str) -> dict[str, Any]:
    """The model folder's config.json and its weight files (name, size, modification time):
    what a changed model changes, without reading gigabytes of weights."""
    folder = Path(model_path)
    config = folder / "config.json"
    files = []
    if folder.is_dir():
        for p in sorted(folder.iterdir()):
            if p.suffix in WEIGHT_SUFFIXES and p.is_file():
                st = p.stat()
                files.append([p.name, st.st_size, st.st_mtime_ns])
    return {
        "config": config.read_text(encoding="utf-8") if config.is_file() else "",
        "weights": files,
    }


def data_digest(pairs: PairData | None) -> str:
    """sha256 of the blocks' tokens, targets, positions, masks and sequence ids (None: "")."""
    if pairs is None:
        return ""
    h = hashlib.sha256()
    for t in (pairs.input_ids, pairs.labels, pairs.positions, pairs.mask, pairs.sequence,
              pairs.n_pairs):  # fmt: skip
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    h.update(b"packed" if pairs.packed else b"padded")
    return h.hexdigest()


def reference_key(
    model_path: str, train: PairData, eval_: PairData | None, *, objective: str, dtype: str,
    device: str, attention: str, method: str,
) -> str:  # fmt: skip
    """The cache key of a precomputed reference (see the module docstring)."""
    doc = {
        "version": 1, "model": model_identity(model_path), "train": data_digest(train),
        "eval": data_digest(eval_), "objective": objective, "dtype": dtype, "device": device,
        "attention": attention, "method": method,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def reference_path(key: str) -> Path:
    """Where the reference of ``key`` is cached: beside the token cache."""
    return cache_home() / "references" / f"{key}.safetensors"


def compute_table(model: Any, pairs: PairData, rank: Any) -> torch.Tensor:
    """Every block's reference log-probabilities, ``[n_blocks, 2 · max pairs]`` float64 (NaN
    past a block's pairs), by every rank together (a collective: call it on every rank)."""
    dev, inner = rank.device, model.strategy.inner
    table = torch.zeros(pairs.n_blocks, 2 * pairs.max_pairs, dtype=torch.float64, device=dev)
    with torch.no_grad(), _eval_mode(inner):
        for idx in rank_batches(pairs.n_blocks, rank.rank, rank.world, rank.micro):
            # A rank short of blocks still runs a forward (FSDP2's gathers are collectives).
            batch = batch_of(pairs, torch.tensor(idx or [0]), dev, flat=model.flat_batches)
            logps, _ = forward_logps(inner, batch, autocast=model.autocast,
                                     dtype=model.loss_dtype)  # fmt: skip
            at = 0
            for b in idx:
                k = 2 * int(pairs.n_pairs[b])
                table[b, :k] = logps[at : at + k].to(torch.float64)
                at += k
    if rank.world > 1:
        import torch.distributed as dist

        dist.all_reduce(table)  # each row is one rank's, zeros elsewhere: the sum is exact
    table = table.cpu()
    width = torch.arange(table.shape[1])[None, :]
    table[width >= 2 * pairs.n_pairs[:, None]] = float("nan")
    return table


TABLES_VERSION = "1"
"""The layout of a reference file's tables and metadata (in its ``version`` metadata)."""
LOGP_SLACK = 1e-6
"""How far above 0 a stored log-probability may be (rounding) before the file is refused."""


def tables_digest(tables: dict[str, torch.Tensor]) -> str:
    """sha256 of the tables' names, dtypes, shapes and bytes: what a reference file was written
    with (its ``digest`` metadata), so an edit of any value is seen."""
    h = hashlib.sha256()
    for name in sorted(tables):
        t = tables[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _expected(train: PairData, eval_: PairData | None) -> dict[str, PairData]:
    return {"train": train, **({"eval": eval_} if eval_ is not None else {})}


def _header(raw: bytes) -> dict[str, Any]:
    """The JSON header of a safetensors file's bytes (ValueError when there is none)."""
    if len(raw) < 8:
        raise ValueError("shorter than a safetensors header")
    size = int.from_bytes(raw[:8], "little")
    if size > len(raw) - 8:
        raise ValueError(f"its header claims {size} bytes, the file has {len(raw) - 8}")
    header = safe_files.parse(raw[8 : 8 + size], constants=False)
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return header


def table_problem(table: torch.Tensor, pairs: PairData) -> str | None:
    """Why ``table`` is not a reference table of ``pairs`` (dtype, shape, a log-probability
    that is not finite or above 0 where the block has a sequence, a value where it has none),
    or None."""
    shape = (pairs.n_blocks, 2 * pairs.max_pairs)
    if table.dtype != torch.float64:
        return f"dtype {table.dtype}, not float64"
    if tuple(table.shape) != shape:
        return f"shape {tuple(table.shape)}, not {shape}"
    used = torch.arange(shape[1])[None, :] < 2 * pairs.n_pairs[:, None]
    values = table[used]
    if not bool(torch.isfinite(values).all()):
        return "a log-probability that is not finite"
    if values.numel() and float(values.max()) > LOGP_SLACK:
        return f"a log-probability above 0 ({float(values.max()):.3g})"
    if not bool(torch.isnan(table[~used]).all()):
        return "a value past a block's sequences (NaN expected)"
    return None


def cached_tables(
    path: Path, key: str, train: PairData, eval_: PairData | None
) -> tuple[dict[str, torch.Tensor] | None, str]:
    """The tables of the reference file ``path`` when it passes every check (see the module
    docstring), else None; and why not ("" when it is absent)."""
    from safetensors.torch import load

    expected = _expected(train, eval_)
    cells = sum(p.n_blocks * 2 * p.max_pairs for p in expected.values())
    try:
        raw = safe_files.read_regular(path, 8 * cells + 2**20)  # the tables and a header
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, str(exc)
    try:
        meta = _header(raw).get("__metadata__") or {}
        tables = load(raw)
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own kinds): rebuild
        return None, f"not a safetensors file ({str(exc)[:200]})"
    if set(tables) != set(expected):
        return None, f"tables {sorted(tables)}, not {sorted(expected)}"
    if not isinstance(meta, dict) or meta.get("version") != TABLES_VERSION:
        return None, "no version metadata (made by another version)"
    if meta.get("key") != key:
        return None, "made for another key"
    for name, pairs in expected.items():
        problem = table_problem(tables[name], pairs)
        if problem:
            return None, f"table {name!r}: {problem}"
    if meta.get("digest") != tables_digest(tables):
        return None, "its tables do not match their checksum (changed after writing)"
    return tables, ""


def prepare_precomputed(
    model: Any, train: PairData, eval_: PairData | None, rank: Any, key: str
) -> str:
    """Fill ``train.ref_logps`` (and the eval data's) from the cache, or compute and cache
    them; "hit" or "built". Every rank agrees on reading or computing (one all-reduce): a file
    that fails any check (`cached_tables`) is computed again and rewritten."""
    from safetensors.torch import save

    path = reference_path(key)
    tables, problem = cached_tables(path, key, train, eval_)
    if problem:
        log.warning("reference cache %s not used (%s): computing it again", path, problem)
    found = torch.tensor([1 if tables is not None else 0], device=rank.device)
    if rank.world > 1:
        import torch.distributed as dist

        dist.all_reduce(found, op=dist.ReduceOp.MIN)
    if int(found) and tables is not None:
        train.ref_logps = tables["train"]
        if eval_ is not None:
            eval_.ref_logps = tables["eval"]
        return "hit"
    train.ref_logps = compute_table(model, train, rank)
    out = {"train": train.ref_logps}
    if eval_ is not None:
        eval_.ref_logps = out["eval"] = compute_table(model, eval_, rank)
    if rank.rank == 0:
        meta = {"version": TABLES_VERSION, "key": key, "digest": tables_digest(out)}
        try:  # written whole under a temporary name: readers never see half a file
            write_private(path, save(out, metadata=meta))
        except OSError as exc:  # a cache that cannot be written: the run goes on without it
            log.warning("reference cache %s not written (%s)", path, exc)
    return "built"
