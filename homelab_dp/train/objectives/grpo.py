"""GRPO: the objective that generates its own training data and learns from rewards.

The unit is the prompt (``train.micro_batch`` prompts a micro-step, each with
``grpo.generations`` completions). `GrpoObjective.begin_step` does what the whole effective batch
must agree on before the first micro-step:

1. every rank generates the group of each of its own prompts (its micro-batches' blocks) with
   the weights it trains (`train.objectives.grpo_generation`: exact on 1 or N processes);
2. scores them (`train.objectives.reward_functions.Rewards`, user functions in a process of their own);
3. all-gathers every rank's per-completion figures (reward totals and each reward, lengths,
   truncation), so every rank has the whole batch in the global prompt order: the advantages
   (`grpo_losses.advantages`, ``scale_rewards = "batch"`` over the whole batch), the loss's
   denominator (dapo: the batch's completion tokens) and the event's figures are the same on
   every rank and for any world size;
4. rank 0 writes ``rollouts/step-NNNNNN.jsonl`` (each prompt index, completion and reward);
5. with ``grpo.iterations`` μ > 1, computes the generating policy's log-probabilities of every
   completion token once (no grad, the micro-batches' own rows), the "old" policy of the
   importance ratio.

With μ > 1 the loop trains μ optimizer steps on each batch of prompts (`repeat`: it repeats the
batch's data position, as TRL's ``num_iterations``); steps ``g + 1 .. g + μ − 1`` after the
generating step ``g`` reuse its completions, advantages and old log-probabilities, so their
ratio ``π/π_old`` moves away from 1 and is clipped by ``epsilon``/``epsilon_high``. A checkpoint
written inside such a run of steps carries the batch (`checkpoint_state`, in ``trainer.json``,
gathered from every rank and keyed by prompt: any world size resumes it; `restore_state`), so
a resumed run is exact.

`micro_step` then runs the policy over the micro-batch's completions (prompt + completion
rows, right-padded), takes the completion tokens' log-probabilities and backpropagates the
clipped token losses (`grpo_losses`) over the whole batch's denominator × world (DDP averages).
The reference (``beta > 0``) is the base with the adapters off.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from homelab_dp.errors import RunStateError
from homelab_dp.presets.reward_specs import reward_specs
from homelab_dp.runs.folder.rollouts import rollout_path
from homelab_dp.train.loop.rank_stats import all_gather_flat
from homelab_dp.train.loop.sample_answers import _eos_ids, evaluating
from homelab_dp.train.objectives.grpo_generation import (
    Group,
    generate_group,
    prompt_generator,
)
from homelab_dp.train.objectives.grpo_losses import (
    advantages,
    loss_denominator,
    loss_sum,
    masked_sum,
    token_losses,
)
from homelab_dp.train.objectives.preference_step import backward
from homelab_dp.train.objectives.reward_functions import RewardError, Rewards
from homelab_dp.user_files.private_write import write_whole

if TYPE_CHECKING:
    from collections.abc import Sequence


class GrpoObjective:
    """`train.objectives.objective.Objective` of GRPO (see the module docstring)."""

    name = "grpo"
    metrics = ("loss_sum", "clipped", "kl_sum", "tokens")

    def __init__(self, preset: Any, run_dir: Path | None, start_step: int = 0) -> None:
        self.g = preset.grpo
        self.seed = int(preset.train.seed)
        self.run_dir = run_dir
        self.specs = reward_specs(self.g.rewards, preset.source)
        self.weights = list(self.g.reward_weights) or [1.0] * len(self.specs)
        self.rewards: Rewards | None = None
        self.step = start_step
        """The optimizer step (0-based) the next `begin_step` prepares: one per step."""
        self.batch: dict[int, dict[str, Any]] = {}
        """This step's rollouts of this rank's prompts, by prompt (block) index."""
        self.den = 1.0
        self.figures: dict[str, float | None] = {}
        self.repeat = int(self.g.iterations)
        """Optimizer steps the loop trains on each batch of prompts (``grpo.iterations``)."""

    def checkpoint_state(self, rank: Any) -> dict[str, Any] | None:
        """What a checkpoint after the current step needs to resume exactly (a collective):
        the batch being reused (every rank's prompts, gathered), or None at a batch's end."""
        import torch.distributed as dist

        if self.repeat == 1 or self.step % self.repeat == 0:
            return None
        mine = {
            str(i): {"ids": e["group"].ids.tolist(), "mask": e["group"].mask.tolist(),
                     "truncated": e["group"].truncated.tolist(),
                     "advantage": e["advantage"].tolist(), "old": e["old"].tolist()}
            for i, e in self.batch.items()
        }  # fmt: skip
        gathered: list[Any] = [None] * rank.world
        dist.all_gather_object(gathered, mine)
        prompts = {k: v for part in gathered for k, v in part.items()}
        return {"step": self.step, "den": self.den, "figures": self.figures, "prompts": prompts}

    def restore_state(self, state: dict[str, Any] | None, device: Any) -> None:
        """Take back the batch a checkpoint written inside a run of reused steps saved."""
        if not state:
            return
        if int(state["step"]) != self.step:
            raise RunStateError(f"the checkpoint's GRPO batch is of step {state['step']}, the "
                                f"run resumes after step {self.step}",
                                hint="resume from the run's own checkpoints")  # fmt: skip
        self.den = float(state["den"])
        self.figures = dict(state["figures"])
        for key, e in state["prompts"].items():
            group = Group(torch.tensor(e["ids"], dtype=torch.long, device=device),
                          torch.tensor(e["mask"], dtype=torch.long, device=device),
                          torch.tensor(e["truncated"], dtype=torch.bool, device=device))  # fmt: skip
            self.batch[int(key)] = {
                "group": group,
                "advantage": torch.tensor(e["advantage"], dtype=torch.float64),
                "old": torch.tensor(e["old"], dtype=torch.float64, device=device),
            }

    def units(self, data: Any) -> torch.Tensor:
        """One prompt per block, ``[n_blocks, 1]``."""
        return torch.ones(data.n_blocks, 1, dtype=torch.float64)

    def begin_step(self, model: Any, data: Any, rank: Any, micro_idx: list[Any]) -> None:
        """Generate, score and agree on the batch (see the module docstring)."""
        if self.rewards is None:
            self.rewards = Rewards(self.specs, float(self.g.reward_timeout_s))
        t0 = time.perf_counter()
        g, dev = self.g, rank.device
        mine = [int(i) for idx in micro_idx for i in idx.tolist()]
        step = self.step
        self.step += 1
        if step % self.repeat:  # a later pass over the batch generated at step − step % μ
            if any(i not in self.batch for i in mine):
                raise RunStateError(f"GRPO step {step + 1} reuses a batch this process does "
                                    "not hold (a checkpoint without it)",
                                    hint="resume from a checkpoint written by this version")  # fmt: skip
            self.figures = {**self.figures, "generation_s": 0.0}
            return
        inner = model.strategy.inner
        eos = _eos_ids(data.tokenizer, inner)
        pad = data.tokenizer.pad_token_id
        pad = int(pad if pad is not None else next(iter(eos)))
        groups = {}
        with evaluating(inner):
            for i in mine:
                groups[i] = generate_group(
                    inner, data.prompts.ids[i], generations=g.generations,
                    max_tokens=g.max_completion_tokens, eos=eos, pad=pad,
                    temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                    generator=prompt_generator(self.seed, step, i, dev), device=dev,
                    autocast=model.autocast,
                )  # fmt: skip
        gen_s = time.perf_counter() - t0
        texts, prompts, index, columns = [], [], [], {}
        names = sorted({k for i in mine for k in data.prompts.records[i].columns})
        for i in mine:
            record = data.prompts.records[i]
            for row in range(g.generations):
                completion = groups[i].completion(row)
                texts.append(data.tokenizer.decode(completion, skip_special_tokens=True))
                prompts.append(record.prompt)
                index.append(i)
                for name in names:
                    columns.setdefault(name, []).append(record.columns.get(name))
        scored = self._score_together(prompts, texts, columns, index, rank)
        scores = torch.tensor(scored, dtype=torch.float64).reshape(len(texts), len(self.specs))
        total = scores @ torch.tensor(self.weights, dtype=torch.float64)
        lengths = torch.cat([groups[i].mask.sum(1) for i in mine]).to(torch.float64)
        truncated = torch.cat([groups[i].truncated for i in mine]).to(torch.float64)
        # Every rank's rows, in the global prompt order: [prompt, total, each reward, len, trunc]
        rows = torch.cat([torch.tensor(index, dtype=torch.float64)[:, None], total[:, None],
                          scores, lengths[:, None], truncated[:, None]], dim=1)  # fmt: skip
        everything = torch.empty(rank.world * rows.shape[0], rows.shape[1], dtype=torch.float64,
                                 device=dev)  # fmt: skip
        all_gather_flat(everything, rows.to(dev).contiguous())
        whole = everything.cpu()
        order = torch.argsort(whole[:, 0], stable=True)
        whole = whole[order]
        adv = advantages(whole[:, 1], g.generations, g.scale_rewards)
        n_completions = whole.shape[0]
        self.den = loss_denominator(g.loss, n_completions, float(whole[:, -2].sum()),
                                    g.max_completion_tokens)  # fmt: skip
        by_prompt = {}
        for k in range(0, n_completions, g.generations):
            by_prompt[int(whole[k, 0])] = adv[k : k + g.generations]
        self.batch = {i: {"group": groups[i], "advantage": by_prompt[i]} for i in mine}
        if self.repeat > 1:
            self._old_logps(model, data, micro_idx, dev)
        self._figures(whole, gen_s)
        if g.rollouts and self.run_dir is not None:
            self._write_rollouts(step + 1, rank, mine, texts, scores, total, index)

    def _old_logps(self, model: Any, data: Any, micro_idx: list[Any], device: Any) -> None:
        """The generating policy's log-probabilities of each completion token, per prompt
        ``[generations, its completion width]``: the rows and forward of `micro_step` (train
        mode, the same micro-batches), without gradient."""
        with torch.no_grad():
            for idx in micro_idx:
                ids, mask, positions, comp, _, starts = self._rows(data, idx, device)
                logps = self._token_logps(model.strategy.inner, ids, mask, positions, comp,
                                          starts, model.autocast, model.loss_dtype)  # fmt: skip
                row = 0
                for i in idx.tolist():
                    group = self.batch[int(i)]["group"]
                    n, width = group.ids.shape
                    self.batch[int(i)]["old"] = logps[row : row + n, :width].clone()
                    row += n

    def _score_together(self, prompts: list[Any], texts: list[str], columns: dict[str, list[Any]],
                        index: list[int], rank: Any) -> list[list[float]]:  # fmt: skip
        """This rank's rewards; a reward that failed on any rank ends every rank with the
        first failing rank's error (one small all-gather: no rank left waiting in the next
        collective)."""
        import torch.distributed as dist

        scores: list[list[float]] = []
        failure = None
        try:
            scores = self.rewards.score(prompts, texts, columns, index)  # type: ignore[union-attr]
        except RewardError as exc:
            failure = (exc.message, exc.hint)
        failures: list[Any] = [None] * rank.world
        dist.all_gather_object(failures, failure)
        first = next((f for f in failures if f is not None), None)
        if first is not None:
            raise RewardError(*first)
        return scores

    def _figures(self, whole: torch.Tensor, gen_s: float) -> None:
        total = whole[:, 1]
        lengths = whole[:, -2]
        figures: dict[str, float | None] = {
            "reward": float(total.mean()),
            "reward_std": float(total.std()) if total.numel() > 1 else 0.0,
            "completion_length": float(lengths.mean()),
            "completion_length_min": float(lengths.min()),
            "completion_length_max": float(lengths.max()),
            "completion_truncated": float(whole[:, -1].mean()),
            "generation_s": gen_s,
        }
        figures["reward_functions"] = {  # type: ignore[assignment]
            spec.name: float(whole[:, 2 + j].mean()) for j, spec in enumerate(self.specs)
        }  # the step event writes each as reward_<name>
        self.figures = figures

    def _write_rollouts(self, step: int, rank: Any, mine: list[int], texts: list[str],
                        scores: torch.Tensor, total: torch.Tensor, index: list[int]) -> None:  # fmt: skip
        import torch.distributed as dist

        rows = [{"prompt_index": index[k], "completion": texts[k], "reward": float(total[k]),
                 "rewards": {s.name: float(scores[k, j]) for j, s in enumerate(self.specs)}}
                for k in range(len(texts))]  # fmt: skip
        gathered: list[Any] = [None] * rank.world
        dist.all_gather_object(gathered, rows)
        if rank.rank != 0:
            return
        every = sorted((r for part in gathered for r in part), key=lambda r: r["prompt_index"])
        path = rollout_path(self.run_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, "".join(json.dumps(r) + "\n" for r in every))

    def micro_step(
        self, model: Any, data: Any, idx: torch.Tensor, counts: Sequence[float], rank: Any,
        probe: Any = None, rows: Sequence[int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The clipped token losses of the micro-batch's completions over the whole batch's
        denominator × world, backward; [loss sum, clipped tokens, KL sum, tokens]."""
        ids, mask, positions, comp, adv, start = self._rows(data, idx, rank.device)
        logps = self._token_logps(model.strategy.model, ids, mask, positions, comp, start,
                                  model.autocast, model.loss_dtype)  # fmt: skip
        old = None
        if self.repeat > 1:  # the generating policy's, padded to this micro-batch's width
            width_c = comp.shape[1]
            old = torch.cat([F.pad(self.batch[int(i)]["old"],
                                   (0, width_c - self.batch[int(i)]["old"].shape[1]))
                             for i in idx.tolist()]).to(logps.dtype)  # fmt: skip
        ref = None
        if self.g.beta > 0:
            inner = model.strategy.inner
            with torch.no_grad(), inner.disable_adapter():
                ref = self._token_logps(inner, ids, mask, positions, comp, start,
                                        model.autocast, model.loss_dtype)  # fmt: skip
        terms = token_losses(logps, adv, old_logps=old, ref_logps=ref, epsilon=self.g.epsilon,
                             epsilon_high=self.g.epsilon_high, beta=self.g.beta)  # fmt: skip
        total = loss_sum(terms.loss, comp, self.g.loss)
        if probe is not None:
            probe.mark("forward")
        backward(total * (rank.world / self.den), model.scaler)
        if probe is not None:
            probe.mark("backward")
        kl = (
            masked_sum(terms.kl, comp)
            if terms.kl is not None
            else torch.zeros((), dtype=torch.float64)
        )
        return torch.stack([total.detach().to(torch.float64).cpu(),
                            masked_sum(terms.clipped.double(), comp).cpu(), kl.cpu(),
                            comp.sum().to(torch.float64).cpu()]).to(rank.device)  # fmt: skip

    def _rows(self, data: Any, idx: torch.Tensor, device: Any) -> tuple[Any, ...]:
        """Prompt + completion rows of the blocks ``idx``, right-padded: ids, attention mask,
        positions, the completion mask ``[rows, C]``, advantages, each row's prompt length."""
        seqs, comps, advs, starts = [], [], [], []
        width_c = max(int(self.batch[int(i)]["group"].ids.shape[1]) for i in idx.tolist())
        for i in idx.tolist():
            entry = self.batch[int(i)]
            prompt = data.prompts.ids[int(i)]
            group = entry["group"]
            for row in range(group.ids.shape[0]):
                completion = group.completion(row)
                seqs.append(prompt + completion)
                c = torch.zeros(width_c, dtype=torch.long)
                c[: len(completion)] = 1
                comps.append(c)
                starts.append(len(prompt))
            advs.append(entry["advantage"])
        width = max(len(s) for s in seqs)
        pad = data.tokenizer.pad_token_id or 0
        ids = torch.full((len(seqs), width), int(pad), dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
        positions = torch.arange(width)[None, :].expand(len(seqs), -1).contiguous()
        return (ids.to(device), mask.to(device), positions.to(device),
                torch.stack(comps).to(device), torch.cat(advs).to(device), starts)  # fmt: skip

    @staticmethod
    def _token_logps(module: Any, ids: Any, mask: Any, positions: Any, comp: Any,
                     starts: list[int], autocast: Any, dtype: Any) -> torch.Tensor:  # fmt: skip
        """``[rows, C]`` log-probabilities of each row's completion tokens (0 past its end)."""
        with autocast():
            logits = module(input_ids=ids, attention_mask=mask, position_ids=positions,
                            use_cache=False).logits  # fmt: skip
        width_c = comp.shape[1]
        out = []
        for r, start in enumerate(starts):
            span = logits[r, start - 1 : start - 1 + width_c].to(dtype)
            targets = ids[r, start : start + width_c]
            n = targets.shape[0]
            lp = torch.log_softmax(span[:n], dim=-1).gather(-1, targets[:, None]).squeeze(-1)
            out.append(F.pad(lp, (0, width_c - n)))
        return torch.stack(out)

    def fields(self, sums: Sequence[float], counts: Sequence[float]) -> dict[str, float | None]:
        """The loss over the batch's denominator, clipped share, KL, and the rollout figures."""
        tokens = max(float(sums[3]), 1.0)
        out: dict[str, float | None] = {"loss": float(sums[0]) / self.den,
                                        "clipped": float(sums[1]) / tokens}  # fmt: skip
        out["kl"] = float(sums[2]) / tokens if self.g.beta > 0 else None
        out.update(self.figures)
        return out

    def close(self) -> None:
        """Stop the user rewards' process."""
        if self.rewards is not None:
            self.rewards.close()
