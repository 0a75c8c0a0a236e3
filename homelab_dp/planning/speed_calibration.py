"""Measured training speed, kept per hardware fingerprint: the time model's achieved compute rate.

The time model (`homelab_dp.planning.time_model`) prices a step's compute as its model FLOPs ÷
(the card's dense 16-bit peak × an achieved-MFU factor). The factor starts from a stated
default (`DEFAULT_GPU_FACTOR`); a CPU has no known peak, so there the figure is the model FLOP/s
one thread achieves (`DEFAULT_CPU_FLOPS_PER_THREAD`). Both are replaced by what this machine
measured once it has measured runs: `homelab-dp measure` and every completed run call
`record_speed` with the run's plan document and the tokens/s it measured; later plans on the
same fingerprint read the closest record (`SpeedStore.rate_for`).

What is stored is the compute rate alone: with several processes the exposed communication is
taken out of the step first (the run's ``compute_seconds`` when it measured them), so that the
time model adds communication once, its own way.

The file is ``$XDG_DATA_HOME/homelab-dp/speed.json`` (private to the user), a
`homelab_dp.user_files.fingerprint_store.FingerprintStore` as the memory calibration's is;
nothing here imports torch. It is not trusted: only a regular file of bounded size is read, and
every record is checked (`SpeedRecord.problem`: types, ranges, finite and positive rates); one
that does not pass is left out, said in `SpeedStore.problem`, and gone from the file the next
time it is written.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from homelab_dp.planning.flops import peak_flops
from homelab_dp.user_files import fingerprint_store as fs
from homelab_dp.user_files.fingerprint_store import FingerprintStore, StoredRecord
from homelab_dp.user_files.paths import data_home

DEFAULT_GPU_FACTOR = 0.35
"""Achieved share of a card's dense 16-bit peak before anything is measured: what fine-tunes of
0.5–8B models reach on one card with fused attention and a chunked loss (30–45% is typical;
the lower end, so a first plan promises no more than a card usually gives)."""

CPU_THREAD_SCALING = 0.5
"""How a CPU process's speed grows with its OpenMP threads until two thread counts have been
measured here: as their square root. Measured on a 2-core machine (OpenMP waiting passively,
as CPU runs do; full fine-tunes of 4.2M- and 11.3M-parameter LLaMAs on packed 256-token
blocks): two 1-thread processes ran 0.9× to 1.9× one 2-thread process from run to run
(`python benchmarks/scaling.py --sizes s,m`, tests/integration/test_scaling_prediction.py),
where linear threads would predict 1.0× and no gain from threads 2.0×; the square root puts
7 of 8 two-process points of that table within 30%."""
DEFAULT_CPU_FLOPS_PER_THREAD = 4e9
"""Model FLOP/s one CPU thread achieves in fp32 training before anything is measured: a
conservative guess (a recent AVX2 core peaks at 50–100 GFLOP/s, but training a small model
spends most of its time outside large matmuls); one `homelab-dp measure` replaces it."""


def speed_path() -> Path:
    """``$XDG_DATA_HOME/homelab-dp/speed.json``."""
    return data_home() / "speed.json"


MODEL_KEYS = ("model_type", "params", "layers", "hidden", "vocab")
"""What of the plan's ``model`` block makes two records the same model."""


MAX_RATE = 1e18
"""The largest FLOP/s, FLOPs per token or tokens/s a record may hold (a card peaks near 1e15)."""
MAX_COUNT = 2**20
"""The largest world size or thread count a record may hold."""

RECORD_CHECKS: dict[str, fs.Check] = {
    "fingerprint": lambda v: fs.is_text(v) and bool(v),
    "kind": lambda v: v in ("cuda", "cpu"),
    "model": fs.is_scalar_map,
    "method": fs.is_text,
    "distribution": fs.is_text,
    "activation_checkpointing": lambda v: type(v) is bool,
    "world_size": fs.is_int(1, MAX_COUNT),
    "device": fs.is_text,
    "tokens_per_s": fs.is_number(0, MAX_RATE, above=True),
    "flops_per_token": fs.is_number(0, MAX_RATE, above=True),
    "flops_per_s": fs.is_number(0, MAX_RATE, above=True),
    "threads": fs.is_int(1, MAX_COUNT, optional=True),
    "peak_flops": fs.is_number(0, MAX_RATE, above=True, optional=True),
    "source": fs.is_text,
    "run_id": fs.is_text,
    "time": fs.is_number(0, 1e12),
}
"""What each field of a stored record must be: a rate is finite and positive (a negative one
would predict negative tokens/s; `SpeedRecord.problem` checks them)."""


@dataclass(frozen=True)
class SpeedRecord(StoredRecord):
    """One measured run's compute rate on one machine; a record of the speed file
    (`SpeedStore`)."""

    CHECKS: ClassVar[dict[str, fs.Check]] = RECORD_CHECKS

    fingerprint: str
    """The hardware fingerprint (`homelab_dp.planning.memory.memory_calibration.fingerprint`)."""
    kind: str
    """"cuda" or "cpu"."""
    model: dict[str, Any]
    """The plan's model block, `MODEL_KEYS` only."""
    method: str
    distribution: str
    activation_checkpointing: bool
    world_size: int
    device: str
    """The slowest planned device's name (what set the pace)."""
    tokens_per_s: float
    """Measured tokens a second, every rank together."""
    flops_per_token: float
    """Model FLOPs per trained token of the run (`homelab_dp.planning.flops`)."""
    flops_per_s: float
    """Achieved model FLOP/s of one device's compute (the exposed communication taken out)."""
    threads: int | None = None
    """CPU: threads per process the run had; None on CUDA."""
    peak_flops: float | None = None
    """CUDA: the card's dense 16-bit peak, when the table knows it."""
    source: str = "run"
    """"measure" (`homelab-dp measure`) or "run" (a completed run)."""
    run_id: str = ""
    time: float = 0.0

    @property
    def factor(self) -> float | None:
        """Achieved share of the peak (CUDA with a known peak), else None."""
        return self.flops_per_s / self.peak_flops if self.peak_flops else None

    @property
    def flops_per_thread(self) -> float | None:
        """CPU: achieved model FLOP/s per thread, else None."""
        return self.flops_per_s / self.threads if self.threads else None


@dataclass(frozen=True)
class ComputeRate:
    """What the time model prices compute at, and where it came from."""

    factor: float | None
    """CUDA: the achieved-MFU factor; None on the CPU."""
    flops_per_thread: float | None
    """CPU: achieved model FLOP/s per thread; None on CUDA."""
    source: str
    """"table" (the stated default) or "calibrated" (measured runs on this machine)."""
    words: str
    """Where it came from, for people."""
    threads: int | None = None
    """CPU, calibrated: the threads per process the rate was measured with (None: the
    per-thread default, taken as linear in threads)."""
    thread_scaling: float = 1.0
    """CPU, calibrated: how a process's rate grows with its threads, as (t / threads) to this
    power; fitted from records at two thread counts, else `CPU_THREAD_SCALING`."""

    def cpu_process_flops(self, threads: int) -> float:
        """CPU: one process's achieved FLOP/s with ``threads`` threads."""
        per = self.flops_per_thread or 0.0
        if not self.threads:
            return per * threads
        return per * self.threads * (threads / self.threads) ** self.thread_scaling


def default_rate(kind: str) -> ComputeRate:
    """The stated default of ``kind`` (nothing measured)."""
    if kind == "cpu":
        return ComputeRate(None, DEFAULT_CPU_FLOPS_PER_THREAD, "table",
                           f"assumed {DEFAULT_CPU_FLOPS_PER_THREAD / 1e9:.0f} GFLOP/s per CPU "
                           "thread (`homelab-dp measure` calibrates it)")  # fmt: skip
    return ComputeRate(DEFAULT_GPU_FACTOR, None, "table",
                       f"assumed {DEFAULT_GPU_FACTOR:.0%} of the card's peak (`homelab-dp "
                       "measure` calibrates it)")  # fmt: skip


class SpeedStore(FingerprintStore[SpeedRecord]):
    """The speed file: records of every fingerprint seen on this account (its ``problem``:
    what could not be read, see `FingerprintStore`); the oldest of a fingerprint go beyond
    `homelab_dp.user_files.fingerprint_store.KEEP_PER_FINGERPRINT`."""

    def __init__(self, path: Path | None = None) -> None:
        super().__init__(path or speed_path(), "records", SpeedRecord)

    def rate_for(
        self, fingerprint: str | None, kind: str, model: dict[str, Any], method: str,
        activation_checkpointing: bool, threads: int | None = None,
    ) -> ComputeRate:  # fmt: skip
        """The compute rate of a plan: the closest record of this fingerprint, else the default.

        Closest: the same model, method and checkpointing; else the same model; else the same
        method; else any record of the machine. Among equals the newest three are averaged
        (one slow step of a busy machine does not decide alone). On the CPU a record made with
        ``threads`` threads per process comes first within its tier: a thread's speed depends on
        how many share the process (the per-thread figure is only extrapolated across counts).
        """
        mine = [
            r for r in self.of(fingerprint) if (r.factor if kind == "cuda" else r.flops_per_thread)
        ]
        if not mine:
            return default_rate(kind)
        key = {k: model.get(k) for k in MODEL_KEYS}

        def tier(r: SpeedRecord) -> int:
            same_model = r.model == key
            same_method = r.method == method
            if (
                same_model
                and same_method
                and r.activation_checkpointing == activation_checkpointing
            ):
                return 0
            return 1 if same_model else 2 if same_method else 3

        best = min(tier(r) for r in mine)
        same = [r for r in mine if tier(r) == best]
        if threads and any(r.threads == threads for r in same):
            same = [r for r in same if r.threads == threads]
        chosen = sorted(same, key=lambda r: r.time)[-3:]
        what = ("this model and method", "this model", "this method", "other models")[best]
        words = f"calibrated from {len(chosen)} measured run(s) of {what} on this machine"
        if kind == "cuda":
            factor = sum(r.factor or 0.0 for r in chosen) / len(chosen)
            return ComputeRate(factor, None, "calibrated", f"{factor:.0%} of the peak, {words}")
        counts = {r.threads for r in chosen}
        at = counts.pop() if len(counts) == 1 else None
        per = sum(r.flops_per_thread or 0.0 for r in chosen) / len(chosen)
        alpha, fitted = thread_scaling([r for r in mine if tier(r) == best])
        how = f"threads scale as ^{alpha:.2f}" + (" (fitted here)" if fitted else " (assumed)")
        return ComputeRate(None, per, "calibrated",
                           f"{per / 1e9:.1f} GFLOP/s per thread at {at or '?'} thread(s), {how}, "
                           f"{words}", threads=at, thread_scaling=alpha)  # fmt: skip


def thread_scaling(records: list[SpeedRecord]) -> tuple[float, bool]:
    """The exponent of a CPU process's FLOP/s in its threads, fitted from the newest records at
    the fewest and the most threads (0 to 1), and whether it was fitted; `CPU_THREAD_SCALING`
    when fewer than two thread counts were measured."""
    by_threads: dict[int, SpeedRecord] = {}
    for r in sorted(records, key=lambda r: r.time):
        if r.threads:
            by_threads[r.threads] = r
    if len(by_threads) < 2:
        return CPU_THREAD_SCALING, False
    lo, hi = by_threads[min(by_threads)], by_threads[max(by_threads)]
    assert lo.threads and hi.threads
    if lo.flops_per_s <= 0 or hi.flops_per_s <= 0:
        return CPU_THREAD_SCALING, False
    alpha = math.log(hi.flops_per_s / lo.flops_per_s) / math.log(hi.threads / lo.threads)
    return min(1.0, max(0.0, alpha)), True


def record_speed(
    plan_doc: dict[str, Any],
    *,
    tokens_per_s: float,
    source: str = "run",
    run_id: str = "",
    step_seconds: float | None = None,
    compute_seconds: float | None = None,
    path: Path | None = None,
) -> Path | None:
    """Record what a run of ``plan_doc`` (its `plan --json` document, as the run's spec.json
    carries it) measured; the file written, or None when nothing can be recorded.

    ``tokens_per_s``: measured, every rank together (after the first steps: the steady state).
    ``step_seconds`` and ``compute_seconds`` (the step's time and its part not waiting on
    communication, as step events give them): with both, the exposed communication is taken
    out, so the record is the compute rate alone; without them the exposed communication the
    plan predicted is taken out instead (at most half the step; one process has none).
    Nothing is recorded for a plan of hardware that is not
    here (no fingerprint), a plan made before the time model (no ``predicted`` block), a GRPO
    run (its tokens/s includes generation, which is not compute: `planning.grpo_plan` prices
    it apart), or a speed that is not finite and positive.
    """
    fp = (plan_doc.get("calibration") or {}).get("fingerprint")
    predicted = plan_doc.get("predicted") or {}
    assumed = predicted.get("assumptions") or {}
    per_token = predicted.get("flops_per_token")
    if (
        predicted.get("generation_engine")
        or not fp
        or not per_token
        or not tokens_per_s
        or not math.isfinite(tokens_per_s)
        or tokens_per_s <= 0
    ):
        return None
    hw = plan_doc.get("hardware") or {}
    kind = str(hw.get("kind", "cuda"))
    training = plan_doc.get("training") or {}
    world = int(training.get("world_size") or 1)
    per_device = tokens_per_s / world * float(per_token)
    if step_seconds and compute_seconds and 0 < compute_seconds <= step_seconds:
        per_device *= step_seconds / compute_seconds  # the step less its exposed communication
    elif world > 1 and predicted.get("exposed_comm_seconds") and predicted.get("tokens_per_step"):
        # not measured: take out the communication the plan predicted (at most half the step)
        step = float(predicted["tokens_per_step"]) / tokens_per_s
        compute = max(step - float(predicted["exposed_comm_seconds"]), step / 2)
        per_device *= step / compute
    device = str(predicted.get("pace_device") or "")
    threads = assumed.get("threads_per_process") if kind == "cpu" else None
    if not fs.is_number(0, MAX_RATE, above=True)(per_device):
        return None  # a figure no record may hold (a plan's FLOPs per token not finite)
    record = SpeedRecord(
        fingerprint=str(fp),
        kind=kind,
        model={k: (plan_doc.get("model") or {}).get(k) for k in MODEL_KEYS},
        method=str(plan_doc.get("method")),
        distribution=str(plan_doc.get("distribution")),
        activation_checkpointing=bool(training.get("activation_checkpointing")),
        world_size=world,
        device=device,
        tokens_per_s=float(tokens_per_s),
        flops_per_token=float(per_token),
        flops_per_s=per_device,
        threads=int(threads) if threads else None,
        peak_flops=peak_flops(device) if kind == "cuda" and device else None,
        source=source,
        run_id=run_id,
        time=time.time(),
    )
    store = SpeedStore(path)
    store.add(record)
    return store.save()
