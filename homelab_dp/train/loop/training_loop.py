"""One rank's optimizer-step loop: micro-steps, the step, logging, checkpoints, the end.

Exactness: optimizer step i consumes global samples [i·E, (i+1)·E), E = micro × world ×
accumulation; on micro-step k rank r takes the M samples starting at i·E + (k·W + r)·M. The loss
is the sum of token losses divided by the number of target tokens in the whole effective batch,
times the world size because DDP and FSDP2 average gradients. So N ranks × micro m equals one
process with micro N·m, or with accumulation, on any data, and a resumed run repeats an
uninterrupted one bit for bit. Every rank holds the whole data set and the seeded sample order,
so each counts the step's global target tokens itself: no collective and no host sync before
the forward passes.

Graceful stop: SIGTERM or SIGINT sets a `StopFlag`; the ranks agree at an optimizer-step
boundary, save a checkpoint, write an ``end`` event with reason "stopped" and return. The vote
is an asynchronous all-reduce on a CPU (gloo) group of its own, sent at the start of a step and
read at the start of the next, so it never waits on the GPU: a stop lands at the second boundary
after the signal at the latest. ``HOMELAB_DP_STOP_AT_STEP=k`` (tests only) votes to stop at
boundary k, so the run stops once exactly k optimizer steps are done.

Validation (`train.evaluation.validator`): with eval data, every rank evaluates it every
``train.eval_every`` steps and at the last (rank 0 writes an ``eval`` event); a new best loss
with ``train.keep_best`` gets its checkpoint kept (`train.loop.checkpoints.mark_best`), and
``train.early_stopping_patience`` evaluations without one end the run as "early_stopped": a
completed run before its last step, checkpoint and result saved.

Safety (`train.loop.rank_guard`): every micro-step writes the rank's heartbeat for the keeper's watchdog
and checks that the torchrun agent is still its parent (if not, the rank stops gracefully). A
checkpoint beats on a timer while it is written; the result is written (and merged) by rank 0 in
a thread while every rank beats and meets the others in a short all-reduce each second, so a
save or merge of any length is neither a stall nor a collective timeout.

Divergence (`train.loop.divergence`): a logged loss that is not finite, non-finite weights before a
checkpoint, or `SKIP_LIMIT` fp16 steps in a row skipped by the GradScaler end the run with an
``error`` event (exit 1), its last good checkpoint kept.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from homelab_dp.runs.folder.heartbeats import CHECKPOINT, SAVING_RESULT
from homelab_dp.runs.run_events import (
    CheckpointEvent,
    EndEvent,
    MicroEvent,
    StepEvent,
    StragglerEvent,
)
from homelab_dp.runs.run_spec import RunSpec
from homelab_dp.runs.run_view import StragglerDetector
from homelab_dp.train.evaluation.validator import Validator
from homelab_dp.train.loop.checkpoints import mark_best, save_checkpoint, save_result
from homelab_dp.train.loop.divergence import SkippedSteps, check_loss, require_finite_weights
from homelab_dp.train.loop.length_groups import group_by_length
from homelab_dp.train.loop.rank_setup import SetUp
from homelab_dp.train.loop.rank_stats import RankStats, StepFlops, peak_memory_kind
from homelab_dp.train.loop.sample_answers import Sampler
from homelab_dp.train.model.packed_attention import take_route_counts
from homelab_dp.train.parallelism.comm_timing import comm_event_fields
from homelab_dp.train.parallelism.strategy import rank_slices

if TYPE_CHECKING:  # torch stays out of the worker's import until it is set up
    from homelab_dp.train.loop.divergence import SkippedSteps

STOP_AT_ENV = "HOMELAB_DP_STOP_AT_STEP"

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


class StopVotes:
    """The ranks' stop votes: asynchronous all-reduces on a gloo group of their own.

    On the CPU, never on the GPU: reading a vote then costs no device synchronisation, and the
    vote cannot queue behind the training's collectives. Every rank creates the group (a
    collective) and sends its votes at the same points, so the all-reduces pair up.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo")

    def send(self, stop: bool) -> tuple[Any, Any]:
        """Start the all-reduce of this rank's vote; `agreed` reads it."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if stop else 0], dtype=torch.int32)
        return flag, dist.all_reduce(flag, group=self.group, async_op=True)

    @staticmethod
    def agreed(vote: tuple[Any, Any]) -> bool:
        """Whether any rank voted to stop (waits for the all-reduce if it is still running)."""
        flag, work = vote
        work.wait()
        return int(flag.item()) > 0


class Trainer:
    """Trains a set-up rank to the end or to a stop, then checkpoints and saves the result."""

    def __init__(
        self, spec: RunSpec, run_dir: Path, s: SetUp, events: Any, stop: StopFlag, guard: Any,
        t_start: float,
    ) -> None:  # fmt: skip
        import torch

        self.spec, self.run_dir, self.events, self.stop = spec, run_dir, events, stop
        self.guard = guard
        """`train.loop.rank_guard.RankGuard`: heartbeats and the orphan check."""
        self.t_start = t_start
        self.train = spec.preset.train
        self.rank, self.data, self.model, self.memory = s.rank, s.data, s.model, s.memory
        self.start_step, self.tokens = s.position.start_step, s.position.tokens
        self.last_loss = s.position.last_loss
        self.stop_at = int(os.environ.get(STOP_AT_ENV, "-1"))
        self.stats = RankStats(self.rank.device)
        self.objective = s.objective
        """`train.objectives.objective.Objective`: units, micro-step loss and event fields."""
        self.units = self.objective.units(self.data)
        """The objective's unit counts per block, ``[n_blocks, U]`` (SFT: target tokens)."""
        self.step_counts = torch.cat(
            [self.units, self.data.real_tokens.to(torch.float64)[:, None]], dim=1
        )
        """``units`` and the real tokens per block side by side (float64: whole numbers below
        2^53 sum exactly, in any order)."""
        self.step_rows: list[list[float]] = self.step_counts.tolist()
        """`step_counts` on the host, read once: a step's counts are sums in Python, no read."""
        self.stragglers = StragglerDetector()
        self.memory_kind = peak_memory_kind(self.rank.device)
        self.votes = StopVotes()
        self.flops = StepFlops.for_run(
            spec, self.rank.device, int(self.data.input_ids.shape[-1]), self.rank.world
        )
        self.saved_step: int | None = None
        take_route_counts()  # the routes count from the loop's first forward (no checks before)
        self.routes_reported = False
        """Whether a step event carried ``attention_routes`` (the first of this launch does)."""

        self.skips = SkippedSteps()
        """fp16: the GradScaler's consecutive skipped steps (`train.loop.divergence`)."""
        """The step of the checkpoint written last by this run (none is written twice)."""
        self.validator = None
        if self.data.eval is not None and not self.memory.measuring:
            self.validator = Validator(
                self.data.eval,
                self.train.eval_every,
                self.train.early_stopping_patience,
                objective=self.objective,
                pairs=self.data.eval_pairs,
            )
            self.validator.restore(s.position.eval_state)
        self.sampler = None
        """`train.loop.sample_answers.Sampler`: answers to the sample prompts (``train.sample_every``)."""
        if self.train.sample_every != "off" and not self.memory.measuring:
            self.sampler = Sampler(spec.preset, self.data, self.model, self.rank)

    def run(self) -> None:
        """Train, then checkpoint, save the result (when completed) and write the end event."""
        reason, step = self._loop()
        if self.memory.measuring:  # `homelab-dp measure`: figures only, no checkpoint or result
            self.memory.report(self.events, mode="measure")
            self.events.write(EndEvent(reason="measured", final_loss=self.last_loss, steps=step,
                                       seconds=time.time() - self.t_start, final_path=None))  # fmt: skip
            return
        if step > 0 and step != self.saved_step:
            self._checkpoint(step)
        final = None
        if reason in ("completed", "early_stopped"):
            m = self.model
            # Rank 0 writes (and merges) in a thread; every rank beats and meets the others in a
            # short all-reduce each second until it is done: no watchdog or collective timeout
            # fires however long the save takes (`RankGuard.on_rank0`).
            on_rank0 = functools.partial(
                self.guard.on_rank0, step=step, phase=SAVING_RESULT, device=self.rank.device
            )
            final = save_result(self.run_dir, m.strategy, m.loaded.is_peft, self.data.tokenizer,
                                self.spec.preset, step=step, on_rank0=on_rank0)  # fmt: skip
        self.events.write(EndEvent(reason=reason, final_loss=self.last_loss, steps=step,
                                   seconds=time.time() - self.t_start,
                                   final_path=str(final) if final else None))  # fmt: skip

    def _loop(self) -> tuple[str, int]:
        """Optimizer steps until the last one ("completed"), an agreed stop ("stopped") or an
        early stop ("early_stopped")."""
        import torch

        r, d, m = self.rank, self.data, self.model
        dev, step = r.device, self.start_step
        last_log = (time.time(), self.tokens, step)  # time, tokens and step of the last log
        vote = self.votes.send(self.stop.requested or step == self.stop_at)
        while step < d.total_steps:
            if self.votes.agreed(vote):
                return "stopped", step
            # Sent now, read at the next boundary: long done by then, so no rank waits for it.
            vote = self.votes.send(self.stop.requested or step + 1 == self.stop_at)
            t0 = time.perf_counter()
            wall0 = time.time()
            probe = self.memory.begin_step(step, m.strategy, m.optimizer)  # None mostly
            # Every rank's blocks of this step, from the shared order: the loss's denominators
            # (the objective's units: SFT's target tokens, pairs, ...) and the throughput (real
            # tokens), counted on the host; this rank's micro-batches are slices of them.
            # An objective may train several steps on one batch (GRPO's iterations: `repeat`).
            at = step // getattr(self.objective, "repeat", 1)
            first = at * r.effective
            whole = d.order.indices(first, r.effective)
            if d.grouped:  # unpacked rows of a recurrent model: similar lengths together
                whole = group_by_length(whole, d.real_tokens)
                rows = whole.tolist()
            else:  # the same indices as Python ints, read once an epoch
                rows = d.order.rows(first, r.effective)
            slices = rank_slices(at, r.micro, r.data_world, r.accum, r.data_rank)
            micro_idx = [whole[s.start - first : s.stop - first] for s in slices]
            micro_rows = [rows[s.start - first : s.stop - first] for s in slices]
            step_rows = [self.step_rows[i] for i in rows]
            *counts, real = (sum(col) for col in zip(*step_rows, strict=True))
            tokens = int(real)
            obj = self.objective
            obj.begin_step(m, d, r, micro_idx)
            sums = torch.zeros(len(obj.metrics), dtype=torch.float64, device=dev)
            for k, idx in enumerate(micro_idx):
                if self.guard.beat(step + 1, k):  # orphaned (agent gone): stop gracefully
                    self.stop.requested = True
                with m.strategy.accumulate(final=k == r.accum - 1):
                    sums += obj.micro_step(m, d, idx, counts, r, probe=probe, rows=micro_rows[k])
                if r.accum > 1 and r.rank == 0:
                    self.events.write(
                        MicroEvent(step=step + 1, micro_step=k + 1, grad_accum=r.accum)
                    )
            lr = m.optimizer.param_groups[0]["lr"]
            grad_norm = optimizer_step(m.strategy, m.optimizer, m.scheduler, m.scaler,
                                       self.train.max_grad_norm, skips=self.skips,
                                       step=step + 1)  # fmt: skip
            self.memory.end_step(step, self.events)
            step += 1
            self.tokens += tokens
            if step % self.train.log_every == 0 or step == d.total_steps:
                last_log = self._log_step(step, sums, counts, lr, grad_norm, t0, wall0, last_log)
            # Evaluated before the checkpoint of this step, so that it records the evaluation.
            v = self.validator
            outside = m.strategy.comm.outside_step  # no step's communication (`comm_timing`)
            verdict = None
            if v is not None and v.due(step, d.total_steps):
                with outside():
                    verdict = self._validate(step)
            if verdict is not None:  # the training throughput leaves the evaluation out
                last_log = (last_log[0] + verdict.event.seconds, last_log[1], last_log[2])
            # Before the checkpoint too; the samples leave the random states and weights as
            # they were, so the checkpoint (its RNG states included) is that of a run without.
            ending = verdict is not None and verdict.stop
            if self.sampler is not None and self.sampler.due(
                step, d.total_steps, evaluated=verdict is not None, ending=ending
            ):
                with outside():
                    seconds = self._sample(step)
                last_log = (last_log[0] + seconds, last_log[1], last_log[2])
            keep = verdict is not None and verdict.best and self.train.keep_best
            every = self.train.checkpoint_every
            if keep or (every and step % every == 0 and step < d.total_steps):
                with outside():
                    self._checkpoint(step)
            if keep and r.rank == 0:  # after the write: BEST names a complete checkpoint
                mark_best(self.run_dir / "checkpoints", step, verdict.event.loss or 0.0,
                          self.train.keep_checkpoints)  # fmt: skip
            if verdict is not None and verdict.stop:
                self.votes.agreed(vote)
                return "early_stopped", step
        self.votes.agreed(vote)  # finish the last vote: no collective left in flight
        return "completed", step

    def _validate(self, step: int) -> Any:
        """Evaluate (every rank) and write the ``eval`` event; the `train.evaluation.validator.Verdict`
        (best so far, early stop). Every rank has the same loss, so every rank decides alike."""
        v = self.validator
        assert v is not None
        result = v.evaluate(step, self.model, self.rank, self.guard)
        verdict = v.record(step, result)
        self.events.write(verdict.event)
        log.info("eval after step %d: loss %.4f over %d tokens (%.1f s)", step, result.loss,
                 result.tokens, result.seconds)  # fmt: skip
        if verdict.stop:
            log.warning("early stopping after step %d: no lower eval loss in %d evaluations "
                        "(best %.4f at step %s)", step, v.since_best, v.best_loss,
                        v.best_step)  # fmt: skip
        return verdict

    def _sample(self, step: int) -> float:
        """Answer the sample prompts (every rank) and write the ``sample`` events (rank 0);
        the seconds it took."""
        assert self.sampler is not None
        t0 = time.perf_counter()
        samples = self.sampler.generate(step, self.guard)
        for event in samples:  # written by rank 0 (`EventLog`)
            self.events.write(event)
        log.info("samples after step %d: %d answer(s), %d tokens (%.1f s)", step, len(samples),
                 sum(e.tokens for e in samples), time.perf_counter() - t0)  # fmt: skip
        return time.perf_counter() - t0

    def _log_step(
        self, step: int, sums: Any, counts: list[float], lr: float, grad_norm: Any, t0: float,
        wall0: float, last_log: tuple[float, int, int],
    ) -> tuple[float, int, int]:  # fmt: skip
        """Gather every rank's figures (one all-gather), write the step and any straggler.

        ``sums`` are this rank's metric sums of the step (`Objective.micro_step`), ``counts``
        the step's global units; the objective turns their totals into the event's fields."""
        import torch

        r, dev = self.rank, self.rank.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        now = time.time()
        # The step's communication was read off the strategy's timer only now (a logged step).
        comm = self.model.strategy.comm.read()
        # The grad norm (every rank's is the global one) rides with the sums: one read.
        norm = torch.as_tensor(grad_norm).detach().reshape(1).to(dev, torch.float64)
        mine = torch.cat([sums.detach().reshape(-1).to(torch.float64), norm])
        rows = self.stats.gather(mine, time.perf_counter() - t0, comm)
        n = len(self.objective.metrics)
        totals = [sum(row[j] for row in rows) for j in range(n)]
        grad_norm_value = rows[0][n]
        fields = self.objective.fields(totals, counts)
        loss = fields.pop("loss")

        # Every rank has the same rows: all end here together, before a NaN reaches an event.
        check_loss(loss, step, lr=lr, dtype=self.spec.resolved.dtype)
        self.last_loss = loss
        last_t, last_tokens, last_step = last_log
        span = max(now - last_t, 1e-9)
        tokens_per_s = (self.tokens - last_tokens) / span
        aux_loss = self.model.strategy.take_aux_loss()  # every rank: a collective with an aux
        routes = None
        if not self.routes_reported:  # what ran, counted: homelab_packed's calls by route
            routes, self.routes_reported = take_route_counts(), True
        self.events.write(StepEvent(
            step=step, total_steps=self.data.total_steps,
            epoch=step * r.effective / self.data.n_blocks, loss=self.last_loss, lr=lr,
            grad_norm=grad_norm_value, tokens_per_s=tokens_per_s,
            samples_per_s=(step - last_step) * r.effective / span, micro_batch=r.micro,
            grad_accum=r.accum, world_size=r.world, effective_batch=r.effective,
            step_time_s=now - wall0, rank_step_times_s=[row[n + 1] for row in rows],
            peak_memory_bytes=[int(row[n + 2]) for row in rows], peak_memory_kind=self.memory_kind,
            tokens=self.tokens, samples=step * r.effective, mfu=self.flops.mfu(tokens_per_s),
            aux_loss=aux_loss, attention_routes=routes, **fields,
            **comm_event_fields(rows, r.world),
        ))  # fmt: skip
        for slow in self.stragglers.update([row[n + 1] for row in rows]):
            self.events.write(
                StragglerEvent(step=step, rank=slow, message=self.stragglers.flagged[slow])
            )
        return now, self.tokens, step

    def _checkpoint(self, step: int) -> None:
        """Save a checkpoint of ``step`` with the position, schedule and scaler state."""

        t = time.time()
        r, m, n_blocks = self.rank, self.model, self.data.n_blocks

        # Never a checkpoint of inf/NaN weights: the last good one stays the newest.
        require_finite_weights(m.strategy.inner, step, r.device)
        position = -(-step // getattr(self.objective, "repeat", 1)) * r.effective  # data used
        state = {
            "step": step, "epoch": position // n_blocks, "offset": position % n_blocks,
            "samples": position, "tokens": self.tokens, "effective_batch": r.effective,
            "world_size": r.world, "micro_batch": r.micro, "grad_accum": r.accum,
            "seed": self.train.seed, "loss": self.last_loss,
            "scheduler": m.scheduler.state_dict(),
            "scaler": m.scaler.state_dict() if m.scaler is not None else None,
            "eval": self.validator.state() if self.validator is not None else None,
        }  # fmt: skip
        saved = getattr(self.objective, "checkpoint_state", None)  # GRPO: a batch to reuse
        state["objective"] = saved(r) if saved is not None else None
        with self.guard.beating(step, CHECKPOINT):  # a long write is not a stall
            path = save_checkpoint(self.run_dir / "checkpoints", step, m.strategy, m.optimizer,
                                   state, keep=self.train.keep_checkpoints)  # fmt: skip
        self.saved_step = step
        self.events.write(CheckpointEvent(step=step, path=str(path), seconds=time.time() - t))


def optimizer_step(
    strategy: Any, optimizer: Any, scheduler: Any, scaler: Any, max_grad_norm: float,
    *, skips: SkippedSteps | None = None, step: int = 0,
) -> Any:  # fmt: skip
    """Unscale (fp16), clip, update, advance the schedule, free the gradients; the grad norm.

    ``skips`` counts the scaler's consecutive skipped steps (fp16) and ends the run at its
    limit (`train.loop.divergence.SkippedSteps`); ``step`` is the optimizer step (1-based)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = strategy.clip_grad_norm(max_grad_norm)
    if scaler is not None and skips is not None:
        skips.step(scaler, optimizer, step)
    elif scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    strategy.zero_grad(optimizer)  # DDP's bucket views are zeroed in place, the rest freed
    return grad_norm
