"""`homelab-dp export RUN --format hf|adapter|merged|ollama|gguf --out DIR`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from homelab_dp.cli.common import EXIT_OK, print_json


def register(sub: Any) -> None:
    """Add `export` to the main parser's subparsers."""
    from homelab_dp.app.export import FORMATS

    p = sub.add_parser("export", help="a run's result as a folder other tools load")
    p.add_argument("run", help="a run id (or a unique prefix) or a run folder")
    p.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help="hf: a standalone HF model folder; adapter: the PEFT adapter; merged: the adapter "
        "merged into its base in the run's compute dtype (safetensors, tokenizer, chat "
        "template); ollama: merged + a Modelfile for `ollama create`; gguf: merged converted "
        "by llama.cpp's convert_hf_to_gguf.py ($LLAMA_CPP_DIR or PATH)",
    )
    p.add_argument("--out", required=True, help="a new (or empty) folder; never overwritten")
    p.add_argument("--json", action="store_true", help='one JSON document: {"format", "out", '
                   '"files", "bytes", "dtype", "notes"}')  # fmt: skip
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """Check, then export in this process, on the CPU (`app.export`)."""
    from homelab_dp.app.export import export_run

    result = export_run(args.run, args.format, Path(args.out))
    if args.json:
        print_json(result.to_json())
    else:
        from homelab_dp.render.export import export_lines

        print("\n".join(export_lines(result.to_json())))
    return EXIT_OK
