"""The training worker: one process per rank, started by torchrun (never by hand).

    python -m torch.distributed.run --nproc-per-node N ... -m homelab_dp.train.worker RUN_DIR [--resume]

It reads ``RUN_DIR/spec.json`` only (a `homelab_dp.core.runspec.RunSpec`); `homelab_dp.run.launcher` builds
the torchrun command. gloo on the CPU (fp32), nccl on CUDA (``cuda:LOCAL_RANK``, bf16/fp16 autocast
over fp32 master weights, or FSDP2 mixed precision).

Exactness: the global sample order is a permutation of the blocks seeded by ``train.seed`` and
the epoch only. Optimizer step i consumes global samples [i·E, (i+1)·E), E = micro × world ×
accumulation; on micro-step k rank r takes the M samples starting at i·E + (k·W + r)·M. The loss
is the sum of token losses divided by the number of target tokens in the whole effective batch
(all-reduced before the step's forward passes), times the world size because DDP and FSDP2 average
gradients. So N ranks × micro m equals one process with micro N·m, or with accumulation, on any
data, and a resumed run repeats an uninterrupted one bit for bit.

Graceful stop: SIGTERM or SIGINT sets a flag; the ranks agree at the next optimizer-step boundary
(the flag rides on that step's token-count all-reduce), save a checkpoint, write an ``end`` event
with reason "stopped" and exit 0. ``--resume`` (or ``"resume": true`` in spec.json) continues from
the newest complete checkpoint (from scratch, with a warning, when there is none).

Exit codes: 0 completed or stopped on request (the ``end`` event's reason tells which; torchrun
turns any other worker code into a failure); 1 the run failed (an ``error`` event names the rank);
2 bad input (spec, data, model folder), or not started by a launcher.

Environment: ``HOMELAB_DP_STOP_AT_STEP=k`` (tests only) acts as if a stop were requested once k
optimizer steps are done; ``HOMELAB_DP_FAULT`` (tests only) injects faults (`train.guard`). A
spec may set ``"collective_timeout_s"`` (default 60 on CPU, 600 on CUDA; the controller copies
``train.collective_timeout_s``). ``resolved.dtype = "fp64"`` is accepted on the CPU for
exactness tests.

Safety (`train.guard`): every micro-step writes the rank's heartbeat for the keeper's watchdog
and checks that the torchrun agent is still its parent (if not, the rank stops gracefully);
out of memory ends the rank with an ``error`` event that proposes a smaller micro-batch with
more accumulation (same effective batch) or activation checkpointing.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import random
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from homelab_dp.core.runspec import RunSpec

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
STOP_AT_ENV = "HOMELAB_DP_STOP_AT_STEP"
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

log = logging.getLogger("homelab_dp.worker")


class StopFlag:
    """Set by SIGTERM/SIGINT; acted on at the next optimizer-step boundary."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        log.warning("%s received: stopping at the next step boundary", signal.Signals(signum).name)


class Trainer:
    """One rank's run: set-up from the spec, the optimizer-step loop, checkpoints, the result."""

    def __init__(
        self, spec: RunSpec, run_dir: Path, events: Any, stop: StopFlag, resume: bool
    ) -> None:
        self.t_start = time.time()
        self.spec, self.run_dir, self.events, self.stop = spec, run_dir, events, stop
        self.resume = resume
        self.preset = spec.preset
        self.resolved = spec.resolved
        self.train = self.preset.train
        self.stop_at = int(os.environ.get(STOP_AT_ENV, "-1"))
        self.last_loss: float | None = None

    # ------------------------------------------------------------------ set-up
    def _init_distributed(self) -> None:
        import torch
        import torch.distributed as dist

        from homelab_dp.errors import HomelabError

        local_rank = int(os.environ["LOCAL_RANK"])
        cuda = self.resolved.device == "cuda"
        if cuda and not torch.cuda.is_available():
            raise HomelabError("the spec asks for CUDA but torch sees no GPU", "plan again for cpu")
        self.device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        timeout = self.spec.collective_timeout_s or (600 if cuda else 60)
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=float(timeout))}
        if cuda:
            torch.cuda.set_device(self.device)
            kwargs["device_id"] = self.device
        dist.init_process_group("nccl" if cuda else "gloo", **kwargs)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.micro = self.resolved.micro_batch
        self.effective = self.resolved.effective_batch
        self.accum = self.resolved.grad_accum
        if self.world != self.resolved.world_size:
            # Keep the effective batch (and so the data position and schedule) of the plan.
            if self.effective % (self.micro * self.world):
                raise HomelabError(
                    f"{self.world} processes cannot keep the planned effective batch "
                    f"{self.effective} with micro-batch {self.micro}",
                    hint=f"run with {self.resolved.world_size} processes",
                )
            self.accum = self.effective // (self.micro * self.world)
            log.warning("world size %d (planned %d): gradient accumulation %d keeps batch %d",
                        self.world, self.resolved.world_size, self.accum, self.effective)  # fmt: skip

    def _load_data(self) -> None:
        import torch
        from transformers import AutoConfig

        from homelab_dp.data.blocks import IGNORE_INDEX, load_dataset
        from homelab_dp.train.model import load_tokenizer
        from homelab_dp.train.strategy import SampleOrder

        self.tokenizer = load_tokenizer(self.preset)
        config = AutoConfig.from_pretrained(
            self.preset.model.path, trust_remote_code=self.preset.model.trust_remote_code
        )
        limit = getattr(config, "max_position_embeddings", None)
        blocks = load_dataset(self.preset.data, self.tokenizer, seq_len_limit=limit,
                              min_blocks=self.world * self.micro)  # fmt: skip
        self.input_ids = torch.tensor([b.input_ids for b in blocks], dtype=torch.long)
        self.labels = torch.tensor([b.labels for b in blocks], dtype=torch.long)
        self.mask = torch.tensor([b.attention_mask for b in blocks], dtype=torch.long)
        self.targets = (self.labels != IGNORE_INDEX).sum(1)
        self.real_tokens = self.mask.sum(1)
        self.n_blocks = len(blocks)
        self.order = SampleOrder(self.n_blocks, self.train.seed)
        self.total_steps = self.train.max_steps or max(
            1, math.ceil(self.train.epochs * self.n_blocks / self.effective)
        )

    def _build(self) -> None:
        import torch

        from homelab_dp.errors import HomelabError
        from homelab_dp.train.model import load_model, master_dtype
        from homelab_dp.train.strategy import build_optimizer, build_scheduler, wrap_model

        # Same seed on every rank: identical LoRA init without relying on a broadcast.
        torch.manual_seed(self.train.seed)
        random.seed(self.train.seed)
        self.loaded = load_model(self.preset, self.resolved, self.device)
        self.strategy = wrap_model(self.loaded, self.resolved, self.device)
        self.optimizer = build_optimizer(self.strategy, self.train, self.resolved.lr, self.device)
        self.scheduler = build_scheduler(self.optimizer, self.train, self.total_steps)
        torch.manual_seed(self.train.seed + self.rank)  # dropout differs per rank
        self.loss_dtype = master_dtype(self.resolved)
        self.scaler = None
        self.autocast: Any = contextlib.nullcontext
        if self.device.type == "cuda" and self.resolved.dtype in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.resolved.dtype == "bf16" else torch.float16
            if self.resolved.dtype == "fp16":
                if self.strategy.is_fsdp:
                    raise HomelabError("fp16 with FSDP2 is not supported", hint="use bf16")
                self.scaler = torch.amp.GradScaler("cuda")
            if not self.strategy.is_fsdp:  # FSDP2 casts through its MixedPrecisionPolicy
                self.autocast = lambda: torch.autocast("cuda", dtype=dtype)

    def _maybe_resume(self) -> None:
        from homelab_dp.errors import RunStateError
        from homelab_dp.train.checkpoint import find_usable, load_checkpoint
        from homelab_dp.train.strategy import set_lr_for_step

        self.start_step, self.tokens, self.resumed_from = 0, 0, None
        if not self.resume:
            return
        path, skipped = find_usable(self.run_dir / "checkpoints")
        for reason in skipped:  # a damaged checkpoint is named, and the one before it used
            log.warning("%s", reason)
            self.events.emit("warning", message=f"{reason}; resuming from "
                             f"{path.name if path else 'step 0'}")  # fmt: skip
        self._agree_on_checkpoint(path)
        if path is None:
            log.warning("no complete checkpoint in %s: starting from step 0", self.run_dir)
            return
        state = load_checkpoint(path, self.strategy, self.optimizer)
        if state["effective_batch"] != self.effective:
            raise RunStateError(
                f"{path}: saved with effective batch {state['effective_batch']}, "
                f"this run has {self.effective}",
                hint="resume with the run's own spec (micro × world × accumulation)",
            )
        self.start_step, self.tokens = int(state["step"]), int(state["tokens"])
        self.last_loss = state.get("loss")
        self.scheduler.load_state_dict(state["scheduler"])
        set_lr_for_step(self.optimizer, self.scheduler, self.start_step)
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.resumed_from = str(path)
        log.info("resumed from %s at step %d", path, self.start_step)

    def _agree_on_checkpoint(self, path: Path | None) -> None:
        """Every rank must resume from the same step (it differs when nodes share no folder)."""
        import torch
        import torch.distributed as dist

        from homelab_dp.errors import RunStateError

        mine = int(path.name.split("-")[1]) if path else -1
        seen = torch.tensor([mine, -mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if int(seen[0]) != -int(seen[1]):
            raise RunStateError(
                f"ranks see different newest checkpoints (steps {-int(seen[1])}..{int(seen[0])})",
                hint="multi-node resume needs the run folder on a filesystem every node shares",
            )

    def _start_event(self) -> None:
        import torch

        from homelab_dp.core.run_view import StragglerDetector
        from homelab_dp.train.metrics import RankStats, all_gather_flat, peak_memory_kind

        pid = torch.tensor([os.getpid()], dtype=torch.int64, device=self.device)
        pids = torch.empty(self.world, dtype=torch.int64, device=self.device)
        all_gather_flat(pids, pid)  # once per run: who is who, for the controller
        self.stats = RankStats(self.device)
        self.stragglers = StragglerDetector()
        self.memory_kind = peak_memory_kind(self.device)
        per_device = self.spec.planned_bytes or None
        r = self.resolved
        self.events.emit(
            "start", run_id=self.spec.run_id, world_size=self.world, method=r.method,
            distribution=r.distribution, device=r.device, dtype=r.dtype,
            total_steps=self.total_steps, start_step=self.start_step,
            resumed_from=self.resumed_from, params=self.loaded.params,
            trainable_params=self.loaded.trainable_params, micro_batch=self.micro,
            grad_accum=self.accum, effective_batch=self.effective,
            seq_len=self.preset.data.seq_len,
            tokens_per_step=self.effective * self.preset.data.seq_len, samples=self.n_blocks,
            pids=pids.tolist(), peak_memory_kind=self.memory_kind, estimate=per_device,
            estimate_bytes=(per_device or {}).get("total"),
        )  # fmt: skip

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Set up, train to the end or to a stop, checkpoint, save the result."""
        from homelab_dp.train.guard import RankGuard
        from homelab_dp.train.memtrack import WorkerMemory

        self.guard = RankGuard(self.run_dir, int(os.environ["RANK"]))  # heartbeats, orphan check
        self._init_distributed()
        self._load_data()
        self.memory = WorkerMemory(self.spec, self.device, self.total_steps)
        self.memory.before_build()
        self._build()
        self.memory.after_build(self.strategy.inner, self.optimizer)
        self._maybe_resume()
        self._start_event()
        reason, step = self._loop()
        if self.memory.measuring:  # `homelab-dp measure`: figures only, no checkpoint or result
            self.memory.report(self.events, mode="measure")
            self.events.emit("end", reason="measured", final_loss=self.last_loss, steps=step,
                             seconds=time.time() - self.t_start, final_path=None)  # fmt: skip
            return EXIT_OK
        if step > 0:
            self._checkpoint(step)
        final = None
        if reason == "completed":
            from homelab_dp.train.checkpoint import save_result

            self.guard.beat(step, phase="result")  # the watchdog's clock restarts for the save
            final = save_result(self.run_dir, self.strategy, self.loaded.is_peft, self.tokenizer,
                                self.preset)  # fmt: skip
        self.events.emit("end", reason=reason, final_loss=self.last_loss, steps=step,
                         seconds=time.time() - self.t_start,
                         final_path=str(final) if final else None)  # fmt: skip
        return EXIT_OK

    def _loop(self) -> tuple[str, int]:
        import torch
        import torch.distributed as dist

        from homelab_dp.train.strategy import rank_slices

        dev, step = self.device, self.start_step
        last_log_t, last_log_tokens, last_log_step = time.time(), self.tokens, step
        while step < self.total_steps:
            t0 = time.perf_counter()
            wall0 = time.time()
            probe = self.memory.begin_step(step, self.strategy, self.optimizer)  # None mostly
            micro_idx = [
                torch.tensor(self.order.blocks(s.start, len(s)))
                for s in rank_slices(step, self.micro, self.world, self.accum, self.rank)
            ]
            mine = torch.cat(micro_idx)
            stop = self.stop.requested or step == self.stop_at
            # The step's one all-reduce: target tokens (to normalise the loss before any
            # backward), real tokens (throughput) and the stop flag (all ranks agree).
            agreed = torch.tensor(
                [float(self.targets[mine].sum()), float(self.real_tokens[mine].sum()), float(stop)],
                dtype=torch.float64, device=dev,
            )  # fmt: skip
            dist.all_reduce(agreed)
            targets, tokens, stop_votes = agreed.tolist()
            if stop_votes > 0:
                return "stopped", step
            scale = self.world / max(targets, 1.0)
            loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
            for k, idx in enumerate(micro_idx):
                if self.guard.beat(step + 1, k):  # orphaned (agent gone): stop gracefully
                    self.stop.requested = True
                with self.strategy.accumulate(final=k == self.accum - 1):
                    loss_sum += micro_step(
                        self.strategy, self.input_ids[idx].to(dev), self.mask[idx].to(dev),
                        self.labels[idx].to(dev), scale, autocast=self.autocast,
                        loss_dtype=self.loss_dtype, scaler=self.scaler, probe=probe,
                    )  # fmt: skip
                if self.accum > 1 and self.rank == 0:
                    self.events.emit("micro", step=step + 1, micro_step=k + 1,
                                     grad_accum=self.accum)  # fmt: skip
            lr = self.optimizer.param_groups[0]["lr"]
            grad_norm = self._optimizer_step()
            self.memory.end_step(step, self.events)
            step += 1
            self.tokens += int(tokens)
            if step % self.train.log_every == 0 or step == self.total_steps:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                now = time.time()
                rows = self.stats.gather(loss_sum, time.perf_counter() - t0)
                self.last_loss = sum(r[0] for r in rows) / max(targets, 1.0)
                span = max(now - last_log_t, 1e-9)
                self.events.emit(
                    "step", step=step, total_steps=self.total_steps,
                    epoch=step * self.effective / self.n_blocks, loss=self.last_loss, lr=lr,
                    grad_norm=float(grad_norm),
                    tokens_per_s=(self.tokens - last_log_tokens) / span,
                    samples_per_s=(step - last_log_step) * self.effective / span,
                    micro_batch=self.micro, grad_accum=self.accum, world_size=self.world,
                    effective_batch=self.effective, step_time_s=now - wall0,
                    rank_step_times_s=[r[1] for r in rows],
                    peak_memory_bytes=[int(r[2]) for r in rows],
                    peak_memory_kind=self.memory_kind, tokens=self.tokens,
                    samples=step * self.effective,
                )  # fmt: skip
                last_log_t, last_log_tokens, last_log_step = now, self.tokens, step
                for slow in self.stragglers.update([r[1] for r in rows]):
                    self.events.emit("straggler", step=step, rank=slow,
                                     message=self.stragglers.flagged[slow])  # fmt: skip
            every = self.train.checkpoint_every
            if every and step % every == 0 and step < self.total_steps:
                self._checkpoint(step)
        return "completed", step

    def _optimizer_step(self) -> Any:
        return optimizer_step(self.strategy, self.optimizer, self.scheduler, self.scaler,
                              self.train.max_grad_norm)  # fmt: skip

    # ------------------------------------------------------------------ outputs
    def _checkpoint(self, step: int) -> None:
        from homelab_dp.train.checkpoint import save_checkpoint

        self.guard.beat(step, phase="checkpoint")
        t = time.time()
        position = step * self.effective
        state = {
            "step": step, "epoch": position // self.n_blocks, "offset": position % self.n_blocks,
            "samples": position, "tokens": self.tokens, "effective_batch": self.effective,
            "world_size": self.world, "micro_batch": self.micro, "grad_accum": self.accum,
            "seed": self.train.seed, "loss": self.last_loss,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }  # fmt: skip
        path = save_checkpoint(self.run_dir / "checkpoints", step, self.strategy, self.optimizer,
                               state, keep=self.train.keep_checkpoints)  # fmt: skip
        self.events.emit("checkpoint", step=step, path=str(path), seconds=time.time() - t)


def micro_step(
    strategy: Any, input_ids: Any, mask: Any, labels: Any, scale: float, *, autocast: Any,
    loss_dtype: Any, scaler: Any = None, probe: Any = None,
) -> Any:  # fmt: skip
    """Forward, loss and backward of one micro-batch; returns the detached sum of token losses.

    The loss is the sum of token cross-entropies times ``scale`` (world / global target tokens).
    The logits are not kept past the loss: autograd saved what backward needs, and holding them
    would keep one more batch × seq_len × vocab tensor alive through the backward pass.
    ``probe`` (a `memtrack.MemoryProbe`, or None) marks the end of each phase.
    """
    import torch.nn.functional as F

    with autocast():
        logits = strategy.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
    token_loss = F.cross_entropy(logits.to(loss_dtype).flatten(0, 1), labels.flatten(),
                                 ignore_index=-100, reduction="sum")  # fmt: skip
    del logits
    if probe is not None:
        probe.mark("forward")
    scaled = token_loss * scale
    (scaler.scale(scaled) if scaler else scaled).backward()
    if probe is not None:
        probe.mark("backward")
    return token_loss.detach()


def optimizer_step(
    strategy: Any, optimizer: Any, scheduler: Any, scaler: Any, max_grad_norm: float
) -> Any:
    """Unscale (fp16), clip, update, advance the schedule, free the gradients; the grad norm."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = strategy.clip_grad_norm(max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m homelab_dp.train.worker")
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
    from homelab_dp.errors import HomelabError
    from homelab_dp.rundir.files import read_run_spec
    from homelab_dp.train.metrics import EventLog

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
        trainer = Trainer(
            spec, run_dir, events, stop, resume=args.resume or spec.resume
        )
        rc = trainer.run()
        # Leave together: a rank that tears gloo down while a peer is still finishing (writing
        # the result or a report) can make that peer abort ("terminate called without an
        # active exception"), turning a completed run into a failed one.
        dist.barrier()
        return rc
    except HomelabError as exc:
        events.emit("error", force=True, message=exc.message, hint=exc.hint, rank=rank,
                    kind=type(exc).__name__)  # fmt: skip
        print(f"error: {exc.message}\nhint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # any crash: tell the controller which rank, then fail
        if _is_oom(exc):  # with what to change; `run --auto-fit` applies the proposal itself
            from homelab_dp.train.guard import oom_advice

            message, hint, proposal = oom_advice(spec.resolved, exc)
            events.emit("error", force=True, message=message, hint=hint, rank=rank,
                        kind="OutOfMemoryError", proposal=proposal)  # fmt: skip
            print(f"error: {message}\nhint: {hint}", file=sys.stderr)
            return EXIT_FAILED
        events.emit("error", force=True, message=f"{type(exc).__name__}: {exc}", rank=rank,
                    kind=type(exc).__name__)  # fmt: skip
        traceback.print_exc()
        return EXIT_FAILED
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError)


if __name__ == "__main__":
    sys.exit(main())
