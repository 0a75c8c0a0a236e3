"""The run commands of the CLI: run, runs, status, attach, stop, resume (thin, over the controller).

`run`, `attach` and `resume` follow the run they name (`homelab_dp.cli.follow`) unless
``--detach``: they print it until it ends, and Ctrl-C only detaches.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from homelab_dp import json_safe
from homelab_dp.cli.common import print_json
from homelab_dp.cli.sweep import add_notify_option


def _controller():
    from homelab_dp.app.runs import make_controller

    return make_controller()


def _mode(args: argparse.Namespace) -> str:
    if getattr(args, "json", False):
        return "json"
    return "live" if sys.stdout.isatty() else "plain"


def _rendezvous(args: argparse.Namespace):
    from homelab_dp.app.runs import rendezvous_for

    # a taken --master-port: a clear error before anything is prepared
    return rendezvous_for(args.nnodes, args.node_rank, args.master_addr, args.master_port)


def cmd_run(args: argparse.Namespace) -> int:
    from homelab_dp.cli.follow import follow

    controller = _controller()
    if args.queue and args.gpus and not args.gpus.lower().startswith("cpu"):
        from homelab_dp.errors import HomelabError

        raise HomelabError(
            f"--queue with --gpus {args.gpus}: a what-if size spec has no cards to wait for",
            hint="queue on real devices (leave out --gpus, or --set hardware.devices=[0,1]) "
            "or on the CPU with --gpus cpu:N",
        )
    rendezvous = _rendezvous(args)
    prepared = controller.prepare(
        args.preset,
        overrides=list(args.set),
        gpus=args.gpus,
        force=args.force,
        nnodes=rendezvous.nnodes,
        queue=args.queue,
        auto_fit=args.auto_fit,
    )
    fit = prepared.fit
    if fit is not None and fit.fits:  # `run --auto-fit`: the micro-batch the run takes
        print(
            json_safe.dumps({"type": "auto_fit", **fit.to_json()}) if args.json else fit.describe()
        )
    for warning in prepared.warnings:  # stderr: --json's stdout stays one document per line
        print(warning, file=sys.stderr)
    run_id = controller.start(
        prepared,
        rendezvous,
        auto_fit=args.auto_fit,
        queue=args.queue,
        force=args.force,
        notify=args.notify,
    )
    head = f"started {run_id}"
    if args.queue and not args.json:
        queue = controller.status(run_id).get("queue") or {}
        waits = ", ".join(queue.get("waiting_for") or []) or "nothing: it starts now"
        head = f"queued {run_id} (position {queue.get('position', 1)}, waiting for {waits})"
    if args.detach:
        if args.json:
            print(json_safe.dumps({"type": "detached", "run_id": run_id, "queued": args.queue}))
        else:
            print(f"{head}\nfollow it with: homelab-dp attach {run_id}")
        return 0
    if not args.json:
        print(f"{head} (Ctrl-C detaches; stop with: homelab-dp stop {run_id})")
    return follow(controller, run_id, _mode(args), history_until=0)


def cmd_attach(args: argparse.Namespace) -> int:
    from homelab_dp.cli.follow import follow

    controller = _controller()
    run_id = controller.run_dir(args.run).name
    return follow(controller, run_id, _mode(args))


def cmd_resume(args: argparse.Namespace) -> int:
    from homelab_dp.app.follow import events_end, resumed_from
    from homelab_dp.cli.follow import follow

    controller = _controller()
    # Only what the resumed run writes is printed; earlier events are history.
    history = events_end(controller.run_dir(args.run))
    run_id = controller.resume(
        args.run, _rendezvous(args), queue=args.queue, force=args.force, notify=args.notify
    )
    step = resumed_from(controller.run_dir(run_id))
    if step == 0:  # said, never silent: the steps it made are trained again
        sys.stderr.write(
            f"notice: run {run_id} has no usable checkpoint: it starts again from step 1\n"
        )
    if args.detach:
        doc = {"type": "detached", "run_id": run_id, "resume_from": step}
        print(json_safe.dumps(doc) if args.json else f"resumed {run_id}")
        return 0
    return follow(controller, run_id, _mode(args), history_until=history)


def cmd_stop(args: argparse.Namespace) -> int:
    controller = _controller()
    state = controller.stop(args.run, timeout=args.timeout)
    print(
        f"{controller.run_dir(args.run).name}: {state.get('status')} — {state.get('reason') or ''}"
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    doc = _controller().status(args.run)
    if args.json:
        print_json(doc)
        return 0
    from homelab_dp.render.runs import status_lines

    print("\n".join(status_lines(doc)))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from homelab_dp.app.compare import compare
    from homelab_dp.render.compare import compare_lines

    doc = compare(_controller(), args.runs_to_compare, sweep=args.sweep)
    if args.json:
        print_json(doc)
        return 0
    print("\n".join(compare_lines(doc)))
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    if getattr(args, "runs_command", None) == "compare":
        return cmd_compare(args)
    if args.forget_gone:
        forgotten = _controller().forget_gone()
        if args.json:
            print_json({"forgotten": forgotten})
        else:
            print(f"forgot {len(forgotten)} run(s) whose folder has gone"
                  + "".join(f"\n  {run_id}" for run_id in forgotten))  # fmt: skip
        return 0
    rows = _controller().list_runs(sweep=args.sweep)
    if args.json:
        print_json(rows)
        return 0
    from homelab_dp.render.runs import runs_lines

    print("\n".join(runs_lines(rows)))
    return 0


def _add_rendezvous(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, default=1, help="machines in the run (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's number, 0..nnodes-1")
    p.add_argument(
        "--master-addr", default="127.0.0.1", help="address of node 0 (c10d rendezvous host)"
    )
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port on node 0")


def register(sub: Any) -> None:
    """Add the run commands to the main parser's subparsers."""
    p = sub.add_parser("run", help="start a fine-tune (follows it unless --detach)")
    p.add_argument("preset")
    p.add_argument("--gpus", help="cpu:N runs on N CPU processes")
    p.add_argument("--detach", action="store_true", help="return at once; the run goes on")
    p.add_argument("--json", action="store_true", help="events as JSON lines")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--force",
        action="store_true",
        help="start even if the plan does not fit or another run is using the devices",
    )
    p.add_argument(
        "--queue",
        action="store_true",
        help="wait (in the background, first in first out) until no other run uses the devices "
        "and the plan's memory is free, then start",
    )
    p.add_argument(
        "--auto-fit",
        action="store_true",
        help="fit the micro-batch to memory; after an out-of-memory error, resume with a smaller "
        "micro-batch and more accumulation (same effective batch) by itself",
    )
    add_notify_option(p)
    _add_rendezvous(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("runs", help="every run, newest first, wherever it lives")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--forget-gone",
        action="store_true",
        help="drop the runs whose folder has gone (moved or deleted) from the run index",
    )
    p.add_argument("--sweep", metavar="ID", default=None, help="only the runs of this sweep")
    p.set_defaults(func=cmd_runs)
    runs_sub = p.add_subparsers(dest="runs_command", parser_class=type(p))
    c = runs_sub.add_parser(
        "compare",
        help="runs side by side, best eval loss first: the settings that differ, eval loss, "
        "benchmark scores, speed, memory, energy, the last sample",
    )
    c.add_argument("runs_to_compare", nargs="*", metavar="RUN", help="run ids (or prefixes)")
    c.add_argument("--sweep", metavar="ID", default=None, help="every run of this sweep")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_runs)

    p = sub.add_parser("status", help="one run's state and figures")
    p.add_argument("run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("attach", help="follow a run until it ends (Ctrl-C detaches)")
    p.add_argument("run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_attach)

    p = sub.add_parser("stop", help="graceful stop: all ranks agree, checkpoint, exit")
    p.add_argument("run")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait (default 120)")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("resume", help="continue a stopped or failed run from its last checkpoint")
    p.add_argument("run")
    p.add_argument("--queue", action="store_true", help="wait until its devices are free")
    p.add_argument(
        "--force", action="store_true", help="resume even if another run is using the devices"
    )
    p.add_argument("--detach", action="store_true")
    p.add_argument("--json", action="store_true")
    add_notify_option(p)
    _add_rendezvous(p)
    p.set_defaults(func=cmd_resume)
