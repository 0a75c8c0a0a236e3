"""The training worker: one process per rank, started by torchrun (never by hand).

    python -m torch.distributed.run --nproc-per-node N ... -m homelab_dp.train.loop.worker RUN_DIR [--resume]

It reads ``RUN_DIR/spec.json`` only (a `homelab_dp.runs.run_spec.RunSpec`); `homelab_dp.supervise.launcher` builds
the torchrun command. gloo on the CPU (fp32), nccl on CUDA (``cuda:LOCAL_RANK``, bf16/fp16 autocast
over fp32 master weights, or FSDP2 mixed precision).

A rank sets itself up (`train.loop.rank_setup`: the process group, the data, the model, the resume point),
writes the ``start`` event and trains (`train.loop.training_loop`: the steps, checkpoints, the result and the
``end`` event). This module is the entry point around them: the arguments, the refusal to run
outside a launcher, the error event of a failed rank and the exit code.

``--resume`` (or ``"resume": true`` in spec.json) continues from the newest complete checkpoint
(from scratch, with a warning, when there is none). SIGTERM or SIGINT stops the run gracefully at
the next optimizer-step boundary, with a checkpoint (`train.loop.training_loop.StopFlag`).

Exit codes: 0 completed or stopped on request (the ``end`` event's reason tells which; torchrun
turns any other worker code into a failure); 1 the run failed (an ``error`` event names the rank);
2 bad input (spec, data, model folder), or not started by a launcher.

Environment: ``HOMELAB_DP_STOP_AT_STEP=k`` (tests only) acts as if a stop were requested once k
optimizer steps are done; ``HOMELAB_DP_FAULT`` (tests only) injects faults (`train.loop.rank_guard`). A
spec may set ``"collective_timeout_s"`` (default 60 on CPU, 600 on CUDA; the controller copies
``train.collective_timeout_s``). ``resolved.dtype = "fp64"`` is accepted on the CPU for
exactness tests.

Out of memory ends the rank with an ``error`` event that reports the failed batch, with
planning's fallback (`planning.batch_shape`: a smaller micro-batch with more accumulation, same
effective batch, or activation checkpointing) in its hint (`train.loop.rank_guard.oom_advice`);
the keeper of a ``run --auto-fit`` asks planning for the next batch itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from homelab_dp.errors import HomelabError
from homelab_dp.runs.folder.run_folder import read_run_spec
from homelab_dp.runs.run_events import ErrorEvent
from homelab_dp.runs.run_spec import RunSpec
from homelab_dp.train.loop.event_log import EventLog
from homelab_dp.train.loop.rank_guard import RankGuard, oom_advice
from homelab_dp.train.loop.rank_setup import set_up, start_event
from homelab_dp.train.loop.reporting import open_reporting
from homelab_dp.train.loop.training_loop import StopFlag, Trainer

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m homelab_dp.train.loop.worker")
    parser.add_argument("run_dir", type=Path, help="the run folder holding spec.json")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    args = parser.parse_args(argv)
    missing = [name for name in _LAUNCHER_ENV if name not in os.environ]
    if missing:
        print(
            f"error: the worker runs under torchrun, one process per rank ({', '.join(missing)} "
            "not set)\nhint: start runs with `homelab-dp run PRESET`",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    rank = int(os.environ["RANK"])
    logging.basicConfig(
        level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s"
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only, never the network
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no progress bars in rank logs

    run_dir = args.run_dir.absolute()
    events = EventLog(run_dir / "events.jsonl", enabled=rank == 0)
    try:
        spec = read_run_spec(run_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(
            f"error: {run_dir / 'spec.json'}: {exc}\nhint: is this a run folder?", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    stop = StopFlag()
    stop.install()
    import torch.distributed as dist

    try:
        run_rank(spec, run_dir, events, stop, resume=args.resume or spec.resume)
        # Leave together: a rank that tears gloo down while a peer is still finishing (writing
        # the result or a report) can make that peer abort ("terminate called without an
        # active exception"), turning a completed run into a failed one.
        dist.barrier()
        return EXIT_OK
    except HomelabError as exc:
        events.write(ErrorEvent(message=exc.message, hint=exc.hint, rank=rank,
                                kind=type(exc).__name__), force=True)  # fmt: skip
        print(f"error: {exc.message}\nhint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # any crash: tell the controller which rank, then fail
        if _is_oom(exc):  # the failed batch; the keeper asks planning for the next one
            message, hint, proposal = oom_advice(spec.resolved, exc)
            events.write(ErrorEvent(message=message, hint=hint, rank=rank,
                                    kind="OutOfMemoryError", proposal=proposal), force=True)  # fmt: skip
            print(f"error: {message}\nhint: {hint}", file=sys.stderr)
            return EXIT_FAILED
        events.write(ErrorEvent(message=f"{type(exc).__name__}: {exc}", rank=rank,
                                kind=type(exc).__name__), force=True)  # fmt: skip
        traceback.print_exc()
        return EXIT_FAILED
    finally:
        events.close()  # the loggers' last figures on disk, however the rank ends
        if dist.is_initialized():
            dist.destroy_process_group()


def run_rank(spec: RunSpec, run_dir: Path, events: Any, stop: StopFlag, resume: bool) -> None:
    """Set the rank up, write the start event, train to the end or to a stop."""

    t_start = time.time()
    guard = RankGuard(run_dir, int(os.environ["RANK"]))  # heartbeats, orphan check
    s = set_up(spec, run_dir, events, resume)
    if events.enabled and not s.memory.measuring:  # rank 0's curves ([log] report_to)
        events.sink = open_reporting(spec, run_dir, s.position.start_step, events)
    trainer = Trainer(spec, run_dir, s, events, stop, guard, t_start)
    events.write(start_event(spec, s))
    trainer.run()


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError)


if __name__ == "__main__":
    sys.exit(main())
