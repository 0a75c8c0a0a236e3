"""The held-out split of validation while training (`homelab_dp.data.eval_split`): disjoint, seeded,
independent of the world size, never trained on; and an eval file checked like the data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_dp.data.eval_split import held_out_count, load_dataset, load_train_eval, split_indices
from homelab_dp.errors import DataError
from homelab_dp.presets.preset import DataSection

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "assets" / "models" / "tiny-llama"
DEMO = ROOT / "assets" / "data" / "tiny-instruct.jsonl"
BAD = ROOT / "tests" / "data" / "bad_data"


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 distinct instruction records (the demo's first 40)."""
    path = tmp_path_factory.mktemp("split") / "forty.jsonl"
    lines = DEMO.read_text(encoding="utf-8").splitlines()[:40]
    assert len({json.dumps(json.loads(line), sort_keys=True) for line in lines}) == 40
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_the_split_is_disjoint_complete_and_sized_by_the_fraction() -> None:
    for n, fraction in [(10, 0.1), (40, 0.25), (1000, 0.5), (7, 0.01), (3, 0.5)]:
        train, held = split_indices(n, fraction, seed=42)
        assert not set(train) & set(held)
        assert sorted(train + held) == list(range(n))
        assert train == sorted(train) and held == sorted(held)
        assert len(held) == held_out_count(n, fraction) == max(1, round(n * fraction))
    assert split_indices(10, 0.0, seed=1) == (list(range(10)), [])


def test_the_seed_alone_chooses_the_held_out_samples() -> None:
    first = split_indices(1000, 0.1, seed=7)
    assert split_indices(1000, 0.1, seed=7) == first  # every rank, every resume
    assert split_indices(1000, 0.1, seed=8)[1] != first[1]
    # Not the first or last samples: spread over the file.
    held = first[1]
    assert held[0] < 100 and held[-1] > 900


@pytest.mark.parametrize("pack", [False, True])
def test_held_out_samples_are_never_trained_on_on_any_world_size(tok, records, pack) -> None:
    data = DataSection(path=str(records), seq_len=128, pack=pack, eval_fraction=0.25)
    splits = [
        load_train_eval(data, tok, seed=3, seq_len_limit=512, min_blocks=world * 2)
        for world in (1, 2, 4)
    ]
    first = splits[0]
    assert first.held_out == 10
    for other in splits[1:]:  # min_blocks (world × micro) changes nothing
        assert other.train == first.train and other.eval == first.eval
    # Each block is sample-packed: find every sample's tokens in the blocks of one side only.
    whole = load_dataset(
        DataSection(path=str(records), seq_len=128, pack=False), tok, seq_len_limit=512,
        min_blocks=1,
    )  # fmt: skip
    # Its inputs without the last one: what any block (packed or not) holds of the sample.
    samples = [b.input_ids[: sum(b.attention_mask) - 1] for b in whole]
    _, held = split_indices(40, 0.25, seed=3)

    def holds(blocks, sample: list[int]) -> bool:
        n = len(sample)
        return any(b.input_ids[i : i + n] == sample for b in blocks for i in range(129 - n))

    for i, sample in enumerate(samples):
        in_eval, in_train = holds(first.eval, sample), holds(first.train, sample)
        assert (in_eval, in_train) == ((True, False) if i in held else (False, True)), i
    targets = sum(b.num_targets for b in first.train) + sum(b.num_targets for b in first.eval)
    assert targets == sum(b.num_targets for b in whole)


def test_an_eval_file_is_read_and_checked_like_the_data(tok, records, tmp_path) -> None:
    data = DataSection(path=str(records), seq_len=64, eval_path=str(DEMO))
    split = load_train_eval(data, tok, seed=0, seq_len_limit=512, min_blocks=2)
    assert split.held_out == 0 and split.train == load_dataset(
        DataSection(path=str(records), seq_len=64), tok, seq_len_limit=512, min_blocks=1
    )
    assert len(split.eval) > len(split.train)  # 2000 samples against 40
    bad = DataSection(path=str(records), eval_path=str(BAD / "bad-json-line.jsonl"))
    with pytest.raises(DataError, match=r"bad-json-line.jsonl:3: not valid JSON"):
        load_train_eval(bad, tok, seed=0, seq_len_limit=512, min_blocks=1)
    missing = DataSection(path=str(records), eval_path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match=r"data.eval_path: .*nope.jsonl does not exist"):
        load_train_eval(missing, tok, seed=0, seq_len_limit=512, min_blocks=1)


def test_a_split_that_leaves_too_little_to_train_names_the_field(tok, tmp_path) -> None:
    one = tmp_path / "one.jsonl"
    one.write_text(DEMO.read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
    data = DataSection(path=str(one), seq_len=64, eval_fraction=0.5)
    with pytest.raises(DataError, match=r"data.eval_fraction: 0.5 of the 1 sample\(s\)"):
        load_train_eval(data, tok, seed=0, seq_len_limit=512, min_blocks=1)
    four = tmp_path / "four.jsonl"
    four.write_text("\n".join(DEMO.read_text(encoding="utf-8").splitlines()[:4]) + "\n")
    data = DataSection(path=str(four), seq_len=64, pack=False, eval_fraction=0.5)
    with pytest.raises(DataError, match=r"after holding out 2 sample\(s\) for data.eval_fraction"):
        load_train_eval(data, tok, seed=0, seq_len_limit=512, min_blocks=4)
