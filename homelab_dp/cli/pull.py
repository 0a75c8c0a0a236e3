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


def register(sub: Any) -> None:
    """Add `pull` to the main parser's subparsers."""
    p = sub.add_parser("pull", help="download a Hugging Face model into the local cache")
    p.add_argument("model_id", metavar="MODEL_ID", help="a Hugging Face id: org/name")
    p.add_argument("--revision", default="", help="a branch, tag or commit (default main)")
    p.add_argument("--config-only", action="store_true", help="only config.json (what plan reads)")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.set_defaults(func=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    from homelab_dp.app.pull import pull

    doc = pull(args.model_id, args.revision, config_only=args.config_only)
    if args.json:
        print_json(doc)
    else:
        print(doc["folder"])
    return EXIT_OK
