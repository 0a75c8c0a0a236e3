"""`homelab-dp pull`: a Hugging Face model (or its config.json alone) into the local cache."""

from __future__ import annotations

from typing import Any

from homelab_dp.errors import ModelSpecError
from homelab_dp.hub.hub_models import NotCachedError, hub_cache, looks_like_hub_id, resolve_model_id

__all__ = ["NotCachedError"]  # a model id the cache lacks where nothing may be downloaded


def pull(model_id: str, revision: str = "", *, config_only: bool = False) -> dict[str, Any]:
    """Download ``model_id`` (again, even when cached) and say where it is: the `pull --json`
    document. Raises ModelSpecError for what is no Hugging Face id."""
    if not looks_like_hub_id(model_id):
        raise ModelSpecError(
            f"pull {model_id}: not a Hugging Face id (org/name)",
            hint="e.g. `homelab-dp pull Qwen/Qwen2.5-0.5B`; a local folder needs no pull",
        )
    snap = resolve_model_id(model_id, revision, config_only=config_only, refresh=True)
    return {"repo_id": snap.repo_id, "revision": snap.revision or "main",
            "commit": snap.commit, "folder": str(snap.folder),
            "cache": str(hub_cache()), "config_only": config_only}  # fmt: skip
