"""The pair evaluation worker: DPO loss and rewards of a model on preference pairs, per rank.

    torchrun … -m homelab_dp.train.evaluation.pair_evaluation JOB_FILE

`homelab_dp.app.evaluate` writes JOB_FILE (the SFT eval's keys, `homelab_dp.train.evaluation.eval_worker`,
plus ``reference``, ``beta``, ``loss_type`` and ``label_smoothing``) when ``--data`` holds
preference pairs. Each rank joins the group, reads the pairs from the token cache the front end
filled (`homelab_dp.data.samples.load_pairs`, one pair per block: two padded rows,
chosen and rejected, with their attention mask; pairs whose chosen and rejected responses are
the same tokens are left out, as training leaves them out), loads the model as the SFT eval
does (`train.evaluation.eval_worker.load_model`) and its reference:

- ``reference`` null: the model itself with its adapters disabled (an adapter result: the base
  it was trained from, NF4 for a QLoRA run, exactly as training computed the reference);
- else a second model (``model_path``/``base_path``/``quantized`` as for the policy): a full or
  merged result's starting model, or ``--reference``.

Every rank takes every world-th pair, computes both models' per-sequence log-probabilities of the
response tokens in fp64 (`train.objectives.preference_losses.sequence_log_probs`), the per-pair
DPO loss and rewards (`dpo_loss`; IPO on length-averaged log-probabilities), and sums them in
fp64; one all-reduce gives the means over every pair, whatever the split: ``loss``,
``rewards_chosen``, ``rewards_rejected``, ``reward_margin`` (their difference) and
``reward_accuracy`` (the share of pairs whose chosen reward is strictly the higher, TRL's rule).
Rank 0 writes the result JSON to ``result_path``; a failing rank writes ``error_dir/rank-N.json``
(`train.evaluation.eval_worker.main`'s contract: exit 2 for bad input, 1 for anything else).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from homelab_dp.data.preference_blocks import PairBlock, pair_blocks_of
from homelab_dp.data.samples import load_pairs
from homelab_dp.presets.preset import DataSection
from homelab_dp.train.evaluation.eval_loss import rank_batches
from homelab_dp.train.evaluation.eval_worker import (
    DTYPE_NAMES,
    base_of,
    eval_dtype,
    forward_tokens,
    join_group,
    load_model,
    run_worker,
)
from homelab_dp.train.objectives.preference_losses import dpo_loss, sequence_log_probs

log = logging.getLogger("homelab_dp.pair_eval_worker")


def load_pair_blocks(job: dict[str, Any], tokenizer: Any) -> tuple[list[PairBlock], int]:
    """The pairs as unpacked blocks (two rows of ``seq_len``) and the identical pairs left out."""
    data = DataSection(path=job["data_path"], format=job["format"], seq_len=int(job["seq_len"]),
                       pack=False, split=job.get("split", "train"))  # fmt: skip
    loaded = load_pairs(data, tokenizer, objective="dpo", seq_len_limit=None, field="--data")
    return pair_blocks_of(loaded.pairs, data, loaded.fmt, loaded.pad_id, seed=0,
                          where=loaded.label, min_blocks=1)  # fmt: skip


@dataclass(frozen=True)
class PairTensors:
    """Unpacked pair blocks as host tensors: rows 2k (chosen) and 2k+1 (rejected) of pair k."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor

    @property
    def n_pairs(self) -> int:
        return int(self.input_ids.shape[0]) // 2


def pair_tensors(blocks: list[PairBlock]) -> PairTensors:
    """`PairTensors` of unpacked blocks (each one pair: its chosen row, then its rejected row)."""

    def rows(name: str) -> torch.Tensor:
        return torch.tensor([r for b in blocks for r in getattr(b, name)], dtype=torch.long)

    return PairTensors(rows("input_ids"), rows("labels"), rows("attention_mask"),
                       rows("position_ids"))  # fmt: skip


@dataclass(frozen=True)
class PairSums:
    """Sums over every pair evaluated (all ranks after `evaluate_pairs`)."""

    loss: float
    chosen_rewards: float
    rejected_rewards: float
    correct: float
    """Pairs whose chosen reward is strictly above the rejected one."""
    pairs: int
    seconds: float

    def means(self) -> dict[str, float | None]:
        """The per-pair means (None without pairs)."""
        n = self.pairs
        if not n:
            return dict.fromkeys(("loss", "rewards_chosen", "rewards_rejected", "reward_margin",
                                  "reward_accuracy"))  # fmt: skip
        return {
            "loss": self.loss / n,
            "rewards_chosen": self.chosen_rewards / n,
            "rewards_rejected": self.rejected_rewards / n,
            "reward_margin": (self.chosen_rewards - self.rejected_rewards) / n,
            "reward_accuracy": self.correct / n,
        }


def _log_probs(model: Any, batch: dict[str, torch.Tensor], labels: torch.Tensor,
               sequence: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-row (sequence) fp64 log-probability sums and token counts of one forward."""
    logits = model(**batch, use_cache=False).logits
    return sequence_log_probs(logits, labels, sequence, labels.shape[0], dtype=torch.float64)


@torch.no_grad()
def evaluate_pairs(
    model: Any,
    reference: Any,
    pairs: PairTensors,
    *,
    rank: int,
    world: int,
    micro: int,
    device: torch.device,
    beta: float,
    loss_type: str,
    label_smoothing: float,
) -> PairSums:
    """The summed DPO loss and rewards of ``model`` against ``reference`` (None: ``model`` with
    its adapters disabled) over this rank's pairs, all-reduced (call it on every rank)."""
    t0 = time.perf_counter()
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    for idx in rank_batches(pairs.n_pairs, rank, world, micro):
        if not idx:  # no collective inside a forward here: a rank short of pairs just waits
            continue
        rows = [r for k in idx for r in (2 * k, 2 * k + 1)]
        mask = pairs.mask[rows]
        width = int(mask.sum(1).max())  # only padding is cut
        batch = {
            "input_ids": pairs.input_ids[rows, :width].to(device),
            "attention_mask": mask[:, :width].to(device),
            "position_ids": pairs.positions[rows, :width].to(device),
        }
        labels = pairs.labels[rows, :width].to(device)
        sequence = torch.arange(len(rows), device=device)[:, None].expand(-1, width)
        sequence = sequence.masked_fill(batch["attention_mask"] == 0, -1)
        policy, counts = _log_probs(model, batch, labels, sequence)
        if reference is None:
            with model.disable_adapter():
                ref, _ = _log_probs(model, batch, labels, sequence)
        else:
            ref, _ = _log_probs(reference, batch, labels, sequence)
        if loss_type == "ipo":  # IPO compares length-averaged log-probabilities (TRL's rule)
            policy, ref = policy / counts, ref / counts
        losses, chosen, rejected = dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2],
                                            beta=beta, loss_type=loss_type,
                                            label_smoothing=label_smoothing)  # fmt: skip
        totals += torch.stack([losses.sum(), chosen.sum(), rejected.sum(),
                               (chosen > rejected).double().sum(),
                               torch.tensor(float(len(idx)), dtype=torch.float64, device=device)])  # fmt: skip
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(totals)
    loss, c, r, correct, n = (float(v) for v in totals.tolist())
    return PairSums(loss, c, r, correct, int(n), time.perf_counter() - t0)


def load_reference(job: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    """The reference model of ``job["reference"]`` (None: the policy's adapters disabled)."""
    spec = job.get("reference")
    if spec is None:
        return None
    ref_job = {**job, **spec}
    return load_model(ref_job, device, dtype, base_of(ref_job, device, dtype))


def pair_evaluate_job(job: dict[str, Any]) -> dict[str, Any] | None:
    """Run this rank's share; rank 0 returns the result document, the others None."""
    from transformers import AutoTokenizer

    device, rank, world = join_group(job["device"])
    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer_path"], local_files_only=True,
                                              trust_remote_code=bool(job["trust_remote_code"]))  # fmt: skip
    blocks, identical = load_pair_blocks(job, tokenizer)
    dtype = eval_dtype(device, job["dtype"])
    base_kind = base_of(job, device, dtype)
    model = load_model(job, device, dtype, base_kind)
    reference = load_reference(job, device, dtype)
    width = 2 * int(job["seq_len"])
    micro = max(1, forward_tokens(model, device.type, chunked=False) // width)
    log.info("%d pairs, %d per forward, %s on %s, world %d, reference: %s", len(blocks), micro,
             dtype, device, world, "adapters disabled" if reference is None else "second model")  # fmt: skip
    sums = evaluate_pairs(model, reference, pair_tensors(blocks), rank=rank, world=world,
                          micro=micro, device=device, beta=float(job["beta"]),
                          loss_type=str(job["loss_type"]),
                          label_smoothing=float(job["label_smoothing"]))  # fmt: skip
    if rank != 0:
        return None
    return {
        "world_size": world,
        **sums.means(),
        "pairs": sums.pairs,
        "identical": identical,
        "seconds": sums.seconds,
        "device": device.type,
        "dtype": DTYPE_NAMES[str(dtype)],
        "base": base_kind,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank; returns the process exit code (`train.evaluation.eval_worker.run_worker`:
    the SFT eval worker's contract)."""
    return run_worker(argv, pair_evaluate_job, "the pair eval worker",
                      "use `homelab-dp eval MODEL --data PAIRS`")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
