"""Preference losses against TRL's, and sequence log-probabilities against a direct fp64 forward.

TRL 1.16 (the release that installs with transformers 5 / torch 2.13) computes the DPO and KTO
losses inside ``DPOTrainer._compute_loss`` / ``KTOTrainer._compute_loss`` (there is no separate
``dpo_loss`` method any more): those are called here with a minimal stand-in for TRL's ``self``
(its settings, an accelerator of one process) and a stand-in of the model interface TRL calls
(``model(...).log_probs``: per-token log-probabilities, here the sequence's sum on its first
completion position), so TRL's own code turns the same log-probabilities into losses and
rewards. ORPO's ``odds_ratio_loss`` is a method of its own and is called directly.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch
from trl import DPOTrainer, KTOTrainer
from trl.experimental.orpo import ORPOTrainer

from homelab_dp.data.preference_blocks import PairBlock
from homelab_dp.train.objectives.preference_losses import (
    dpo_loss,
    kto_loss,
    orpo_loss,
    sequence_log_probs,
)
from tests.conftest import ROOT

TINY = ROOT / "assets" / "models" / "tiny-llama"
N = 8
WIDTH = 12
"""Positions of TRL's stand-in sequences (the longest completion below is 10 tokens)."""


class _OneProcess:
    """TRL's ``self.accelerator`` for one process: gathering returns the tensor itself."""

    device = torch.device("cpu")

    @staticmethod
    def gather(t: torch.Tensor) -> torch.Tensor:
        return t

    gather_for_metrics = gather


def _trl_self(**settings: object) -> types.SimpleNamespace:
    """The attributes TRL's loss code reads from ``self`` (evaluation mode: no token count)."""
    me = types.SimpleNamespace(
        model=types.SimpleNamespace(training=False), accelerator=_OneProcess(),
        aux_loss_enabled=False, precompute_ref_logps=True, _total_train_tokens=0, _tp_size=1,
        _metrics=defaultdict(lambda: defaultdict(list)), **settings,
    )  # fmt: skip
    return me


def _model_of(table: dict[int, float]):
    """TRL's model interface: ``log_probs`` [B, L-1] with the sum of sequence ``input_ids[b, 0]``
    on the first position (TRL sums over positions), the other outputs zero."""

    def forward(*, input_ids: torch.Tensor, **_: object) -> types.SimpleNamespace:
        rows, width = input_ids.shape
        log_probs = torch.zeros(rows, width - 1, dtype=torch.float64)
        log_probs[:, 0] = torch.tensor(
            [table[int(i)] for i in input_ids[:, 0]], dtype=torch.float64
        )
        zeros = torch.zeros(rows, width - 1)
        return types.SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros,
                                     is_top1=zeros.bool())  # fmt: skip

    return forward


def _mask(counts: torch.Tensor) -> torch.Tensor:
    """A completion mask with ``counts[i]`` ones in row i."""
    return (torch.arange(WIDTH)[None, :] < counts[:, None]).long()


def _trl_dpo(c, r, rc, rr, counts_c, counts_r, *, beta, loss_type, label_smoothing=0.0):
    """TRL's mean loss and metrics for pairs (c, r) against references (rc, rr)."""
    n = len(c)
    table = {i: float(v) for i, v in enumerate(torch.cat([c, r]))}
    ids = torch.zeros(2 * n, WIDTH, dtype=torch.long)
    ids[:, 0] = torch.arange(2 * n)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "completion_mask": _mask(torch.cat([counts_c, counts_r])),
              "ref_chosen_logps": rc, "ref_rejected_logps": rr}  # fmt: skip
    me = _trl_self(ld_alpha=None, f_divergence_type="reverse_kl", loss_types=[loss_type],
                   loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing,
                   use_weighting=False)  # fmt: skip
    loss = DPOTrainer._compute_loss(me, _model_of(table), inputs, False)
    return float(loss), {k: v[-1] for k, v in me._metrics["eval"].items()}


def _pairs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    c, r, rc, rr = (-20 * torch.rand(N, generator=g, dtype=torch.float64) for _ in range(4))
    counts_c = torch.randint(1, 11, (N,), generator=g)
    counts_r = torch.randint(1, 11, (N,), generator=g)
    return c, r, rc, rr, counts_c, counts_r


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_sigmoid_equals_trl_per_pair_and_per_batch(beta: float) -> None:
    c, r, rc, rr, nc, nr = _pairs(1)
    losses, chosen_rw, rejected_rw = dpo_loss(c, r, rc, rr, beta=beta, loss_type="sigmoid",
                                              label_smoothing=0.0)  # fmt: skip
    for k in range(N):
        one = slice(k, k + 1)
        loss, m = _trl_dpo(c[one], r[one], rc[one], rr[one], nc[one], nr[one], beta=beta,
                           loss_type="sigmoid")  # fmt: skip
        assert float(losses[k]) == pytest.approx(loss, abs=1e-6)
        assert float(chosen_rw[k]) == pytest.approx(m["rewards/chosen"], abs=1e-6)
        assert float(rejected_rw[k]) == pytest.approx(m["rewards/rejected"], abs=1e-6)
    loss, m = _trl_dpo(c, r, rc, rr, nc, nr, beta=beta, loss_type="sigmoid")
    assert float(losses.mean()) == pytest.approx(loss, abs=1e-6)
    margins = chosen_rw - rejected_rw
    assert float(margins.mean()) == pytest.approx(m["rewards/margins"], abs=1e-6)
    assert float((margins > 0).double().mean()) == m["rewards/accuracies"]
    assert 0 < m["rewards/accuracies"] < 1  # both kinds of pair are in the batch


def test_dpo_label_smoothing_equals_trl() -> None:
    """TRL 1.16's sigmoid loss no longer takes label smoothing; its ``aot`` loss is
    ``-(1-ε)·log σ(β·δ) - ε·log σ(-β·δ)`` on sorted log-ratios, the smoothed sigmoid of
    TRL ≤ 0.2x's ``dpo_loss`` (trl/trainer/dpo_trainer.py, ``loss_type == "sigmoid"``) wherever
    the sort is the identity: one pair at a time."""
    c, r, rc, rr, nc, nr = _pairs(2)
    losses, _, _ = dpo_loss(c, r, rc, rr, beta=0.2, loss_type="sigmoid", label_smoothing=0.15)
    plain, _, _ = dpo_loss(c, r, rc, rr, beta=0.2, loss_type="sigmoid", label_smoothing=0.0)
    assert (losses - plain).abs().min() > 1e-3  # smoothing changes every pair's loss
    for k in range(N):
        one = slice(k, k + 1)
        loss, _ = _trl_dpo(c[one], r[one], rc[one], rr[one], nc[one], nr[one], beta=0.2,
                           loss_type="aot", label_smoothing=0.15)  # fmt: skip
        assert float(losses[k]) == pytest.approx(loss, abs=1e-6)


def test_dpo_ipo_on_length_averaged_log_probs_equals_trl() -> None:
    """TRL divides each log-ratio by its completion's length for IPO; the caller passes our
    dpo_loss the length-averaged log-probabilities (policy and reference share the length)."""
    c, r, rc, rr, nc, nr = _pairs(3)
    losses, _, _ = dpo_loss(c / nc, r / nr, rc / nc, rr / nr, beta=0.1, loss_type="ipo")
    for k in range(N):
        one = slice(k, k + 1)
        loss, _ = _trl_dpo(c[one], r[one], rc[one], rr[one], nc[one], nr[one], beta=0.1,
                           loss_type="ipo")  # fmt: skip
        assert float(losses[k]) == pytest.approx(loss, abs=1e-6)
        assert loss > 1.0  # far from IPO's target 1/(2β) = 5: a real square


def test_dpo_policy_equal_to_reference_costs_ln2() -> None:
    c, r, _, _, _, _ = _pairs(4)
    losses, chosen_rw, rejected_rw = dpo_loss(c, r, c, r, beta=0.1)
    assert torch.allclose(losses, torch.full_like(losses, math.log(2)), atol=1e-12, rtol=0)
    assert not chosen_rw.any() and not rejected_rw.any()


def test_orpo_equals_trl_odds_ratio_loss() -> None:
    g = torch.Generator().manual_seed(5)
    # averages per token, some near 0 (where log(1 - e^x) needs expm1)
    a = -torch.rand(N, generator=g) * 3 - 1e-4
    b = -torch.rand(N, generator=g) * 3 - 1e-4
    a[0], b[1] = -1e-5, -2e-6
    term, log_odds = orpo_loss(a, b, orpo_lambda=0.25)
    me = types.SimpleNamespace(beta=0.25, accelerator=_OneProcess())
    losses, _, _, _, trl_log_odds = ORPOTrainer.odds_ratio_loss(me, a, b)
    # TRL returns λ·log σ(log_odds) and subtracts it from the NLL; our term is added.
    assert torch.allclose(term, -losses, atol=1e-6, rtol=0)
    assert float(log_odds.mean()) == pytest.approx(float(trl_log_odds), abs=1e-6)
    assert term.requires_grad is False and (term > 0).all()


def _trl_kto(logps, ref, desirable, kl_logps, ref_kl, *, beta):
    """TRL's mean KTO loss and metrics: completions with their labels, the KL completions."""
    n, k = len(logps), len(kl_logps)
    table = {i: float(v) for i, v in enumerate(logps)}
    table.update({1000 + j: float(v) for j, v in enumerate(kl_logps)})
    ids = torch.zeros(n, WIDTH, dtype=torch.long)
    ids[:, 0] = torch.arange(n)
    kl_ids = torch.zeros(k, WIDTH, dtype=torch.long)
    kl_ids[:, 0] = 1000 + torch.arange(k)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "completion_mask": torch.ones_like(ids), "KL_input_ids": kl_ids,
              "KL_attention_mask": torch.ones_like(kl_ids),
              "KL_completion_mask": torch.ones_like(kl_ids), "label": desirable.bool(),
              "ref_logps": ref, "ref_KL_logps": ref_kl}  # fmt: skip
    me = _trl_self(calculate_KL=True, loss_type="kto", beta=beta, desirable_weight=1.0,
                   undesirable_weight=1.0)  # fmt: skip
    me._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, me)
    loss = KTOTrainer._compute_loss(me, _model_of(table), inputs, False)
    return float(loss), {k: v[-1] for k, v in me._metrics["eval"].items()}


@pytest.mark.parametrize("kl_shift", [3.0, -3.0], ids=["kl-positive", "kl-clamped"])
def test_kto_equals_trl_per_completion_and_per_batch(kl_shift: float) -> None:
    g = torch.Generator().manual_seed(6)
    logps, ref, kl_logps = (-20 * torch.rand(N, generator=g, dtype=torch.float64)
                            for _ in range(3))  # fmt: skip
    ref_kl = kl_logps - kl_shift  # the batch's KL estimate is kl_shift (clamped at 0 below 0)
    desirable = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0])
    kl = (kl_logps - ref_kl).mean()
    losses, rewards = kto_loss(logps, ref, desirable, kl, beta=0.3)
    for k in range(N):
        one = slice(k, k + 1)
        loss, m = _trl_kto(logps[one], ref[one], desirable[one], kl_logps, ref_kl, beta=0.3)
        assert float(losses[k]) == pytest.approx(loss, abs=1e-6)
        key = "rewards/chosen" if desirable[k] else "rewards/rejected"
        assert float(rewards[k]) == pytest.approx(m[key], abs=1e-6)
        assert m["kl"] == pytest.approx(max(kl_shift, 0.0), abs=1e-9)
    loss, m = _trl_kto(logps, ref, desirable, kl_logps, ref_kl, beta=0.3)
    assert float(losses.mean()) == pytest.approx(loss, abs=1e-6)
    assert float(rewards[desirable == 1].mean()) == pytest.approx(m["rewards/chosen"], abs=1e-6)


# --- sequence_log_probs against one sequence at a time, fp64, the tiny model ----------------

SEQ_LEN = 10


@pytest.fixture(scope="module")
def tiny_fp64():
    from transformers import AutoModelForCausalLM

    from homelab_dp.train.model.attention import attention_implementation

    model = AutoModelForCausalLM.from_pretrained(
        TINY, dtype=torch.float64, attn_implementation=attention_implementation("cpu", "fp32")
    )
    return model.eval()


def _sequences(seed: int) -> list[tuple[list[int], int]]:
    """Four sequences (two pairs): tokens and prompt length; each pair shares its prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for prompt_len, lens in ((3, (7, 5)), (4, (9, 6))):
        prompt = torch.randint(3, 200, (prompt_len,), generator=g).tolist()
        for n in lens:
            response = torch.randint(3, 200, (n - prompt_len - 1,), generator=g).tolist()
            out.append((prompt + response + [1], prompt_len))  # eos 1 closes the response
    return out


def _shifted(tokens: list[int], prompt_len: int) -> list[int]:
    """Labels as the contract shifts them: position t's target is token t+1 when it is in the
    response (eos included); -100 on the prompt and the last position."""
    return [tokens[t + 1] if t + 1 >= prompt_len else -100 for t in range(len(tokens) - 1)] + [-100]


def _one_at_a_time(model, tokens: list[int], prompt_len: int) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].double()
    logps = torch.log_softmax(logits, dim=-1)
    labels = _shifted(tokens, prompt_len)
    return sum(float(logps[t, y]) for t, y in enumerate(labels) if y != -100)


def _packed_block(seqs: list[tuple[list[int], int]]) -> PairBlock:
    """Both pairs in one row of 2·SEQ_LEN: positions restart per sequence, padding at the end."""
    ids, labels, pos, seq = [], [], [], []
    for s, (tokens, p) in enumerate(seqs):
        ids += tokens
        labels += _shifted(tokens, p)
        pos += list(range(len(tokens)))
        seq += [s] * len(tokens)
    pad = 2 * SEQ_LEN * 2 - len(ids)  # two pairs: a row of 2·SEQ_LEN per pair at most
    return PairBlock(input_ids=[ids + [2] * pad], labels=[labels + [-100] * pad],
                     attention_mask=[[1] * len(ids) + [0] * pad],
                     position_ids=[pos + list(range(pad))], sequence=[seq + [-1] * pad],
                     n_pairs=2)  # fmt: skip


def _unpacked_block(pair: list[tuple[list[int], int]]) -> PairBlock:
    """One pair: row 0 chosen, row 1 rejected, each padded to SEQ_LEN with a mask."""
    rows = [[], [], [], [], []]
    for s, (tokens, p) in enumerate(pair):
        pad = SEQ_LEN - len(tokens)
        for row, values in zip(rows, (tokens + [2] * pad, _shifted(tokens, p) + [-100] * pad,
                                      [1] * len(tokens) + [0] * pad,
                                      list(range(len(tokens))) + [0] * pad,
                                      [s] * len(tokens) + [-1] * pad), strict=True):  # fmt: skip
            row.append(values)
    return PairBlock(*rows, n_pairs=1)


def test_sequence_log_probs_packed_equals_one_sequence_at_a_time(tiny_fp64) -> None:
    seqs = _sequences(7)
    block = _packed_block(seqs)
    with torch.no_grad():
        logits = tiny_fp64(input_ids=torch.tensor(block.input_ids),
                           position_ids=torch.tensor(block.position_ids), use_cache=False).logits  # fmt: skip
    sums, counts = sequence_log_probs(logits, torch.tensor(block.labels),
                                      torch.tensor(block.sequence), 4, dtype=torch.float64)  # fmt: skip
    assert sums.dtype == torch.float64
    assert counts.tolist() == [len(t) - p for t, p in seqs]
    want = torch.tensor([_one_at_a_time(tiny_fp64, t, p) for t, p in seqs], dtype=torch.float64)
    assert torch.allclose(sums, want, atol=1e-9, rtol=0), (sums, want)


def test_sequence_log_probs_unpacked_micro_batch_equals_one_at_a_time(tiny_fp64) -> None:
    """Two unpacked blocks in one micro-batch: the caller offsets the second block's ids."""
    seqs = _sequences(8)
    blocks = [_unpacked_block(seqs[:2]), _unpacked_block(seqs[2:])]
    ids = torch.tensor([r for b in blocks for r in b.input_ids])
    sequence = torch.tensor([[s + 2 * i if s >= 0 else -1 for s in r]
                             for i, b in enumerate(blocks) for r in b.sequence])  # fmt: skip
    logits = tiny_fp64(input_ids=ids,
                       attention_mask=torch.tensor([r for b in blocks for r in b.attention_mask]),
                       position_ids=torch.tensor([r for b in blocks for r in b.position_ids]),
                       use_cache=False).logits  # fmt: skip
    labels = torch.tensor([r for b in blocks for r in b.labels])
    sums, counts = sequence_log_probs(logits, labels, sequence, 4, dtype=torch.float64)
    want = torch.tensor([_one_at_a_time(tiny_fp64, t, p) for t, p in seqs], dtype=torch.float64)
    assert torch.allclose(sums.detach(), want, atol=1e-9, rtol=0)
    assert counts.tolist() == [len(t) - p for t, p in seqs]
    # differentiable in the logits: a gradient reaches the weights through the sums
    sums.sum().backward()
    assert (
        tiny_fp64.lm_head.weight.grad is not None and tiny_fp64.lm_head.weight.grad.abs().sum() > 0
    )
    tiny_fp64.zero_grad(set_to_none=True)


def test_sequence_log_probs_casts_only_the_target_rows() -> None:
    """bf16 logits: the result is fp32 and equals fp32 log-softmax of the same rows."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 6, 50, generator=g).to(torch.bfloat16)
    labels = torch.tensor([[-100, 4, 7, -100, 9, 1], [3, 3, -100, -100, -100, -100]])
    sequence = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 2, -1, -1, -1]])
    sums, counts = sequence_log_probs(logits, labels, sequence, 3, dtype=torch.float32)
    full = torch.log_softmax(logits.float(), dim=-1)
    want = [
        full[0, 1, 4] + full[0, 2, 7],
        full[0, 4, 9] + full[0, 5, 1],
        full[1, 0, 3] + full[1, 1, 3],
    ]
    assert sums.dtype == torch.float32 and counts.tolist() == [2, 2, 2]
    assert torch.allclose(sums, torch.stack(want), atol=1e-6, rtol=0)


def test_sequence_log_probs_keeps_only_target_rows_for_backward() -> None:
    """bf16 logits with few targets: every fp32 tensor saved for backward has at most
    targets × vocab elements (no fp32 copy of the [R, L, V] logits is kept)."""
    g = torch.Generator().manual_seed(10)
    rows, length, vocab = 2, 64, 300
    logits = torch.randn(rows, length, vocab, generator=g).to(torch.bfloat16).requires_grad_()
    labels = torch.full((rows, length), -100)
    labels[0, 10:15] = 7
    labels[1, 40:43] = 9
    sequence = torch.zeros(rows, length, dtype=torch.long)
    sequence[1] = 1
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sums, _ = sequence_log_probs(logits, labels, sequence, 2, dtype=torch.float32)
    fp32 = [t.numel() for t in saved if t.dtype == torch.float32]
    assert fp32 and max(fp32) <= 8 * vocab  # 8 target rows, not 2 × 64 rows
    sums.sum().backward()
    assert logits.grad is not None and logits.grad[0, :10].abs().sum() == 0  # no target, no grad
    assert logits.grad[0, 10].abs().sum() > 0
