"""`homelab-dp`: the headless command line (argparse + rich). Thin: no logic of its own.

Exit codes: 0 success; 2 bad input (one ``error:`` line naming the field, file or line, and a
``hint:`` line); 1 the run failed; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from homelab_dp.errors import HomelabError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


class _Parser(argparse.ArgumentParser):
    """argparse with our error format: ``error: …`` then ``hint: …``, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {self.prog}: {message}\nhint: see `{self.prog} --help`\n")
        raise SystemExit(EXIT_BAD_INPUT)


def _console():
    from rich.console import Console

    return Console()


def cmd_probe(args: argparse.Namespace) -> int:
    from homelab_dp.probe import nvml

    report = nvml.probe()
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        from homelab_dp.render.plan import render_probe

        _console().print(render_probe(report))
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from homelab_dp.core.preset_store import open_preset
    from homelab_dp.run.planning import make_plan

    preset = open_preset(args.preset, args.set)
    planned = make_plan(preset, args.gpus, find_micro_batch=args.find_micro_batch)
    if args.json:
        print(json.dumps(planned.plan.to_json(), indent=2))
    else:
        from homelab_dp.render.plan import render_plan

        _console().print(render_plan(planned.plan))
    return EXIT_OK  # whether or not it fits: the answer is in `fits`


def cmd_measure(args: argparse.Namespace) -> int:
    from homelab_dp.render.measure import render_measure
    from homelab_dp.run.measure import measure

    report = measure(args.preset, steps=args.steps, gpus=args.gpus, overrides=args.set,
                     force=args.force, store=not args.no_store)  # fmt: skip
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _console().print(render_measure(report))
    return EXIT_OK


def cmd_presets(args: argparse.Namespace) -> int:
    from homelab_dp.core import preset_store

    if args.action == "list":
        rows = preset_store.list_presets()
        if args.json:
            print(json.dumps([{"name": n, "path": str(p)} for n, p in rows], indent=2))
            return EXIT_OK
        for name, path in rows:
            first = preset_store.header_comment(path).splitlines()
            print(f"{name:<24} {path}" + (f"\n{'':<24} {first[0]}" if first else ""))
        return EXIT_OK
    if args.action == "show":
        path = preset_store.find_preset(args.name)
        preset_store.load_preset(path)  # validate before showing
        print(f"# {path}")
        print(path.read_text(encoding="utf-8"), end="")
        return EXIT_OK
    # save
    preset = preset_store.open_preset(args.source, args.set)
    path = preset_store.save_preset(args.name, preset, force=args.force)
    print(f"saved {path}\nrun it with: homelab-dp run {args.name}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The whole command-line contract of DESIGN.md (the commands built so far)."""
    parser = _Parser(prog="homelab-dp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    p = sub.add_parser("probe", help="the GPUs (or the CPU host when there is no GPU)")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("plan", help="will it fit, and how to spread it")
    p.add_argument("preset", help="a preset file or the name of one (homelab-dp presets list)")
    p.add_argument("--gpus", help="plan for other hardware: 2x24GiB, 24GiB,12GiB, cpu:2")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--find-micro-batch",
        action="store_true",
        help="the largest micro-batch that fits; accumulation keeps the effective batch",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("measure", help="run a few real steps and measure memory against the plan")
    p.add_argument("preset", help="a preset file or the name of one")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps to measure (default 3)")
    p.add_argument("--gpus", help="cpu:N measures on N CPU processes")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.add_argument("--force", action="store_true", help="measure even if the plan does not fit")
    p.add_argument("--no-store", action="store_true", help="do not keep the result for later plans")
    p.set_defaults(func=cmd_measure)

    p = sub.add_parser("presets", help="list, show and save presets")
    psub = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    q = psub.add_parser("list", help="every preset found")
    q.add_argument("--json", action="store_true")
    q = psub.add_parser("show", help="print one preset")
    q.add_argument("name")
    q = psub.add_parser("save", help="save a preset with overrides under a new name")
    q.add_argument("name")
    q.add_argument("--from", dest="source", required=True, metavar="PRESET")
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    q.add_argument("--force", action="store_true", help="overwrite an existing preset")
    p.set_defaults(func=cmd_presets)

    from homelab_dp.cli import runs as cli_run

    cli_run.add_commands(sub)
    return parser


def report_error(exc: HomelabError) -> int:
    """Print a user error as ``error:`` and ``hint:`` lines; return its exit code."""
    problems = getattr(exc, "problems", None) or [exc.message]
    for problem in problems:
        sys.stderr.write(f"error: {problem}\n")
    if exc.hint:
        sys.stderr.write(f"hint: {exc.hint}\n")
    return exc.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `homelab-dp` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:  # no command: the Textual TUI
        from homelab_dp.tui.app import run_tui

        return run_tui()
    try:
        return func(args)
    except HomelabError as exc:
        return report_error(exc)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `homelab-dp runs --json | head`: the reader left early
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
