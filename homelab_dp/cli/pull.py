"""`homelab-dp pull MODEL_ID`: download a Hugging Face model into the local cache ahead of time.

What a run, eval, chat or serve of the id will load (config, safetensors, tokenizer; never
pickles), or with ``--config-only`` just what `plan` reads. Progress bars go to stderr; the
snapshot folder is printed on stdout. Offline (HF_HUB_OFFLINE), a cached snapshot is
reported as it is and a missing one is an error naming the cache folder.
"""

from __future__ import annotations

import argparse
from typing import Any

from homelab_dp.cli.common import EXIT_OK, print_json
from homelab_dp.errors import ModelSpecError


def register(sub: Any) -> None:
    """Add `pull` to the main parser's subparsers."""
    p = sub.add_parser("pull", help="download a Hugging Face model into the local cache")
    p.add_argument("model_id", metavar="MODEL_ID", help="a Hugging Face id: org/name")
    p.add_argument("--revision", default="", help="a branch, tag or commit (default main)")
    p.add_argument("--config-only", action="store_true", help="only config.json (what plan reads)")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.set_defaults(func=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    from homelab_dp.hub.hub_models import hub_cache, looks_like_hub_id, resolve_model_id

    if not looks_like_hub_id(args.model_id):
        raise ModelSpecError(
            f"pull {args.model_id}: not a Hugging Face id (org/name)",
            hint="e.g. `homelab-dp pull Qwen/Qwen2.5-0.5B`; a local folder needs no pull",
        )
    snap = resolve_model_id(
        args.model_id, args.revision, config_only=args.config_only, refresh=True
    )
    if args.json:
        print_json({"repo_id": snap.repo_id, "revision": snap.revision or "main",
                    "commit": snap.commit, "folder": str(snap.folder),
                    "cache": str(hub_cache()), "config_only": args.config_only})  # fmt: skip
    else:
        print(snap.folder)
    return EXIT_OK
