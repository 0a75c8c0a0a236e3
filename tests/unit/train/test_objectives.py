"""The objective seam without torchrun: DPO, ORPO and KTO micro-batch losses summed over any
split of the effective batch (1 vs 2 "ranks" simulated by slices, accumulation) give the
whole-batch gradient and figures; the first DPO loss with adapters disabled is ln 2; the
precomputed reference equals the adapters-off forward and its cache key follows the model,
the data and the dtype.

The tiny LLaMA of assets/ in fp64 with LoRA (B = 0 at init, as a run starts), preference
blocks built by hand per the `PairBlock` contract (data/preference_blocks.py)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from homelab_dp.data.preference_blocks import PairBlock
from homelab_dp.train.objectives.dpo import DpoObjective
from homelab_dp.train.objectives.kto import KtoObjective
from homelab_dp.train.objectives.orpo import OrpoObjective
from homelab_dp.train.objectives.pair_batch import pair_data
from homelab_dp.train.objectives.reference import (
    TABLES_VERSION,
    AdapterReference,
    PrecomputedReference,
    cached_tables,
    prepare_precomputed,
    reference_key,
    reference_path,
    tables_digest,
)
from homelab_dp.train.objectives.sft import SftObjective
from tests.conftest import ROOT

TINY = ROOT / "assets" / "models" / "tiny-llama"
TOL = 1e-12  # fp64: summation order only
IGNORE = -100


def sequence(prompt: list[int], response: list[int]) -> tuple[list[int], list[int]]:
    """Inputs and shifted labels of prompt + response (labels only on the response)."""
    tokens = prompt + response
    labels = [tokens[t + 1] if t + 1 >= len(prompt) else IGNORE for t in range(len(tokens) - 1)]
    return tokens[:-1], labels


def block(pairs: list[tuple[list[int], list[int], list[int]]], width: int, packed: bool,
          desirable: list[int] | None = None) -> PairBlock:  # fmt: skip
    """A PairBlock of ``pairs`` (prompt, chosen, rejected): packed into one row of 2·width, or
    (one pair) two padded rows of width."""
    rows: list[list[list[int]]] = []  # per row: ids, labels, mask, positions, sequence
    cur: list[list[int]] = [[], [], [], [], []]
    for k, (prompt, chosen, rejected) in enumerate(pairs):
        for s, answer in ((2 * k, chosen), (2 * k + 1, rejected)):
            ids, labels = sequence(prompt, answer)
            if not packed:
                cur = [[], [], [], [], []]
            cur[0] += ids
            cur[1] += labels
            cur[2] += [1] * len(ids)
            cur[3] += list(range(len(ids)))
            cur[4] += [s] * len(ids)
            if not packed:
                rows.append(cur)
    if packed:
        rows = [cur]
    size = 2 * width if packed else width
    for r in rows:
        pad = size - len(r[0])
        assert pad >= 0
        r[0] += [2] * pad
        r[1] += [IGNORE] * pad
        r[2] += [0] * pad
        r[3] += list(range(pad))
        r[4] += [-1] * pad
    return PairBlock(input_ids=[r[0] for r in rows], labels=[r[1] for r in rows],
                     attention_mask=[r[2] for r in rows], position_ids=[r[3] for r in rows],
                     sequence=[r[4] for r in rows], desirable=desirable or [],
                     n_pairs=len(pairs))  # fmt: skip


def random_pairs(n: int, seed: int) -> list[tuple[list[int], list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(3, 200, (k,), generator=g).tolist()

    return [(ids(2, 6), ids(2, 7), ids(2, 7)) for _ in range(n)]


@dataclass
class Rank:
    device: Any
    rank: int
    world: int
    micro: int


@dataclass
class Strategy:
    model: Any
    inner: Any
    is_fsdp: bool = False


@dataclass
class Loaded:
    model: Any


@dataclass
class Model:
    """What the objectives read of `train.loop.rank_setup.Model` (no wrapper: one process)."""

    strategy: Strategy
    loaded: Loaded
    autocast: Any = contextlib.nullcontext
    loss_dtype: Any = torch.float64
    scaler: Any = None
    flat_batches: bool = False


@dataclass
class Data:
    pairs: Any


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    # One thread: on a shared 2-core runner the default two run ~10x slower (oversubscribed).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(
        TINY, dtype=torch.float64, attn_implementation="sdpa"
    )
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj"]))  # fmt: skip
    yield Model(Strategy(peft, peft), Loaded(peft))
    torch.set_num_threads(threads)


def perturbed(model: Model) -> None:
    """LoRA B away from 0: the policy differs from the reference."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.strategy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)


def zero_b(model: Model) -> None:
    with torch.no_grad():
        for name, p in model.strategy.model.named_parameters():
            if "lora_B" in name:
                p.zero_()


def grads(model: Model) -> dict[str, torch.Tensor]:
    out = {
        n: p.grad.clone() for n, p in model.strategy.model.named_parameters() if p.grad is not None
    }
    model.strategy.model.zero_grad(set_to_none=True)
    return out


def run_split(objective: Any, model: Model, data: Data, ranks: list[list[list[int]]]):
    """Micro-steps of each simulated rank (its list of micro-batches); DDP's gradient average
    over ranks; the metric sums of all ranks and the step's global counts."""
    world = len(ranks)
    every = [i for micro in ranks for idx in micro for i in idx]
    counts = objective.units(data)[torch.tensor(every)].sum(0).tolist()
    total: dict[str, torch.Tensor] = {}
    sums = torch.zeros(len(objective.metrics), dtype=torch.float64)
    cpu = torch.device("cpu")
    for r, micro in enumerate(ranks):
        rank = Rank(cpu, r, world, len(micro[0]))
        for idx in micro:
            sums += objective.micro_step(model, data, torch.tensor(idx), counts, rank)
        for n, g in grads(model).items():
            total[n] = total.get(n, 0) + g / world  # DDP averages over ranks
    return total, objective.fields(sums.tolist(), counts)


SPLITS = {
    "one process, micro 4": [[[0, 1, 2, 3]]],
    "one process, micro 1 × accumulation 4": [[[0], [1], [2], [3]]],
    "two ranks, micro 2": [[[0, 1]], [[2, 3]]],
    "two ranks, micro 1 × accumulation 2": [[[0], [2]], [[1], [3]]],
}


def check_splits(objective: Any, model: Model, data: Data) -> dict[str, float | None]:
    ref_grads, ref_fields = run_split(objective, model, data, SPLITS["one process, micro 4"])
    assert ref_grads and all(float(g.abs().max()) > 0 for g in ref_grads.values())
    for name, split in SPLITS.items():
        g, fields = run_split(objective, model, data, split)
        assert set(g) == set(ref_grads), name
        diff = max(float((g[n] - ref_grads[n]).abs().max()) for n in g)
        assert diff < TOL, (name, diff)
        for k, v in ref_fields.items():
            assert v is not None and fields[k] is not None
            assert abs(fields[k] - v) < TOL, (name, k, fields[k], v)
    return ref_fields


@pytest.mark.parametrize("packed", [False, True])
def test_dpo_split_over_ranks_and_accumulation_is_the_whole_batch(
    model: Model, packed: bool
) -> None:
    perturbed(model)
    raw = random_pairs(6, seed=3)
    # Packed: blocks of 1-2 pairs (a different number of pairs per block); unpacked: one each.
    groups = [raw[0:2], raw[2:3], raw[3:5], raw[5:6]] if packed else [[p] for p in raw[:4]]
    data = Data(pair_data([block(g, 24, packed) for g in groups], packed))
    dpo = DpoObjective(AdapterReference(), beta=0.1, loss_type="sigmoid", label_smoothing=0.1)
    fields = check_splits(dpo, model, data)
    assert fields["loss"] != pytest.approx(math.log(2), abs=1e-3)  # the policy moved
    assert fields["reward_margin"] == pytest.approx(
        fields["rewards_chosen"] - fields["rewards_rejected"], abs=TOL
    )
    ipo = DpoObjective(AdapterReference(), beta=0.2, loss_type="ipo", label_smoothing=0.0)
    check_splits(ipo, model, data)


def test_dpo_first_loss_is_ln2_and_matches_a_direct_computation(model: Model) -> None:
    zero_b(model)  # LoRA's init: the policy equals the reference (adapters disabled)
    raw = random_pairs(4, seed=5)
    data = Data(pair_data([block([p], 20, False) for p in raw], False))
    dpo = DpoObjective(AdapterReference(), beta=0.1, loss_type="sigmoid", label_smoothing=0.0)
    _, fields = run_split(dpo, model, data, SPLITS["two ranks, micro 2"])
    assert abs(fields["loss"] - math.log(2)) < 1e-12
    assert fields["reward_margin"] == 0 and fields["reward_accuracy"] == 0

    # A moved policy: the loss is −log σ(β·margin) of log-probs computed one sequence at a time.
    perturbed(model)
    _, fields = run_split(dpo, model, data, SPLITS["two ranks, micro 2"])
    peft = model.strategy.model

    def logp(ids: list[int], labels: list[int]) -> float:
        with torch.no_grad():
            logits = peft(input_ids=torch.tensor([ids])).logits[0]
        lp = F.log_softmax(logits.double(), -1)
        return sum(float(lp[t, y]) for t, y in enumerate(labels) if y != IGNORE)

    losses, right = [], 0
    for prompt, chosen, rejected in raw:
        c, r = sequence(prompt, chosen), sequence(prompt, rejected)
        pc, pr = logp(*c), logp(*r)
        with peft.disable_adapter():
            rc, rr = logp(*c), logp(*r)
        margin = (pc - rc) - (pr - rr)
        losses.append(-F.logsigmoid(torch.tensor(0.1 * margin, dtype=torch.float64)).item())
        right += (pc - rc) > (pr - rr)
    assert abs(fields["loss"] - sum(losses) / 4) < 1e-10
    assert fields["reward_accuracy"] == right / 4


def test_orpo_split_is_exact_and_its_nll_is_per_chosen_token(model: Model) -> None:
    perturbed(model)
    raw = random_pairs(4, seed=7)
    data = Data(pair_data([block([p], 20, False) for p in raw], False))
    fields = check_splits(OrpoObjective(0.1), model, data)
    peft = model.strategy.model
    nll_sum = tokens = 0.0
    for prompt, chosen, _ in raw:
        ids, labels = sequence(prompt, chosen)
        with torch.no_grad():
            logits = peft(input_ids=torch.tensor([ids])).logits[0].double()
        nll_sum += float(F.cross_entropy(logits, torch.tensor(labels), ignore_index=IGNORE,
                                         reduction="sum"))  # fmt: skip
        tokens += sum(y != IGNORE for y in labels)
    assert abs(fields["nll"] - nll_sum / tokens) < 1e-10
    assert fields["loss"] > fields["nll"]  # the odds-ratio term is positive


def test_kto_split_is_exact_with_the_kl_of_the_whole_batch(model: Model) -> None:
    perturbed(model)
    raw = random_pairs(4, seed=9)  # (prompt, completion, mismatched KL completion)
    flags = [1, 0, 1, 0]
    data = Data(pair_data([block([p], 20, False, desirable=[d]) for p, d in zip(raw, flags,
                                                                               strict=True)],
                          False))  # fmt: skip
    kto = KtoObjective(AdapterReference(), beta=0.1)
    cpu = torch.device("cpu")
    # What every rank gets from begin_step's all-reduce: the KL of all four KL completions.
    kto.kl = kto.kl_estimate(model, data.pairs, [torch.tensor([0, 1, 2, 3])], Rank(cpu, 0, 1, 4))
    assert kto.kl > 0  # a moved policy; else the split would not be tested
    halves = kto.kl_estimate(model, data.pairs, [torch.tensor([0, 1]), torch.tensor([2, 3])],
                             Rank(cpu, 0, 1, 2))  # fmt: skip
    assert abs(halves - kto.kl) < TOL
    fields = check_splits(kto, model, data)
    assert fields["rewards_chosen"] is not None and fields["rewards_rejected"] is not None


def test_kto_eval_sums_are_the_step_sums_with_the_kl_term_at_zero(model: Model) -> None:
    """The eval worker's and the validator's KTO sums: one float64 vector per call (the
    per-completion losses summed, as in training), equal to a micro-step's at z = 0."""
    perturbed(model)
    raw = random_pairs(4, seed=11)
    data = Data(pair_data([block([p], 20, False, desirable=[d]) for p, d in zip(raw, [1, 0, 0, 1],
                                                                               strict=True)],
                          False))  # fmt: skip
    kto = KtoObjective(AdapterReference(), beta=0.1)
    kto.kl = 0.5  # a step's estimate: evaluation must not use it
    cpu, idx = torch.device("cpu"), torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        got = kto.eval_sums(model, data.pairs, idx, cpu)
    kto.kl = 0.0
    counts = kto.units(data).sum(0).tolist()
    want = kto.micro_step(model, data, idx, counts, Rank(cpu, 0, 1, 4))
    grads(model)  # the micro-step's gradients dropped
    assert got.shape == want.shape == (3,)
    assert torch.allclose(got, want, rtol=0, atol=TOL)
    assert float(got[1]) != 0.0 and float(got[2]) != 0.0  # both kinds of completion counted


def test_sft_objective_keeps_the_token_loss(model: Model) -> None:
    sft = SftObjective()

    @dataclass
    class SftData:
        targets: torch.Tensor

    units = sft.units(SftData(torch.tensor([3, 0, 5])))
    assert units.dtype == torch.float64 and units[:, 0].tolist() == [3.0, 0.0, 5.0]
    assert sft.fields([12.0], [8.0]) == {"loss": 1.5}
    assert sft.fields([0.0], [0.0]) == {"loss": 0.0}


def test_precomputed_reference_equals_adapters_off_and_is_cached(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    perturbed(model)
    raw = random_pairs(5, seed=11)
    groups = [raw[0:2], raw[2:3], raw[3:5]]
    pairs = pair_data([block(g, 24, True) for g in groups], True)
    rank = Rank(torch.device("cpu"), 0, 1, 2)
    key = reference_key(str(TINY), pairs, None, objective="dpo", dtype="fp64", device="cpu",
                        attention="sdpa", method="lora")  # fmt: skip
    # The precompute runs the model as it is: with adapters disabled, the base.
    with model.strategy.model.disable_adapter():
        assert prepare_precomputed(model, pairs, None, rank, key) == "built"
    table = pairs.ref_logps
    assert table is not None and table.shape == (3, 4)
    assert math.isnan(float(table[1, 2])) and math.isnan(float(table[1, 3]))  # one pair only
    pre, ada = PrecomputedReference(), AdapterReference()
    from homelab_dp.train.objectives.pair_batch import batch_of

    for idx in ([0, 1, 2], [2, 0]):
        batch = batch_of(pairs, torch.tensor(idx), torch.device("cpu"))
        a, b = pre.logps(model, pairs, batch), ada.logps(model, pairs, batch)
        assert a.shape == b.shape and float((a - b).abs().max()) < 1e-10

    # Read back, not computed again (a second run on the same model and data).
    pairs.ref_logps = None
    assert prepare_precomputed(model, pairs, None, rank, key) == "hit"
    assert torch.equal(pairs.ref_logps.nan_to_num(7.0), table.nan_to_num(7.0))


def test_reference_key_follows_model_data_and_dtype(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    weights = folder / "model.safetensors"
    weights.write_bytes(b"0" * 16)
    a = pair_data([block(random_pairs(1, seed=1), 16, False)], False)
    b = pair_data([block(random_pairs(1, seed=2), 16, False)], False)

    def key(pairs: Any = a, dtype: str = "fp32", objective: str = "dpo") -> str:
        return reference_key(str(folder), pairs, None, objective=objective, dtype=dtype,
                             device="cpu", attention="sdpa", method="full")  # fmt: skip

    first = key()
    assert key() == first  # stable
    assert key(pairs=b) != first  # other data
    assert key(dtype="bf16") != first
    assert key(objective="kto") != first
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # new weights written
    assert key() != first
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    before = key()
    (folder / "config.json").write_text('{"model_type": "mistral"}')
    assert key() != before


def test_reference_kind_auto_and_refusals() -> None:
    from homelab_dp.errors import HomelabError
    from homelab_dp.presets.preset import preset_from_dict
    from homelab_dp.train.objectives.reference_choice import reference_kind

    def preset(objective: str, reference: str = "auto") -> Any:
        return preset_from_dict({"model": {"path": str(TINY)}, "data": {"path": "x.jsonl"},
                                 "train": {"objective": objective, "reference": reference}})  # fmt: skip

    assert reference_kind(preset("dpo"), "lora") == "adapters"
    assert reference_kind(preset("kto"), "qlora") == "adapters"
    assert reference_kind(preset("dpo"), "full") == "precompute"
    assert reference_kind(preset("dpo", "copy"), "full") == "copy"
    assert reference_kind(preset("dpo", "precompute"), "lora") == "precompute"
    assert reference_kind(preset("orpo"), "full") is None
    assert reference_kind(preset("sft"), "lora") is None
    with pytest.raises(HomelabError, match="train.reference = 'adapters'") as err:
        reference_kind(preset("dpo", "adapters"), "full")
    assert "precompute" in err.value.hint
    with pytest.raises(HomelabError, match="train.reference = 'copy'"):
        reference_kind(preset("dpo", "copy"), "qlora")


def _tables_file(path: Path, tables: dict[str, torch.Tensor], **meta: str) -> None:
    from safetensors.torch import save

    path.write_bytes(save(tables, metadata=meta or None))


def _good_meta(key: str, tables: dict[str, torch.Tensor]) -> dict[str, str]:
    return {"version": TABLES_VERSION, "key": key, "digest": tables_digest(tables)}


def _narrower(key: str, good: dict[str, torch.Tensor]) -> dict[str, Any]:
    t = {"train": good["train"][:, :2].contiguous()}  # the edit: "completes" at 1e-5
    return {"tables": t, "meta": _good_meta(key, t)}


def _edited(key: str, good: dict[str, torch.Tensor], value: float, at: tuple[int, int]) -> Any:
    t = {"train": good["train"].clone()}
    t["train"][at] = value
    return {"tables": t, "meta": _good_meta(key, t)}  # the checksum made to match the edit


REFERENCE_DAMAGE: dict[str, Any] = {
    "narrower table, checksum matching": _narrower,
    "the train table missing": lambda key, good: {
        "tables": {"other": good["train"]},
        "meta": _good_meta(key, {"other": good["train"]}),
    },
    "float32 table": lambda key, good: {
        "tables": {"train": good["train"].float()},
        "meta": _good_meta(key, {"train": good["train"].float()}),
    },
    "a value changed, old checksum": lambda key, good: {
        "tables": {"train": good["train"] - 1e-3 * good["train"].isfinite()},
        "meta": _good_meta(key, good),
    },
    "no metadata": lambda key, good: {"tables": good, "meta": {}},
    "made for another key": lambda key, good: {
        "tables": good,
        "meta": {**_good_meta(key, good), "key": "0" * 32},
    },
    "NaN where a pair is": lambda key, good: _edited(key, good, float("nan"), (0, 0)),
    "infinity where a pair is": lambda key, good: _edited(key, good, float("-inf"), (0, 1)),
    "a positive log-probability": lambda key, good: _edited(key, good, 3.0, (2, 0)),
    "a value past a block's pairs": lambda key, good: _edited(key, good, -1.0, (1, 3)),
    "truncated": "truncated",
    "garbage bytes": b"\x00\x01not safetensors at all" * 10,
    "a header claiming 2^60 bytes": (2**60).to_bytes(8, "little") + b"{}",
    "empty": b"",
    "a huge sparse file": "huge",
    "a FIFO": "fifo",
    "a symlink to /dev/zero": "devzero",
}
"""Every damage a reference file is checked for, made as `test_a_damaged_reference_cache…`
writes it: each is computed again (never a hit), equal to the true table, and rewritten."""

REFERENCE_REASONS = {
    "narrower table, checksum matching": "shape (3, 2), not (3, 4)",
    "the train table missing": "tables ['other'], not ['train']",
    "float32 table": "dtype torch.float32, not float64",
    "a value changed, old checksum": "do not match their checksum",
    "no metadata": "no version metadata",
    "made for another key": "made for another key",
    "NaN where a pair is": "not finite",
    "infinity where a pair is": "not finite",
    "a positive log-probability": "above 0 (3)",
    "a value past a block's pairs": "NaN expected",
    "truncated": "not a safetensors file",
    "garbage bytes": "not a safetensors file",
    "a header claiming 2^60 bytes": "its header claims",
    "empty": "shorter than a safetensors header",
    "a huge sparse file": "over the limit",
    "a FIFO": "not a regular file (a FIFO)",
    "a symlink to /dev/zero": "not a regular file (a character device)",
}
"""What `cached_tables` says of each: the check meant for it caught it."""


@pytest.mark.parametrize("damage", list(REFERENCE_DAMAGE))
def test_a_damaged_reference_cache_is_computed_again_and_rewritten(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    zero_b(model)
    raw = random_pairs(5, seed=11)
    pairs = pair_data([block(g, 24, True) for g in (raw[0:2], raw[2:3], raw[3:5])], True)
    rank = Rank(torch.device("cpu"), 0, 1, 2)
    key = reference_key(str(TINY), pairs, None, objective="dpo", dtype="fp64", device="cpu",
                        attention="sdpa", method="lora")  # fmt: skip
    assert prepare_precomputed(model, pairs, None, rank, key) == "built"
    path = reference_path(key)
    good = {"train": pairs.ref_logps.clone()}
    assert good["train"].shape == (3, 4)
    how = REFERENCE_DAMAGE[damage]
    path.unlink()
    if callable(how):
        made = how(key, good)
        _tables_file(path, made["tables"], **made["meta"])
    elif how == "truncated":
        _tables_file(path, good, **_good_meta(key, good))
        path.write_bytes(path.read_bytes()[:-20])
    elif how == "huge":
        with open(path, "wb") as fh:
            fh.truncate(2**40)  # a terabyte, sparse: refused by its size, never read
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "devzero":
        path.symlink_to("/dev/zero")
    else:
        path.write_bytes(how)
    tables, problem = cached_tables(path, key, pairs, None)
    assert tables is None and REFERENCE_REASONS[damage] in problem
    pairs.ref_logps = None
    assert prepare_precomputed(model, pairs, None, rank, key) == "built"
    assert torch.equal(pairs.ref_logps.nan_to_num(7.0), good["train"].nan_to_num(7.0))
    assert path.is_file() and not path.is_symlink() and path.stat().st_size < 2**20
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    pairs.ref_logps = None
    assert prepare_precomputed(model, pairs, None, rank, key) == "hit"  # rewritten whole


def test_a_reference_cache_with_eval_needs_both_tables(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    zero_b(model)
    train = pair_data([block(random_pairs(2, seed=3), 24, True)], True)
    held = pair_data([block(random_pairs(1, seed=4), 24, True)], True)
    rank = Rank(torch.device("cpu"), 0, 1, 2)
    key = reference_key(str(TINY), train, held, objective="dpo", dtype="fp64", device="cpu",
                        attention="sdpa", method="lora")  # fmt: skip
    assert prepare_precomputed(model, train, held, rank, key) == "built"
    tables, problem = cached_tables(reference_path(key), key, train, held)
    assert problem == "" and tables is not None and set(tables) == {"train", "eval"}
    only = {"train": tables["train"]}
    _tables_file(reference_path(key), only, **_good_meta(key, only))
    tables, problem = cached_tables(reference_path(key), key, train, held)
    assert tables is None and problem == "tables ['train'], not ['eval', 'train']"
    assert prepare_precomputed(model, train, held, rank, key) == "built"
    assert held.ref_logps is not None and held.ref_logps.shape == (1, 2)
