"""Preference data (`homelab_dp.data.preference_blocks`): formats preference and kto, their
checks (each naming file:line), the token cache, PairBlocks packed and unpacked, KTO's
mismatched completions, identical pairs and the eval split."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from homelab_dp.data import token_cache
from homelab_dp.data.eval_split import load_preference_train_eval, load_train_eval
from homelab_dp.data.preference_blocks import PairBlock, identical_warning, kto_partners
from homelab_dp.data.records import format_from_keys
from homelab_dp.data.samples import load_pairs, read_source, read_with_lines
from homelab_dp.data.sources import resolve_source
from homelab_dp.data.tokenize import IGNORE_INDEX, PairExample, tokenize_pairs, tokenize_records
from homelab_dp.errors import DataError
from homelab_dp.presets.preset import DataSection

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "assets" / "models" / "tiny-llama"
PAIRS = [json.loads(x) for x in (ROOT / "assets/data/tiny-preferences.jsonl").open()]
KTO = [json.loads(x) for x in (ROOT / "assets/data/tiny-kto.jsonl").open()]


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(MODEL)


def cfg(path: Path | str, **kw) -> DataSection:
    return DataSection(path=str(path), seq_len=kw.pop("seq_len", 64), **kw)


def jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def load(tok, path: Path, objective: str = "dpo", min_blocks: int = 1, **kw):
    return load_preference_train_eval(
        cfg(path, **kw), tok, objective=objective, seed=42, seq_len_limit=512,
        min_blocks=min_blocks,
    )  # fmt: skip


def sequences(block: PairBlock) -> dict[int, tuple[list[int], list[int], list[int]]]:
    """Each sequence id of a block: its inputs, targets and positions, in row order."""
    out: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for r, ids in enumerate(block.input_ids):
        for t, s in enumerate(block.sequence[r]):
            if s < 0:
                continue
            x, y, p = out.setdefault(s, ([], [], []))
            x.append(ids[t])
            y.append(block.labels[r][t])
            p.append(block.position_ids[r][t])
    return out


def error(fn) -> str:
    with pytest.raises(DataError) as info:
        fn()
    return f"{info.value}\n{info.value.hint}"


CHAT_PAIR = {
    "chosen": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
    ],
    "rejected": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "Maybe 5."},
    ],
}


# ---------------------------------------------------------------- formats


def test_keys_name_pairs_and_kto_before_the_sft_formats():
    assert format_from_keys(["prompt", "chosen", "rejected"]) == "preference"
    assert format_from_keys(["chosen", "rejected"]) == "preference"  # HH-RLHF (TRL's layout)
    # UltraFeedback-binarized rows also hold "messages" and a string prompt: still pairs.
    assert format_from_keys(["prompt", "prompt_id", "chosen", "rejected", "messages"]) == (
        "preference"
    )
    assert format_from_keys(["prompt", "completion", "label"]) == "kto"
    assert format_from_keys(["prompt", "completion"]) == "completion"
    assert format_from_keys(["text", "label"]) == "text"


def test_chat_pair_layouts_read_as_the_same_pair(tmp_path):
    user = CHAT_PAIR["chosen"][0]
    ultrafeedback = {**CHAT_PAIR, "prompt": user["content"], "messages": CHAT_PAIR["chosen"]}
    explicit = {  # TRL's explicit prompt: the answers alone
        "prompt": [user],
        "chosen": CHAT_PAIR["chosen"][1:],
        "rejected": CHAT_PAIR["rejected"][1:],
    }
    string_prompt = {**explicit, "prompt": user["content"]}
    path = jsonl(tmp_path / "p.jsonl", [CHAT_PAIR, ultrafeedback, explicit, string_prompt])
    records, lines, fmt = read_with_lines(path, "auto")
    assert fmt == "preference" and lines == [1, 2, 3, 4]
    want = {"messages": [user], "chosen": "2 + 2 = 4.", "rejected": "Maybe 5."}
    assert records == [want] * 4


def test_raw_hh_rlhf_strings_take_the_shared_text_as_the_prompt(tmp_path):
    """Anthropic's own layout: each side the whole dialogue, no prompt (TRL's extract_prompt)."""
    talk = "\n\nHuman: What is 2 + 2?\n\nAssistant:"
    path = jsonl(tmp_path / "hh.jsonl", [{"chosen": talk + " 4.", "rejected": talk + " 5, or 4."}])
    records, _, fmt = read_with_lines(path, "auto")
    assert fmt == "preference"
    assert records == [{"prompt": talk, "chosen": " 4.", "rejected": " 5, or 4."}]


def test_kto_labels_read_as_bools_from_json_and_csv(tmp_path):
    path = tmp_path / "k.csv"
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["prompt", "completion", "label"])
        w.writerow(["Q:", " yes", "true"])
        w.writerow(["Q:", " no", "0"])
    records, wheres, fmt = read_source(resolve_source(str(path), "train"), "auto")
    assert fmt == "kto" and [r["label"] for r in records] == [True, False]
    assert wheres == [f"{path} row 1", f"{path} row 2"]


# ---------------------------------------------------------------- checks (file:line)


@pytest.mark.parametrize(
    ("record", "words"),
    [
        ({"prompt": "Q:", "chosen": " a"}, "field 'rejected' missing"),
        ({"prompt": "Q:", "rejected": " a"}, "field 'chosen' missing"),
        ({"prompt": "Q:", "chosen": "", "rejected": " b"}, "field 'chosen' is empty"),
        ({"prompt": "Q:", "chosen": " a", "rejected": "  "}, "field 'rejected' is empty"),
        (
            {"chosen": " a", "rejected": " b"},
            "field 'prompt' missing, and 'chosen' and "
            "'rejected' share no text to take as the prompt",
        ),
        ({"prompt": ["Q"], "chosen": " a", "rejected": " b"}, "'prompt' must be a string"),
        ({"prompt": "Q:", "chosen": " a", "rejected": [{"role": "user"}]}, "both be strings"),
        (
            {
                **CHAT_PAIR,
                "rejected": [CHAT_PAIR["rejected"][0], {"role": "assistant", "content": ""}],
            },
            "field 'rejected': the last assistant turn is empty",
        ),  # fmt: skip
        (
            {
                **CHAT_PAIR,
                "rejected": [
                    {"role": "user", "content": "What is 3 + 3?"},
                    CHAT_PAIR["rejected"][1],
                ],
            },
            "do not share the turns before their last (they differ at turn 0",
        ),  # fmt: skip
        (
            {**CHAT_PAIR, "chosen": CHAT_PAIR["chosen"][:1]},
            "field 'chosen' must end with an assistant turn",
        ),
    ],
)
def test_a_bad_pair_is_named_by_file_and_line(tmp_path, record, words):
    good = {"prompt": "Q:", "chosen": " a", "rejected": " b"}
    path = jsonl(tmp_path / "p.jsonl", [good, good, record])
    text = error(lambda: read_with_lines(path, "auto"))
    assert f"{path}:3: " in text and words in text
    assert "the preference format needs non-empty 'chosen' and 'rejected'" in text  # the hint


def test_kto_label_missing_or_not_a_bool(tmp_path):
    path = jsonl(tmp_path / "k.jsonl", [{"prompt": "Q", "completion": " a", "label": True},
                                        {"prompt": "Q", "completion": " a", "label": "maybe"}])  # fmt: skip
    assert f"{path}:2: field 'label' must be true or false, got 'maybe'" in error(
        lambda: read_with_lines(path, "kto")
    )


def test_a_prompt_longer_than_seq_len_names_its_line(tok, tmp_path):
    long = {"prompt": "Question: " + "What is 1 + 1? " * 40, "chosen": " 2.", "rejected": " 3."}
    path = jsonl(tmp_path / "p.jsonl", [PAIRS[0], long, PAIRS[1], long])
    text = error(lambda: load(tok, path, seq_len=32))
    assert f"{path}:2: the prompt takes" in text and "data.seq_len 32" in text
    assert "(and 1 more record like it)" in text and "raise data.seq_len" in text
    kto = jsonl(tmp_path / "k.jsonl", [*KTO[:3], {**KTO[3], "prompt": long["prompt"]}])
    assert f"{kto}:4: the prompt takes" in error(lambda: load(tok, kto, "kto", seq_len=32))


@pytest.mark.parametrize(
    ("objective", "data", "words", "hint"),
    [
        ("dpo", "tiny-instruct.jsonl", "needs preference pairs (chosen, rejected), but the data "
         "is instruction format", 'set train.objective = "sft"'),
        ("orpo", "tiny-kto.jsonl", "but the data is KTO records", 'train.objective = "kto"'),
        ("kto", "tiny-preferences.jsonl", "needs KTO records", 'train.objective = "dpo"'),
    ],
)  # fmt: skip
def test_an_objective_on_data_it_does_not_train_on(tok, objective, data, words, hint):
    path = ROOT / "assets" / "data" / data
    text = error(lambda: load(tok, path, objective))
    assert text.startswith(f"{path}: train.objective {objective} ") and words in text
    assert hint in text


def test_a_named_format_is_checked_against_the_objective_before_reading(tok, tmp_path):
    bad = tmp_path / "not-json.jsonl"
    bad.write_text("this is no JSON\n", encoding="utf-8")  # never read: the names disagree
    text = error(lambda: load(tok, bad, "kto", format="preference"))
    assert text.startswith("data.format preference: train.objective kto needs KTO records")
    assert 'set train.objective = "dpo"' in text


def test_sft_on_preference_data_says_which_objective_to_set(tok):
    path = ROOT / "assets" / "data" / "tiny-preferences.jsonl"
    text = error(lambda: load_train_eval(cfg(path), tok, seed=1, seq_len_limit=512, min_blocks=1))
    assert f"{path}:1: the data holds preference pairs" in text
    assert 'set train.objective = "dpo"' in text
    kto = ROOT / "assets" / "data" / "tiny-kto.jsonl"
    text = error(lambda: tokenize_records(KTO[:1], "kto", tok, where=[f"{kto}:1"]))
    assert f"{kto}:1: the data holds KTO records" in text and '"kto"' in text


# ---------------------------------------------------------------- tokens and blocks


def test_string_pair_tokens_are_the_completion_formats(tok, tmp_path):
    """Prompt then response, eos at the end, exactly as the completion format makes them."""
    path = jsonl(tmp_path / "p.jsonl", PAIRS[:3])
    data = load_pairs(cfg(path), tok, objective="dpo", seq_len_limit=None)
    for rec, pair in zip(PAIRS[:3], data.pairs, strict=True):
        for side in ("chosen", "rejected"):
            (sft,) = tokenize_records(
                [{"prompt": rec["prompt"], "completion": rec[side]}], "completion", tok
            )
            assert pair.prompt + getattr(pair, side) == sft.input_ids
            n = len(pair.prompt)
            assert sft.labels[n:] == getattr(pair, side) and set(sft.labels[:n]) == {-100}


def test_chat_pair_tokens_are_the_sft_chat_template(tok, tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [CHAT_PAIR])
    (pair,) = load_pairs(cfg(path), tok, objective="dpo", seq_len_limit=None).pairs
    for side in ("chosen", "rejected"):
        (sft,) = tokenize_records([{"messages": CHAT_PAIR[side]}], "chat", tok)
        assert pair.prompt + getattr(pair, side) == sft.input_ids
        trained = [i for i, label in zip(sft.input_ids, sft.labels, strict=True) if label >= 0]
        assert getattr(pair, side) == trained  # the response: what SFT trains on, nothing else
    assert tok.decode(pair.prompt).endswith("<|assistant|>\n")


def test_pairs_are_tokenized_once_into_the_token_cache(tok, tmp_path):
    path = jsonl(tmp_path / "p.jsonl", PAIRS[:8])
    first = load_pairs(cfg(path), tok, objective="dpo", seq_len_limit=None)
    again = load_pairs(cfg(path, seq_len=32, pack=False), tok, objective="orpo",
                       seq_len_limit=None)  # fmt: skip
    assert (first.cache, again.cache) == ("built", "hit") and first.key == again.key
    assert again.pairs == first.pairs and len(first.pairs) == 8
    assert again.pairs[3].where == f"{path}:4"
    uses = [u["use"] for u in token_cache.uses(token_cache.cache_root() / first.key)]
    assert uses == ["built", "hit"]
    # SFT samples of the same file are another entry (the key differs by kind="pairs").
    identity = resolve_source(str(path), "train").identity()
    sft_key = token_cache.cache_key(tok, identity, format="auto", columns={}, split=None)
    assert first.key != sft_key and token_cache.read(first.key) is None


def pair(prompt: int, chosen: int, rejected: int, where: str = "f:1") -> PairExample:
    """A pair of the given lengths, tokens numbered so sequences can be told apart."""
    return PairExample(
        list(range(1, prompt + 1)),
        list(range(100, 100 + chosen)),
        list(range(200, 200 + rejected)),
        where,
    )


def test_packed_blocks_hold_whole_pairs_positions_restart_and_sequence_ids(tmp_path):
    from homelab_dp.data.preference_blocks import build_pair_blocks, units_of

    pairs = [pair(5, 6, 3), pair(4, 20, 9), pair(3, 2, 2), pair(6, 10, 12)]
    units, same = units_of(pairs, "preference", 16, seed=0)
    blocks = build_pair_blocks(units, 16, True, pad_id=0)
    assert same == 0 and sum(b.n_pairs for b in blocks) == 4
    seen = []
    for b in blocks:
        assert len(b.input_ids) == 1 and b.row_len == 32 and b.desirable == []
        seqs = sequences(b)
        assert sorted(seqs) == list(range(2 * b.n_pairs))
        for s, (x, y, pos) in seqs.items():
            assert pos == list(range(len(x)))  # positions restart at every sequence
            resp = [t for t in y if t != IGNORE_INDEX]
            assert resp and all(t >= 100 for t in resp)
            assert (resp[0] >= 200) == (s % 2 == 1)  # 2k chosen, 2k+1 rejected
            # Shifted: the target of each position is the next input of the same sequence.
            assert all(y[t] == x[t + 1] for t in range(len(x) - 1) if y[t] != IGNORE_INDEX)
        pad = [t for t, s in enumerate(b.sequence[0]) if s < 0]
        assert all(b.attention_mask[0][t] == 0 and b.labels[0][t] == IGNORE_INDEX for t in pad)
        assert [b.position_ids[0][t] for t in pad] == list(range(len(pad)))
        seen += [x for s, (x, _, _) in seqs.items() if s % 2 == 0]
    # Every pair is whole: its chosen sequence's inputs are the prompt and all but eos (the
    # 24-token one truncated to seq_len inputs).
    assert sorted(len(x) for x in seen) == [4, 10, 15, 16]


def test_unpacked_blocks_are_one_pair_in_two_padded_rows():
    from homelab_dp.data.preference_blocks import build_pair_blocks, units_of

    units, _ = units_of([pair(3, 4, 2)], "preference", 10, seed=0)
    (b,) = build_pair_blocks(units, 10, False, pad_id=7)
    assert b.n_pairs == 1 and len(b.input_ids) == 2 and b.row_len == 10
    assert b.input_ids == [[1, 2, 3, 100, 101, 102, 7, 7, 7, 7], [1, 2, 3, 200, 7, 7, 7, 7, 7, 7]]
    assert b.labels == [
        [-100, -100, 100, 101, 102, 103, -100, -100, -100, -100],
        [-100, -100, 200, 201, -100, -100, -100, -100, -100, -100],
    ]
    assert b.attention_mask == [[1] * 6 + [0] * 4, [1] * 4 + [0] * 6]
    assert b.sequence == [[0] * 6 + [-1] * 4, [1] * 4 + [-1] * 6]
    assert b.position_ids == [list(range(10))] * 2
    assert b.num_targets == 6


def test_a_long_response_is_truncated_to_seq_len_inputs():
    from homelab_dp.data.preference_blocks import build_pair_blocks, units_of

    units, _ = units_of([pair(4, 30, 2)], "preference", 8, seed=0)
    (b,) = build_pair_blocks(units, 8, False, pad_id=0)
    assert b.input_ids[0] == [1, 2, 3, 4, 100, 101, 102, 103]
    assert b.labels[0] == [-100, -100, -100, 100, 101, 102, 103, 104]  # 5 of 30 kept
    # A prompt that leaves exactly one response token fits; one more is an error.
    units, _ = units_of([pair(8, 3, 3)], "preference", 8, seed=0)
    assert build_pair_blocks(units, 8, True, 0)[0].num_targets == 2
    with pytest.raises(DataError, match=r"^f:9: the prompt takes 9 tokens"):
        units_of([pair(9, 3, 3, "f:9")], "preference", 8, seed=0)


def test_identical_pairs_are_counted_kept_out_and_warned_once(tok, tmp_path):
    same = {"prompt": "Question: What is 2 + 2?\nAnswer:", "chosen": " 4.", "rejected": " 4."}
    path = jsonl(tmp_path / "p.jsonl", [*PAIRS[:6], same, same])
    got = load(tok, path, pack=False)
    assert got.identical == 2 and len(got.train) == 6
    assert all(b.input_ids[0] != b.input_ids[1] for b in got.train)
    assert identical_warning(got.identical, got.label) == (
        f"warning: {path}: 2 pairs with identical chosen and rejected responses left out of "
        "training (no preference signal)"
    )
    assert identical_warning(0, "x") == ""


def test_kto_partners_are_a_seeded_cycle_without_self_pairs():
    partner = kto_partners(10, seed=3)
    assert sorted(partner) == list(range(10)) and all(partner[i] != i for i in range(10))
    i, cycle = 0, []
    while i not in cycle:
        cycle.append(i)
        i = partner[i]
    assert len(cycle) == 10  # one cycle through every record
    assert partner == kto_partners(10, seed=3) and partner != kto_partners(10, seed=4)
    assert kto_partners(1, seed=0) == [0]


def test_kto_blocks_pair_each_completion_with_another_records(tok, tmp_path):
    path = jsonl(tmp_path / "k.jsonl", KTO[:12])
    data = load_pairs(cfg(path), tok, objective="kto", seq_len_limit=None)
    partner = kto_partners(12, seed=42)
    one = load(tok, path, "kto", pack=False)  # one record per block, in data order
    assert [b.desirable for b in one.train] == [[int(r["label"])] for r in KTO[:12]]
    for i, b in enumerate(one.train):
        p, other = data.pairs[i], data.pairs[partner[i]]
        assert b.input_ids[0][: len(p.prompt) + len(p.chosen) - 1] == (p.prompt + p.chosen)[:-1]
        kl = (p.prompt + other.chosen)[:-1]
        assert b.input_ids[1][: len(kl)] == kl and b.sequence[1][: len(kl)] == [1] * len(kl)
    packed = load(tok, path, "kto", min_blocks=2)  # the same units, packed: same desirables
    flags = sorted(d for b in packed.train for d in b.desirable)
    assert flags == sorted(int(r["label"]) for r in KTO[:12])
    assert all(len(b.desirable) == b.n_pairs for b in packed.train)


def test_eval_fraction_holds_out_pairs_and_eval_path_reads_pairs(tok, tmp_path):
    path = jsonl(tmp_path / "p.jsonl", PAIRS[:40])
    got = load(tok, path, pack=False, eval_fraction=0.25)
    assert got.held_out == 10 and len(got.train) == 30 and len(got.eval) == 10
    train = {tuple(b.input_ids[0]) for b in got.train}
    assert not train & {tuple(b.input_ids[0]) for b in got.eval}
    ev = jsonl(tmp_path / "e.jsonl", PAIRS[40:45])
    got = load(tok, path, pack=False, eval_path=str(ev))
    assert (len(got.train), len(got.eval), got.cache) == (40, 5, ("hit", "built"))


def test_too_few_blocks_for_the_world(tok, tmp_path):
    path = jsonl(tmp_path / "p.jsonl", PAIRS[:3])
    text = error(lambda: load(tok, path, pack=False, min_blocks=4))
    assert f"{path}: 3 preference block(s) (3 pairs), fewer than world size × micro-batch = 4" in (
        text
    )


@pytest.mark.parametrize("kind", ["parquet", "csv", "folder"])
def test_every_loader_gives_the_same_blocks(tok, tmp_path, kind):
    ref = load(tok, jsonl(tmp_path / "ref.jsonl", PAIRS[:12]), pack=False)
    rows = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]}
            for r in PAIRS[:12]]  # fmt: skip
    columns = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    if kind == "csv":
        path = tmp_path / "p.csv"
        with path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        path = tmp_path / "d" / "train.parquet"
        path.parent.mkdir()
        pq.write_table(pa.Table.from_pylist(rows), path)
        path = path.parent if kind == "folder" else path
    got = load(tok, path, pack=False, columns=columns)
    assert got.fmt == "preference" and got.train == ref.train


def test_chat_pairs_in_parquet_and_the_missing_chat_template(tok, tmp_path, monkeypatch):
    """Nested messages survive the columnar reader; a tokenizer without a template is named."""
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([CHAT_PAIR] * 3), path)
    ref = load(tok, jsonl(tmp_path / "chat.jsonl", [CHAT_PAIR] * 3), pack=False)
    assert load(tok, path, pack=False).train == ref.train and len(ref.train) == 3
    monkeypatch.setattr(tok, "chat_template", None)
    text = error(lambda: tokenize_pairs([{"messages": [], "chosen": "a", "rejected": "b"}],
                                        "preference", tok, where=["f.jsonl:7"]))  # fmt: skip
    assert text.startswith("f.jsonl:7: chat pairs need a chat template")
