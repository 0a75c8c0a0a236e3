"""Preference tuning under the real launcher (torchrun, gloo, 1 and 2 CPU processes).

Four launches in all, shared by the module's two tests (one fixture each; a test per fixture
so pytest's workers never launch one twice), on the demo pairs of presets/tiny-dpo.toml in fp64
(what is left between runs is summation order):

- DPO with LoRA on 1 process, the reference its adapters disabled, uninterrupted;
- DPO with LoRA on 2 processes, the reference precomputed (one data-parallel pass, cached),
  stopped after step 3 (HOMELAB_DP_STOP_AT_STEP) and resumed: the resume reads the cached
  reference, and its adapter equals the uninterrupted 1-process run's (1 vs 2 processes and
  stop + resume at once; the adapters-off and precomputed references agree as well);
- ORPO, full fine-tune, on 2 processes: its first step's loss, NLL and log odds ratio equal a
  direct fp64 computation with transformers on the same pairs, one sequence at a time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import tomllib

from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.folder.run_folder import create_run_dir
from homelab_dp.runs.run_spec import Launch, Rendezvous, Resolved, RunSpec
from tests.integration.conftest import ROOT, events, final_weights, max_abs_diff, run, run_together

pytestmark = pytest.mark.slow
STEPS, STOP = 6, 3
WEIGHTS_TOL = 1e-5  # the acceptance bound; measured: see the report (fp64 summation order)
LOSS_TOL = 1e-9


def make_pref_run(root: Path, name: str, *, world: int, accum: int, method: str = "lora",
                  objective: str = "dpo", reference: str = "auto") -> Path:  # fmt: skip
    """A run folder of presets/tiny-dpo.toml (its data and LoRA) for ``world`` processes."""
    doc: dict[str, Any] = tomllib.loads((ROOT / "presets" / "tiny-dpo.toml").read_text())
    doc["model"]["path"] = str(ROOT / doc["model"]["path"])
    doc["data"].update(path=str(ROOT / doc["data"]["path"]), eval_fraction=0.1)
    # Pinned here: the demo preset's schedule may be retuned without changing these checks.
    doc["train"].update(method=method, objective=objective, reference=reference, lr=1e-3,
                        warmup_steps=2, max_steps=STEPS, checkpoint_every=0, eval_every=STEPS,
                        sample_every="off", grad_accum=accum)  # fmt: skip
    doc["hardware"]["nproc"] = world
    preset = preset_from_dict(doc)
    t = preset.train
    resolved = Resolved(method=method, distribution="ddp", activation_checkpointing=False,  # type: ignore[arg-type]
                        device="cpu", world_size=world, dtype="fp64", micro_batch=t.micro_batch,
                        grad_accum=accum, lr=t.lr, offload="none",
                        offload_activations=False)  # fmt: skip
    launch = Launch(nproc_per_node=world, rendezvous=Rendezvous())
    return create_run_dir(RunSpec(run_id=name, preset=preset, resolved=resolved, launch=launch),
                          root)  # fmt: skip


def worker_log(run_dir: Path) -> str:
    """Every rank's log of every attempt."""
    return "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*.log"))


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dpo")
    one = make_pref_run(root, "one", world=1, accum=4)  # micro 2 × 4: effective batch 8
    two = make_pref_run(root, "two", world=2, accum=2, reference="precompute")
    assert run_together((one, 1, {}), (two, 2, {"stop_at": STOP})) == [0, 0]
    stopped = events(two)
    assert run(two, 2, resume=True) == 0
    return {"one": one, "two": two, "stopped_events": stopped}  # type: ignore[dict-item]


@pytest.mark.timeout(900)  # three launches in the fixture: past pytest's default 300 s
def test_dpo_lora_first_loss_ln2_learns_and_is_exact_over_processes_and_resume(
    dpo_runs: dict[str, Any],
) -> None:
    one, two = dpo_runs["one"], dpo_runs["two"]
    start = events(one, "start")[0]
    assert start["objective"] == "dpo" and start["reference"] == "adapters"
    steps = events(one, "step")
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert abs(steps[0]["loss"] - math.log(2)) < 1e-6  # the policy is the reference
    assert steps[0]["reward_margin"] == 0 and steps[0]["reward_accuracy"] == 0
    last = steps[-1]
    assert last["reward_accuracy"] > 0.8 and last["reward_margin"] > 0
    assert last["rewards_chosen"] > last["rewards_rejected"]
    assert last["loss"] < 0.5
    (ev,) = events(one, "eval")  # the held-out pairs, after the last step
    assert ev["step"] == STEPS and ev["pairs"] > 0 and ev["perplexity"] is None
    assert ev["reward_accuracy"] is not None and ev["reward_accuracy"] > 0.5
    assert ev["loss"] < math.log(2)

    # 2 processes, reference precomputed: stopped after step 3, resumed, the cache read back.
    stopped = dpo_runs["stopped_events"]
    assert [e["reason"] for e in stopped if e["type"] == "end"] == ["stopped"]
    starts = events(two, "start")
    assert [s["reference"] for s in starts] == ["precompute", "precompute"]
    assert starts[1]["start_step"] == STOP
    log = worker_log(two)
    assert "reference log-probabilities: built" in log and "reference log-probabilities: hit" in log
    steps2 = events(two, "step")
    assert [e["step"] for e in steps2] == list(range(1, STEPS + 1))
    for a, b in zip(steps, steps2, strict=True):  # the same batches, the same figures
        assert a["world_size"] == 1 and b["world_size"] == 2
        for k in ("loss", "rewards_chosen", "rewards_rejected", "reward_accuracy"):
            assert abs(a[k] - b[k]) < LOSS_TOL, (a["step"], k, a[k], b[k])
    diff = max_abs_diff(final_weights(one), final_weights(two))
    print(f"adapter max abs diff, 1 process vs 2 processes stopped and resumed: {diff:.3g}")
    assert diff <= WEIGHTS_TOL
    assert events(two, "end")[-1]["reason"] == "completed"


@pytest.fixture(scope="module")
def orpo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rd = make_pref_run(tmp_path_factory.mktemp("orpo"), "orpo", world=2, accum=2,
                       method="full", objective="orpo")  # fmt: skip
    assert run(rd, 2) == 0
    return rd


@pytest.mark.timeout(600)
def test_orpo_full_finetune_first_step_equals_a_direct_computation(orpo_run: Path) -> None:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from homelab_dp.data.eval_split import load_preference_train_eval
    from homelab_dp.runs.folder.run_folder import read_run_spec
    from homelab_dp.train.parallelism.strategy import SampleOrder

    spec = read_run_spec(orpo_run)
    preset = spec.preset
    start = events(orpo_run, "start")[0]
    assert start["objective"] == "orpo" and start["reference"] is None
    steps = events(orpo_run, "step")
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(e["nll"] is not None and e["log_odds_ratio"] is not None for e in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert events(orpo_run, "end")[-1]["reason"] == "completed"

    # Step 1 directly: the blocks the shared order gives step 0, every sequence alone.
    tokenizer = AutoTokenizer.from_pretrained(preset.model.path)
    split = load_preference_train_eval(preset.data, tokenizer, objective="orpo",
                                       seed=preset.train.seed, seq_len_limit=512,
                                       min_blocks=4)  # fmt: skip
    effective = spec.resolved.micro_batch * 2 * spec.resolved.grad_accum
    chosen_blocks = SampleOrder(len(split.train), preset.train.seed).blocks(0, effective)
    model = AutoModelForCausalLM.from_pretrained(preset.model.path, dtype=torch.float64)
    model.eval()
    nll_sum, tokens, terms, odds = 0.0, 0, [], []
    lam = preset.train.orpo_lambda
    for b in chosen_blocks:
        blk = split.train[b]
        per_seq: dict[int, tuple[float, int]] = {}
        for r, seqs in enumerate(blk.sequence):
            for s in sorted(set(seqs) - {-1}):
                pos = [t for t, x in enumerate(seqs) if x == s]
                ids = torch.tensor([[blk.input_ids[r][t] for t in pos]])
                labels = torch.tensor([blk.labels[r][t] for t in pos])
                with torch.no_grad():
                    logits = model(input_ids=ids).logits[0]
                lp = -F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
                per_seq[s] = (float(lp), int((labels != -100).sum()))
        for k in range(blk.n_pairs):
            (c, nc), (rj, nr) = per_seq[2 * k], per_seq[2 * k + 1]
            nll_sum -= c
            tokens += nc
            a, b_ = c / nc, rj / nr
            lo = (a - b_) - (math.log1p(-math.exp(a)) - math.log1p(-math.exp(b_)))
            odds.append(lo)
            terms.append(-lam * float(F.logsigmoid(torch.tensor(lo, dtype=torch.float64))))
    nll = nll_sum / tokens
    first = steps[0]
    assert abs(first["nll"] - nll) < LOSS_TOL
    assert abs(first["log_odds_ratio"] - sum(odds) / len(odds)) < LOSS_TOL
    assert abs(first["loss"] - (nll + sum(terms) / len(terms))) < LOSS_TOL
