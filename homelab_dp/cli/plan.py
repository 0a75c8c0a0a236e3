"""`homelab-dp plan`: will it fit, and how to spread it (no torch: answers in milliseconds).

Either a preset (``plan PRESET``) or a model alone (``plan --model ID_OR_FOLDER``: a Hugging
Face id, whose config.json is all that is read — from the cache, else downloaded — or a
local model folder), with every other field at its default. The flags ``--seq-len``,
``--micro-batch``, ``--method`` and ``--revision`` are ``--set`` overrides of either.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from homelab_dp.cli.common import EXIT_OK, print_json, print_rich
from homelab_dp.errors import HomelabError
from homelab_dp.vocabulary import METHODS


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def register(sub: Any) -> None:
    """Add `plan` to the main parser's subparsers."""
    p = sub.add_parser("plan", help="will it fit, and how to spread it")
    p.add_argument(
        "preset", nargs="?", help="a preset file or the name of one (homelab-dp presets list)"
    )
    p.add_argument(
        "--model",
        metavar="ID_OR_FOLDER",
        help="plan a model without a preset: a Hugging Face id (Qwen/Qwen2.5-0.5B) or a "
        "model folder; the other fields take their defaults",
    )
    p.add_argument("--revision", help="with a model id: a branch, tag or commit (default main)")
    p.add_argument("--gpus", help="plan for other hardware: 2x24GiB, 24GiB,12GiB, cpu:2")
    p.add_argument(
        "--network",
        metavar="NAME_OR_GBIT",
        help="price the communication over Ethernet between machines: 10GbE, 25GbE, 100GbE "
        "or Gbit/s (e.g. 40)",
    )
    p.add_argument("--seq-len", type=_positive, help="tokens per sequence (data.seq_len)")
    p.add_argument("--micro-batch", type=_positive, help="sequences per device (train.micro_batch)")
    p.add_argument("--method", choices=("auto", *METHODS), help="train.method (default auto)")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--find-micro-batch",
        action="store_true",
        help="the largest micro-batch that fits; accumulation keeps the effective batch",
    )
    p.add_argument(
        "--find-seq-len",
        action="store_true",
        help="the longest data.seq_len that fits (the preset's choice and every candidate), "
        "what limits it and what would lift it",
    )
    p.set_defaults(func=cmd_plan)


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The named flags as ``--set`` overrides, before the ``--set`` ones (which win)."""
    out = []
    if args.revision is not None:
        out.append(f"model.revision={json.dumps(args.revision)}")
    if args.seq_len is not None:
        out.append(f"data.seq_len={args.seq_len}")
    if args.micro_batch is not None:
        out.append(f"train.micro_batch={args.micro_batch}")
    if args.method is not None:
        out.append(f"train.method={json.dumps(args.method)}")
    return out + list(args.set)


def cmd_plan(args: argparse.Namespace) -> int:
    from homelab_dp.app.plan import make_plan, planned_samples, preset_for_model
    from homelab_dp.app.presets import expected_runs, open_preset

    if (args.preset is None) == (args.model is None):
        both = args.preset is not None
        raise HomelabError(
            "plan: give a preset or --model, not both"
            if both
            else "plan: give a preset (PRESET) or a model (--model ID_OR_FOLDER)",
            hint="`homelab-dp plan tiny-demo`, or `homelab-dp plan --model Qwen/Qwen2.5-0.5B "
            "--gpus 24GiB` (`homelab-dp presets list` shows the presets)",
        )
    overrides = flag_overrides(args)
    if args.model is not None:
        preset = preset_for_model(args.model, overrides)
    else:
        preset = open_preset(args.preset, overrides)
    # measure_link: on the CPU, gloo's bandwidth is measured once per host (then cached)
    planned = make_plan(preset, args.gpus, find_micro_batch=args.find_micro_batch,
                        find_seq_len=args.find_seq_len, network=args.network,
                        measure_link=True)  # fmt: skip
    # What the preset's recorded runs say (`app.presets`): expected duration and energy.
    expected = expected_runs(planned)
    samples = planned_samples(planned, expected)  # train.sample_every: what they add
    if args.json:
        seen = expected.to_json() if expected else {"expected": None, "recorded_runs": None}
        print_json({**planned.plan.to_json(), **seen, "samples": samples})
    else:
        from homelab_dp.render.plan import render_plan

        print_rich(render_plan(planned.plan, expected, samples))
    return EXIT_OK  # whether or not it fits: the answer is in `fits`
