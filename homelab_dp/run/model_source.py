"""Models named by Hugging Face id, resolved once in the front end's process.

A preset's ``model.path`` and the MODEL argument of `eval`, `chat` and `serve` may be a Hugging
Face id (``Qwen/Qwen2.5-0.5B``, `homelab_dp.core.hub_ids`): planning reads the id's config.json
only; a run, eval, chat or serve needs the whole snapshot (`homelab_dp.hub.models`). What goes
on — the run spec, the eval job, the serving replicas — is the local snapshot folder, so
workers, replicas and resumed runs never touch the Hub. A path that exists always wins.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from homelab_dp.core.hub_ids import looks_like_hub_id
from homelab_dp.core.preset import Preset
from homelab_dp.core.runspec import ModelOrigin, RunSpec
from homelab_dp.rundir.results import ModelRef, resolve_model


def is_model_id(path: str) -> bool:
    """Whether ``path`` names a Hub model rather than a folder (a path that exists wins)."""
    return looks_like_hub_id(path) and not Path(path).expanduser().exists()


def split_revision(ref: str) -> tuple[str, str]:
    """``org/name@revision`` → (``org/name``, ``revision``); no ``@``: revision ""."""
    head, sep, revision = ref.partition("@")
    if sep and looks_like_hub_id(head) and revision and not Path(ref).exists():
        return head, revision
    return ref, ""


def config_folder(path: str, revision: str = "", *, fetch: bool = True) -> Path:
    """The folder whose config.json describes ``path``: the folder itself, or for a model id
    its cached snapshot (config.json downloaded if missing, when ``fetch`` and online)."""
    if not is_model_id(path):
        return Path(path)
    from homelab_dp.hub.models import resolve_model_id

    return resolve_model_id(path, revision, config_only=True, fetch=fetch).folder


def with_local_model(preset: Preset) -> tuple[Preset, ModelOrigin | None]:
    """The preset with a model id replaced by its full local snapshot folder (downloaded when
    missing and online), and where it came from; a folder is returned as it is, with None."""
    if not is_model_id(preset.model.path):
        return preset, None
    from homelab_dp.hub.models import resolve_model_id

    snap = resolve_model_id(preset.model.path, preset.model.revision)
    model = replace(preset.model, path=str(snap.folder))
    return replace(preset, model=model), snap.origin


def resolve_model_arg(
    ref: str, root: Path | None = None, *, config_only: bool = False, fetch: bool = True
) -> ModelRef:
    """What a MODEL argument names: a run id, a run folder, a model folder (`rundir.results`),
    or a Hugging Face id (``org/name`` or ``org/name@revision``), whose cached snapshot is used
    (downloaded when missing and online). ``config_only``: config.json is enough (a serving
    plan); not ``fetch``: the cache only (the TUI downloads no model). The ref of an id is
    named by the id and points at the snapshot folder."""
    repo_id, revision = split_revision(ref.strip())
    if not is_model_id(repo_id):
        return resolve_model(ref, root)
    from homelab_dp.hub.models import named, resolve_model_id

    snap = resolve_model_id(repo_id, revision, config_only=config_only, fetch=fetch)
    return replace(resolve_model(str(snap.folder), root), name=named(repo_id, revision))


def model_doc(spec: RunSpec) -> dict[str, str | None]:
    """A run's model as `status --json` and `runs --json` show it: the folder it loads, and
    the Hugging Face id, revision and commit when it was given by id (else null)."""
    origin = asdict(spec.model_origin) if spec.model_origin else {}
    return {"path": spec.preset.model.path, "repo_id": origin.get("repo_id"),
            "revision": origin.get("revision"), "commit": origin.get("commit")}  # fmt: skip
