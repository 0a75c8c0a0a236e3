"""`homelab-dp presets list | show | save`: the presets found, one preset, a new one."""

from __future__ import annotations

import argparse
from typing import Any

from homelab_dp.cli.common import EXIT_OK, Parser, print_json


def register(sub: Any) -> None:
    """Add `presets` and its actions to the main parser's subparsers."""
    p = sub.add_parser("presets", help="list, show and save presets")
    psub = p.add_subparsers(dest="action", required=True, parser_class=Parser)
    q = psub.add_parser("list", help="every preset found")
    q.add_argument("--json", action="store_true")
    q = psub.add_parser("show", help="print one preset and the results of its completed runs")
    q.add_argument("name")
    q.add_argument("--json", action="store_true", help="name, path, text and results")
    q = psub.add_parser("save", help="save a preset with overrides under a new name")
    q.add_argument("name")
    q.add_argument("--from", dest="source", required=True, metavar="PRESET")
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    q.add_argument("--force", action="store_true", help="overwrite an existing preset")
    p.set_defaults(func=cmd_presets)


def cmd_presets(args: argparse.Namespace) -> int:
    from homelab_dp.app import presets

    if args.action == "list":
        rows = presets.preset_rows()
        if args.json:
            print_json([{"name": n, "path": str(p)} for n, p, _ in rows])
            return EXIT_OK
        for name, path, first in rows:
            print(f"{name:<24} {path}" + (f"\n{'':<24} {first}" if first else ""))
        return EXIT_OK
    if args.action == "show":
        return _show(args)
    # save
    preset = presets.open_preset(args.source, args.set)
    path = presets.save_preset(args.name, preset, force=args.force)
    print(f"saved {path}\nrun it with: homelab-dp run {args.name}")
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    """The preset's text, then the recorded results of its completed runs (every run of a
    preset of this name: `homelab_dp.app.presets.preset_document`)."""
    from homelab_dp.app.presets import preset_document
    from homelab_dp.render.preset_results import results_lines

    doc = preset_document(args.name)
    text, records = doc["text"], doc["results"]
    if args.json:
        print_json({**doc, "path": str(doc["path"])})
        return EXIT_OK
    print(f"# {doc['path']}")
    print(text, end="" if text.endswith("\n") else "\n")
    print(f"\n# Results of completed runs of {doc['name']} ({len(records)})")
    print("\n".join(results_lines(records)))
    return EXIT_OK
