"""What a MODEL argument names: a run id, a run folder (its result) or a model folder.

`eval`, `chat` and `serve` take the same MODEL; this module turns it into the folders to load,
without torch: a full model folder (config.json + weights), or a PEFT adapter folder with the
base model it was trained on. A LoRA run whose adapter was merged (`final/merged/`) is served
from the merged folder: the same weights, no adapter arithmetic per token. A QLoRA run's
adapter goes with its base to quantize to NF4 (``quantized``), as it was trained: its
16-bit merge is another model.

A folder whose weights are pickle only (``pytorch_model.bin`` and no safetensors) is refused
here, for every command that takes a MODEL: pickle files can run code when loaded.

Models named by Hugging Face id, resolved once in the front end's process.

A preset's ``model.path`` may also name a run (id, unique prefix or folder): the run's result
is the model to start from (`with_run_model`: SFT, then DPO on its result).

A preset's ``model.path`` and the MODEL argument of `eval`, `chat` and `serve` may be a Hugging
Face id (``Qwen/Qwen2.5-0.5B``, `homelab_dp.hub.hub_models`): planning reads the id's config.json
only; a run, eval, chat or serve needs the whole snapshot (`homelab_dp.hub.hub_models`). What goes
on — the run spec, the eval job, the serving replicas — is the local snapshot folder, so
workers, replicas and resumed runs never touch the Hub. A path that exists always wins.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from homelab_dp.errors import HomelabError, RunNotFoundError
from homelab_dp.hub.hub_models import ModelOrigin, looks_like_hub_id, named, resolve_model_id
from homelab_dp.presets.preset import Preset
from homelab_dp.runs.folder import run_index as index
from homelab_dp.runs.folder.run_folder import read_run_spec, runs_root
from homelab_dp.runs.run_spec import RunSpec


@dataclass(frozen=True)
class ModelRef:
    """A model to load for inference or evaluation."""

    name: str
    """What it is called (the run id, or the folder's name): `/v1/models` lists this."""
    path: Path
    """A full Hugging Face model folder, or a PEFT adapter folder (then ``base`` is set)."""
    base: Path | None = None
    """The base model folder an adapter applies to; None for a full model."""
    run_dir: Path | None = None
    """The run it came from, if any."""
    seq_len: int | None = None
    """The run's training sequence length (eval's default), if it came from a run."""
    data_format: str | None = None
    """The run's preset data format (auto | text | completion | instruction | chat): the
    template it learned to answer in (auto: detect it from ``data_path``)."""
    data_path: Path | None = None
    """The run's training data (to detect an ``auto`` format; it may have gone since)."""
    trust_remote_code: bool = False
    """The run's preset allowed the model folder's own code (never for a bare folder)."""
    dtype: str = "auto"
    """The run's preset dtype (auto | bf16 | fp16 | fp32)."""
    quantized: str = ""
    """``nf4``: the adapter was trained against its base quantized to NF4 (a QLoRA run), and
    eval, chat and serve load that base so where bitsandbytes works; "" for none."""

    @property
    def is_adapter(self) -> bool:
        return self.base is not None

    @property
    def tokenizer_path(self) -> Path:
        """Where the tokenizer is (saved beside every result; the base has one too)."""
        if (self.path / "tokenizer_config.json").exists() or self.base is None:
            return self.path
        return self.base

    @property
    def config_path(self) -> Path:
        """The folder whose config.json describes the architecture."""
        return self.base if self.base is not None else self.path


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files in Python's pickle format: loading one can run code."""


def pickle_only(folder: Path) -> list[str]:
    """The pickle weight files of ``folder`` when it holds no safetensors weights, else []."""
    try:
        if not folder.is_dir() or any(folder.glob("*.safetensors")):
            return []
        return sorted(
            p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file()
        )
    except OSError:  # unreadable: whoever reads it next says why
        return []


def refuse_pickle_only(folder: Path) -> None:
    """A HomelabError naming the pickle file when ``folder`` holds weights in pickle only: the
    safetensors-only rule, for every command that loads, serves or exports a model."""
    pickles = pickle_only(folder)
    if pickles:
        raise HomelabError(
            f"{folder}: only pickle weights ({', '.join(pickles[:3])}); refused, never loaded",
            hint="pickle files can run code when loaded; convert the weights to safetensors "
            "(save_pretrained(..., safe_serialization=True)) on a machine you trust",
        )


def _checked(ref: ModelRef) -> ModelRef:
    """``ref`` once neither its folder nor its base holds pickle weights only."""
    refuse_pickle_only(ref.path)
    if ref.base is not None:
        refuse_pickle_only(ref.base)
    return ref


def _adapter_base(folder: Path, fallback: str | None) -> Path:
    """The base model of an adapter folder, from adapter_config.json (or the run's preset)."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HomelabError(
            f"{folder / 'adapter_config.json'}: unreadable ({exc})",
            hint="the adapter folder is damaged; run the fine-tune again or point at a model folder",
        ) from None
    named = config.get("base_model_name_or_path") or fallback
    for candidate in (named, fallback):
        if candidate and (Path(candidate) / "config.json").is_file():
            return Path(candidate).absolute()
    raise HomelabError(
        f"{folder}: the adapter's base model {named!r} is not a local model folder",
        hint="put the base model at that path, or evaluate a merged model folder instead",
    )


def _folder_ref(folder: Path) -> ModelRef:
    """A model or adapter folder given directly."""
    if (folder / "adapter_config.json").is_file():
        return ModelRef(name=folder.name, path=folder, base=_adapter_base(folder, None))
    if (folder / "config.json").is_file():
        return ModelRef(name=folder.name, path=folder)
    raise HomelabError(
        f"{folder}: not a model folder (no config.json) nor an adapter (no adapter_config.json)",
        hint="give a run id, a run folder, or a Hugging Face model folder",
    )


def _data_format(run_dir: Path, fmt: str) -> str:
    """The run's data format: the preset's, or for ``auto`` what its start event says the
    worker resolved it to (any data source, a Parquet file or a dataset id too)."""
    if fmt != "auto":
        return fmt
    try:
        lines = (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return fmt
    for line in reversed(lines):
        try:
            doc = json.loads(line)
        except ValueError:  # a torn last line
            continue
        if doc.get("type") == "start" and doc.get("data_format"):
            return str(doc["data_format"])
    return fmt


def _run_ref(run_dir: Path) -> ModelRef:
    """A run folder: its result (the merged model where there is one)."""
    spec = read_run_spec(run_dir)
    preset = spec.preset
    final = run_dir / "final"
    common = dict(
        name=run_dir.name,
        run_dir=run_dir,
        seq_len=int(preset.data.seq_len),
        data_format=_data_format(run_dir, str(preset.data.format)),
        data_path=Path(preset.data.path),
        trust_remote_code=bool(preset.model.trust_remote_code),
        dtype=str(preset.model.dtype),
    )
    if not final.is_dir():
        raise HomelabError(
            f"run {run_dir.name} has no result yet (no {final})",
            hint=f"wait for it to complete, or `homelab-dp resume {run_dir.name}`",
        )
    adapter = (final / "adapter_config.json").is_file()
    start = preset.model.adapter
    if adapter and start and not (final / "merged" / "config.json").is_file():
        # Its adapter applies to the base with the earlier run's adapter merged in: the base
        # alone is another model.
        raise HomelabError(
            f"run {run_dir.name} trained adapters on top of {start}; its result is only "
            "whole merged",
            hint="train it with train.merge = true (final/merged), or give the model it "
            "started from",
        )
    if adapter and str(preset.train.method) == "qlora":  # its NF4 base, not a 16-bit merge
        base = _adapter_base(final, preset.model.path)
        return ModelRef(path=final, base=base, quantized="nf4", **common)
    if (final / "merged" / "config.json").is_file():
        return ModelRef(path=final / "merged", **common)
    if adapter:
        return ModelRef(path=final, base=_adapter_base(final, preset.model.path), **common)
    return ModelRef(path=final, **common)


def find_run(ref: str, root: Path | None = None) -> Path | None:
    """The run folder whose id is ``ref`` or starts with it (unique), or the run folder ``ref``
    is the path of, wherever the run lives (`runs.folder.run_index.find_run`: the per-user
    index, ``root``, ./runs); None when no run has that id or path. An ambiguous prefix or a
    run whose folder has gone (by id or by path) raises its HomelabError."""
    if not ref.strip():
        return None
    try:
        return index.find_run(ref, root)
    except index.RunUnknownError:
        return None


def resolve_model(ref: str, root: Path | None = None) -> ModelRef:
    """The model MODEL names: a folder (run, model or adapter), else a run id (or unique prefix)."""
    folder = Path(os.path.expanduser(ref))
    if ref.strip() and _is_dir(folder):  # Path("") is the current folder: never a silent "."
        folder = folder.absolute()
        if (folder / "spec.json").is_file():
            return _checked(_run_ref(folder))
        return _checked(_folder_ref(folder))
    run_dir = find_run(ref, root)
    if run_dir is not None:
        return _checked(_run_ref(run_dir))
    raise HomelabError(
        f"model {ref!r}: no such folder, and no run with that id under {root or runs_root()}",
        hint="give a run id (`homelab-dp runs`), a run folder, a model folder, or a Hugging "
        "Face id (org/name)",
    )


def is_model_id(path: str) -> bool:
    """Whether ``path`` names a Hub model rather than a folder (a path that exists wins)."""
    return looks_like_hub_id(path) and not _exists(Path(os.path.expanduser(path)))


def split_revision(ref: str) -> tuple[str, str]:
    """``org/name@revision`` → (``org/name``, ``revision``); no ``@``: revision ""."""
    head, sep, revision = ref.partition("@")
    if sep and looks_like_hub_id(head) and revision and not Path(ref).exists():
        return head, revision
    return ref, ""


def config_folder(
    path: str, revision: str = "", *, fetch: bool = True, root: Path | None = None
) -> Path:
    """The folder whose config.json describes ``path``: the folder itself, for a run (id,
    unique prefix or folder, under ``root``) its result's (the base of an adapter), or for a
    model id its cached snapshot (config.json downloaded if missing, when ``fetch`` and
    online)."""
    ref = run_result(path, root)
    if ref is not None:
        return ref.config_path
    if not is_model_id(path):
        return Path(path)

    return resolve_model_id(path, revision, config_only=True, fetch=fetch).folder


def run_result(
    path: str, root: Path | None = None, *, field: str = "model.path"
) -> ModelRef | None:
    """The result of the run a preset's ``model.path`` names — a run folder (with spec.json), a
    run id or a unique id prefix — or None when it names no run (a model folder, a model id).
    An ambiguous prefix, a run whose folder has gone or a run without a result yet raises its
    HomelabError (with a hint) naming ``field``."""
    if not path.strip():
        return None
    folder = Path(os.path.expanduser(path))
    _check_path(path, folder, field)
    if _is_dir(folder):
        if (folder / "spec.json").is_file():
            return _checked(_run_ref(folder.absolute()))
        return None
    if _exists(folder) or looks_like_hub_id(path):
        return None
    run_dir = find_run(path, root)
    if run_dir is not None:
        return _checked(_run_ref(run_dir))
    if _bare_name(path):  # no folder by that name here, no model id, and no run either
        raise RunNotFoundError(
            f"{field} {_shown(path)}: no model folder by that name here, not a Hugging Face id "
            f"(org/name), and no run with that id or id prefix (runs folder {root or runs_root()} "
            "and the run index)",
            hint="give a model folder's path, a Hugging Face id, or a run id from "
            "`homelab-dp runs` (a run kept elsewhere: --runs DIR)",
        )
    return None


def _shown(value: str, limit: int = 80) -> str:
    """``value`` quoted for an error line, cut to ``limit`` characters."""
    return repr(value if len(value) <= limit else value[:limit] + "…")


def _check_path(value: str, folder: Path, field: str) -> None:
    """A HomelabError when the system refuses the path itself (a NUL, a name too long)."""
    try:
        folder.stat()
    except (FileNotFoundError, NotADirectoryError):
        return
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise HomelabError(
            f"{field} {_shown(value)}: not a usable path ({reason})",
            hint="give a model folder's path, a Hugging Face id (org/name) or a run id",
        ) from None


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long for the system: no folder
        return False


def _exists(path: Path) -> bool:
    """Whether anything is at ``path``; a name the system refuses (too long) is nothing."""
    try:
        return path.exists()
    except OSError:
        return False


def _bare_name(value: str) -> bool:
    """One plain name: no folder separator, not ``.``, ``..`` or ``~…`` (a run id's shape)."""
    return "/" not in value and value not in (".", "..") and not value.startswith("~")


def with_run_model(preset: Preset, ref: ModelRef) -> Preset:
    """The preset starting from a run's result (`run_result`): its merged or full model folder,
    or for an adapter result its base with the adapter merged in at load time (model.adapter),
    so a DPO run adds fresh adapters on top and its reference (adapters disabled) is the
    earlier run's model. The preset's own model.trust_remote_code is kept."""
    if not ref.is_adapter:
        return replace(preset, model=replace(preset.model, path=str(ref.path)))
    model = replace(preset.model, path=str(ref.base), adapter=str(ref.path))
    # The new adapters sit on the merged start adapter: alone, with the base, they would be a
    # different model, so the result is always merged (final/merged is what MODEL resolves to).
    return replace(preset, model=model, train=replace(preset.train, merge=True))


def with_local_model(preset: Preset, root: Path | None = None) -> tuple[Preset, ModelOrigin | None]:
    """The preset with a model id replaced by its full local snapshot folder (downloaded when
    missing and online), and where it came from; a run id, unique prefix or run folder by its
    result (`with_run_model`, under ``root``); a model folder is returned as it is, with None."""
    ref = run_result(preset.model.path, root)
    if ref is not None:
        return with_run_model(preset, ref), None
    if not is_model_id(preset.model.path):
        return preset, None

    snap = resolve_model_id(preset.model.path, preset.model.revision)
    model = replace(preset.model, path=str(snap.folder))
    return replace(preset, model=model), snap.origin


def resolve_model_arg(
    ref: str, root: Path | None = None, *, config_only: bool = False, fetch: bool = True
) -> ModelRef:
    """What a MODEL argument names: a run id, a run folder, a model folder (`runs.model_ref`),
    or a Hugging Face id (``org/name`` or ``org/name@revision``), whose cached snapshot is used
    (downloaded when missing and online). ``config_only``: config.json is enough (a serving
    plan); not ``fetch``: the cache only (the TUI downloads no model). The ref of an id is
    named by the id and points at the snapshot folder."""
    repo_id, revision = split_revision(ref.strip())
    if not is_model_id(repo_id):
        return resolve_model(ref, root)

    snap = resolve_model_id(repo_id, revision, config_only=config_only, fetch=fetch)
    return replace(resolve_model(str(snap.folder), root), name=named(repo_id, revision))


def model_doc(spec: RunSpec) -> dict[str, str | None]:
    """A run's model as `status --json` and `runs --json` show it: the folder it loads, and
    the Hugging Face id, revision and commit when it was given by id (else null)."""
    origin = asdict(spec.model_origin) if spec.model_origin else {}
    return {"path": spec.preset.model.path, "repo_id": origin.get("repo_id"),
            "revision": origin.get("revision"), "commit": origin.get("commit")}  # fmt: skip
