"""The per-step statistics of every rank: the one all-gather of a logged step (metric sums,
step time, peak memory, communication) and MFU.

What they become is written by `train.loop.event_log.EventLog`.
"""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from homelab_dp.errors import HomelabError
from homelab_dp.planning.flops import causal_span, flops_per_token, mfu, peak_flops
from homelab_dp.train.model.model_census import any_model_spec
from homelab_dp.train.parallelism.comm_timing import NO_COMM, CommSplit

if TYPE_CHECKING:
    from homelab_dp.runs.run_spec import RunSpec


def peak_memory_kind(device: torch.device) -> str:
    """What ``peak_memory_bytes`` measures on this device."""
    return "cuda_max_allocated" if device.type == "cuda" else "process_rss_peak"


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: ``max_memory_allocated``. CPU: the process's peak resident set size.

    Peak live tensor bytes on the CPU would need a dispatch-mode tracker on every op, which costs
    far more than the 5% throughput budget; the RSS peak is free (one getrusage call).
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def all_gather_flat(out: torch.Tensor, mine: torch.Tensor) -> None:
    """Every rank's ``mine`` concatenated into ``out`` (torch 2.13 renamed the collective)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine)


class RankStats:
    """The one all-gather per logged step: every rank's metric sums, step time, peak memory and
    gradient communication (`train.parallelism.comm_timing.CommSplit`)."""

    TAIL = 4
    """Columns after the sums: step_time_s, peak_memory_bytes, comm_s, exposed_comm_s."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.world = dist.get_world_size()

    def gather(
        self, sums: torch.Tensor, step_time_s: float, comm: CommSplit = NO_COMM
    ) -> list[list[float]]:
        """Rows ``[*sums, step_time_s, peak_memory_bytes, comm_s, exposed_comm_s]``, one per
        rank (float64; every rank gets all); ``sums`` (this rank's metric sums, 1-D, or a
        scalar) must be as long on every rank."""
        sums = sums.detach().reshape(-1).to(torch.float64)
        n = int(sums.numel())
        mine = torch.zeros(n + self.TAIL, dtype=torch.float64, device=self.device)
        mine[:n] = sums
        mine[n] = step_time_s
        mine[n + 1] = float(peak_memory_bytes(self.device))
        mine[n + 2] = comm.comm_seconds
        mine[n + 3] = comm.exposed_seconds
        out = torch.empty(self.world * (n + self.TAIL), dtype=torch.float64, device=self.device)
        all_gather_flat(out, mine)
        return out.view(self.world, n + self.TAIL).tolist()


def device_peak_flops(device: torch.device) -> float | None:
    """One card's dense 16-bit peak (FLOP/s) from its name; None on the CPU or an unknown card."""
    if device.type != "cuda":
        return None

    return peak_flops(torch.cuda.get_device_name(device))


class StepFlops:
    """MFU of logged steps: the run's FLOPs per token against its cards' peak.

    Counts the real tokens of the step event's ``tokens_per_s`` (prompt and answer alike: the
    model computes both; padding it computes too, but it is not useful work). The attention
    term takes a query to see half a block on average, an upper bound for packed samples
    shorter than the block. ``mfu`` is None whenever ``peak`` is.
    """

    def __init__(self, flops_per_token: float, peak: float | None, world_size: int) -> None:
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.world_size = world_size

    @classmethod
    def for_run(
        cls, spec: RunSpec, device: torch.device, seq_len: int, world_size: int
    ) -> StepFlops:
        """From the run spec (model folder, method, checkpointing, LoRA), the block length and
        the ranks really running (a resume may run on another count than the plan's).

        A model whose config.json the spec reader does not know gives no peak: MFU "n/a".
        """

        r, preset = spec.resolved, spec.preset
        peak = device_peak_flops(device)
        try:
            model = any_model_spec(
                preset.model.path,
                trust_remote_code=preset.model.trust_remote_code,
                text_only=preset.model.text_only,
            )
        except HomelabError:
            return cls(0.0, None, world_size)
        per_token = flops_per_token(
            model, method=r.method, activation_checkpointing=r.activation_checkpointing,
            attention_span=causal_span(seq_len), lora_r=preset.lora.r,
            lora_targets=preset.lora.target_modules,
        )  # fmt: skip
        return cls(per_token, peak, world_size)

    def mfu(self, tokens_per_s: float | None) -> float | None:
        """MFU (0..1) at ``tokens_per_s`` real (non-padding) tokens a second over all ranks;
        None without a peak. Padding is computed too, but is not useful work."""

        if tokens_per_s is None or self.peak is None:
            return None
        return mfu(tokens_per_s, self.flops_per_token, self.peak, self.world_size)
