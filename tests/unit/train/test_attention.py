"""Attention over packed blocks: the kernel choice, and exactness at the model level.

A packed block (positions restarting at each sample, no attention mask) must give every token
the loss it has when its sample is alone in a padded row, for LLaMA (rotary positions) and
GPT-2 (learned absolute positions), with sdpa and eager attention. The old packing (one run of
positions 0..seq_len-1 over the block, a plain causal mask) must measurably differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from homelab_dp.data.blocks import IGNORE_INDEX, Block, Example, build_blocks
from homelab_dp.planning.attention_rule import choose_attention, is_flash_attn_2
from homelab_dp.train.model.attention import (
    attention_choice,
    attention_implementation,
    flash_attn_available,
)

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "assets" / "models" / "tiny-llama"
SEQ, PAD = 24, 2


# ------------------------------------------------------------------ the kernel choice


def install_flash(tmp_path, monkeypatch, distribution: str, version: str) -> None:
    """An installed ``flash_attn`` module from ``distribution`` (its dist-info on sys.path, as
    pip leaves it): the installation boundary, since the real package needs CUDA."""
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("raise ImportError('not for import')\n")
    info = tmp_path / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture
def flash_attn_2(tmp_path, monkeypatch):
    install_flash(tmp_path, monkeypatch, "flash-attn", "2.7.4.post1")


PACKED = "homelab_packed"
TURING, AMPERE, ADA = (7, 5), (8, 0), (8, 9)


def test_homelab_packed_without_flash_attn():
    assert not flash_attn_available()  # not installed on this machine
    for device, dtype in (("cuda", "bf16"), ("cuda", "fp16"), ("cpu", "bf16"), ("cpu", "fp32")):
        for cap in (TURING, ADA):
            assert attention_implementation(device, dtype, capability=cap) == PACKED
    assert "not installed" in attention_choice("cuda", "bf16", capability=ADA)[1]


def test_flash_attention_2_on_ampere_or_newer_in_half_precision_only(flash_attn_2):
    assert flash_attn_available()  # found without importing it (its import would raise)
    assert attention_implementation("cuda", "bf16", capability=ADA) == "flash_attention_2"
    assert attention_implementation("cuda", "fp16", capability=AMPERE) == "flash_attention_2"
    assert attention_implementation("cuda", "fp32", capability=ADA) == PACKED
    assert attention_implementation("cpu", "bf16", capability=ADA) == PACKED
    assert attention_implementation("cpu", "fp32") == PACKED
    impl, why = attention_choice("cuda", "bf16", capability=ADA)
    assert impl == "flash_attention_2" and "2.7.4.post1" in why


def test_no_flash_attention_2_on_turing_even_when_installed(flash_attn_2):
    # A 2080 Ti: FA2's first forward would die ("only supports Ampere GPUs or newer").
    impl, why = attention_choice("cuda", "fp16", capability=TURING)
    assert impl == PACKED and "8.0" in why and "7.5" in why
    # One old card among new ones decides for the whole run.
    assert attention_implementation("cuda", "fp16", capabilities=[ADA, TURING]) == PACKED
    assert attention_implementation("cuda", "bf16", capabilities=[ADA, AMPERE]) == (
        "flash_attention_2"
    )
    # A CUDA card whose capability cannot be read counts as too old; no CUDA here: none.
    assert attention_implementation("cuda", "bf16", capabilities=[None]) == PACKED
    assert attention_implementation("cuda", "bf16") == PACKED


@pytest.mark.parametrize(
    ("distribution", "version"),
    [("flash-attn-4", "4.0.0b4"), ("flash-attn", "3.0.0b1"), ("flash-attn", "1.0.9")],
)
def test_only_a_2x_flash_attn_distribution_counts(tmp_path, monkeypatch, distribution, version):
    install_flash(tmp_path, monkeypatch, distribution, version)
    assert flash_attn_available()  # the module is there...
    impl, why = attention_choice("cuda", "bf16", capability=ADA)
    assert impl == PACKED  # ...but not FlashAttention-2's API
    if distribution == "flash-attn":
        assert f"is {version}" in why


def test_the_rule_itself():
    assert is_flash_attn_2("2.8.3") and is_flash_attn_2("2.7.4.post1")
    assert not any(is_flash_attn_2(v) for v in ("3.0.0", "1.0.9", "4.0.0b4", "", None))
    # The plan's rule: a what-if card of unknown capability counts as new enough.
    assert choose_attention("cuda", "bf16", [None], "2.8.3", unknown_ok=True)[0] == (
        "flash_attention_2"
    )
    assert choose_attention("cuda", "bf16", [None], "2.8.3")[0] == PACKED


def test_plan_names_the_attention_and_why(monkeypatch, in_repo, flash_attn_2):
    from homelab_dp.app.plan import make_plan
    from homelab_dp.presets.preset_store import open_preset
    from homelab_dp.probe.fake_nvml import FAKE_ENV
    from tests.conftest import DATA

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    reasons = {}
    for rec in ("2x2080ti", "2xa6000-nvlink"):
        monkeypatch.setenv(FAKE_ENV, str(DATA / "nvml" / f"{rec}.json"))
        plan = make_plan(open_preset("tiny-demo", ["hardware.devices=auto"])).plan
        reasons[rec] = [r for r in plan.reasons if r.startswith("Attention: ")]
    assert reasons["2x2080ti"] == [
        "Attention: homelab_packed (SDPA on each sample alone, grouped-query key/value heads "
        "repeated, no mask): FlashAttention-2 needs compute capability 8.0 (Ampere) or newer on every card, and a card here is 7.5."
    ]
    assert reasons["2xa6000-nvlink"] == [
        "Attention: FlashAttention-2: flash-attn 2.7.4.post1 is installed and every card is "
        "compute capability 8.0 or newer."
    ]


def test_the_memory_budget_assumes_the_attention_that_runs(monkeypatch, in_repo, tmp_path):
    """The planner budgets what runs: homelab_packed allocates no mask and no repeated
    key/value heads, as FlashAttention-2 does not, so installing flash-attn 2 changes nothing
    on Turing (still homelab_packed) nor on Ampere (FA2 instead, the same activations)."""
    from homelab_dp.app.plan import make_plan
    from homelab_dp.presets.preset_store import open_preset
    from homelab_dp.probe.fake_nvml import FAKE_ENV
    from tests.conftest import DATA

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def activations(rec: str) -> int:
        monkeypatch.setenv(FAKE_ENV, str(DATA / "nvml" / f"{rec}.json"))
        preset = open_preset("tiny-demo", ["hardware.devices=auto", "model.dtype=fp16"])
        return make_plan(preset).plan.to_json()["per_device_bytes"]["activations"]

    before = {rec: activations(rec) for rec in ("2x2080ti", "2xa6000-nvlink")}
    install_flash(tmp_path, monkeypatch, "flash-attn", "2.7.4.post1")
    after = {rec: activations(rec) for rec in ("2x2080ti", "2xa6000-nvlink")}
    assert after == before


# ------------------------------------------------------------------ packed == one per row


def ragged_examples() -> list[Example]:
    """Samples of 2 to 14 tokens, the first two tokens of some without loss (a prompt)."""
    import torch

    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate((5, 9, 3, 14, 7, 4, 6, 11, 2, 8)):
        ids = torch.randint(3, 250, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX] * (1 + 2 * (i % 2)) + ids[1 + 2 * (i % 2) :]
        out.append(Example(ids, labels))
    return out


def tiny_gpt2(attn: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        bos_token_id=0, eos_token_id=1, attn_implementation=attn)  # fmt: skip
    return GPT2LMHeadModel(config).double().eval()


def tiny_llama(attn: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        MODEL, dtype=torch.float64, attn_implementation=attn
    ).eval()


def token_losses(model, blocks: list[Block], *, packed: bool, positions: str = "block"):
    """Each target token's loss, as the worker computes them (mask only for padded blocks)."""
    import torch
    import torch.nn.functional as F

    ids = torch.tensor([b.input_ids for b in blocks])
    labels = torch.tensor([b.labels for b in blocks])
    pos = torch.tensor([b.position_ids for b in blocks])
    if positions == "range":  # the old packing: one run of positions over the whole block
        pos = torch.arange(SEQ).expand(len(blocks), SEQ)
    mask = None if packed else torch.tensor([b.attention_mask for b in blocks])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    assert torch.isfinite(logits).all()  # the padding run attends to itself: no empty row
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return loss[labels.flatten() != IGNORE_INDEX]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_blocks_train_exactly_like_one_sample_per_row(arch, attn):
    import torch

    model = tiny_llama(attn) if arch == "llama" else tiny_gpt2(attn)
    assert model.config._attn_implementation == attn
    examples = ragged_examples()
    packed = build_blocks(examples, SEQ, pack=True, pad_id=PAD)
    rows = build_blocks(examples, SEQ, pack=False, pad_id=PAD)
    assert len(packed) == 3 < len(rows) == 10  # 59 inputs in 3 × 24
    assert any(b.attention_mask[-1] == 0 for b in packed)  # a padding run is in the batch
    a = token_losses(model, packed, packed=True)
    b = token_losses(model, rows, packed=False)
    assert a.shape == b.shape == (sum(b.num_targets for b in rows),)
    # The same multiset of token losses (the packed order differs), to fp64 rounding.
    assert torch.allclose(a.sort().values, b.sort().values, rtol=1e-10, atol=1e-12)
    assert abs(float(a.sum() - b.sum())) < 1e-10 * float(b.sum())
    # The old packing (positions 0..SEQ-1, plain causal mask) lets samples see each other.
    old = token_losses(model, packed, packed=True, positions="range")
    assert abs(float(old.sum() - b.sum())) > 1e-3 * float(b.sum())


def test_transformers_finds_each_sample_and_the_padding_as_segments():
    import torch
    from transformers.masking_utils import find_packed_sequence_indices

    blocks = build_blocks(ragged_examples(), SEQ, pack=True, pad_id=PAD)
    found = find_packed_sequence_indices(torch.tensor([b.position_ids for b in blocks]))
    for block, segments in zip(blocks, found.tolist(), strict=True):
        starts = [t for t, p in enumerate(block.position_ids) if p == 0]
        expected = [sum(s <= t for s in starts) - 1 for t in range(SEQ)]
        assert segments == expected
        real = sum(block.attention_mask)
        if real < SEQ:  # the padding is a segment of its own
            assert block.position_ids[real] == 0
            assert segments[real] == segments[-1] != segments[real - 1]


def test_padding_never_reaches_a_real_token():
    import torch

    model = tiny_llama("sdpa")
    blocks = build_blocks(ragged_examples(), SEQ, pack=True, pad_id=PAD)
    ids = torch.tensor([b.input_ids for b in blocks])
    pos = torch.tensor([b.position_ids for b in blocks])
    real = torch.tensor([b.attention_mask for b in blocks]).bool()
    assert (~real).any()
    other = ids.masked_fill(~real, 77)  # another pad token
    with torch.no_grad():
        x = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        y = model(input_ids=other, position_ids=pos, use_cache=False).logits
    assert torch.equal(x[real], y[real])
    assert not torch.allclose(x[~real], y[~real])
