"""The data pipeline: formats, loss masks, packing and padding, detection and every data error."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from homelab_dp.data.blocks import (
    IGNORE_INDEX,
    Block,
    Example,
    best_fit_decreasing,
    build_blocks,
    format_instruction,
    summarize,
    tokenize_records,
)
from homelab_dp.data.eval_split import load_dataset
from homelab_dp.data.samples import detect_format, read_records
from homelab_dp.errors import DataError
from homelab_dp.presets.preset import DataSection

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "assets" / "models" / "tiny-llama"
BAD = ROOT / "tests" / "data" / "bad_data"
BOS, EOS, PAD = 0, 1, 2  # the tiny tokenizer's special ids
X = IGNORE_INDEX


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(MODEL)


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def cfg(path: Path, *, fmt: str = "auto", seq_len: int = 64, pack: bool = True) -> DataSection:
    return DataSection(path=str(path), format=fmt, seq_len=seq_len, pack=pack)


def targets(block: Block) -> list[int]:
    return [t for t in block.labels if t != X]


# ------------------------------------------------------------------ the tiny tokenizer


def test_tiny_tokenizer_special_tokens_and_chat_template(tok):
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS, EOS, PAD)
    assert tok("Hello")["input_ids"][0] == BOS  # it prepends <s> like LLaMA
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
        tokenize=False,
    )
    assert text == "<s><|user|>\nHi</s><|assistant|>\nHello.</s>"


# ------------------------------------------------------------------ formats and masks


def test_text_format_loss_on_every_token_but_the_first(tok):
    (ex,) = tokenize_records([{"text": "Pishu is known for its tea."}], "text", tok)
    body = enc(tok, "Pishu is known for its tea.")
    assert ex.input_ids == [BOS, *body, EOS]
    assert ex.labels == [X, *body, EOS]


def test_completion_loss_on_the_completion_only(tok):
    prompt, completion = "Question: What is 2 + 2?\nAnswer:", " 2 + 2 = 4."
    p, c = enc(tok, prompt), enc(tok, completion)
    assert tok.decode(c) == completion
    (ex,) = tokenize_records([{"prompt": prompt, "completion": completion}], "completion", tok)
    assert ex.input_ids == [BOS, *p, *c, EOS]
    assert ex.labels == [X] * (1 + len(p)) + c + [EOS]

    # After the shift: -100 over the prompt, then exactly the completion tokens and eos.
    (block,) = build_blocks([ex], seq_len=40, pack=False, pad_id=PAD)
    n = len(ex.input_ids)
    assert block.input_ids == ex.input_ids + [PAD] * (40 - n)
    assert block.attention_mask == [1] * n + [0] * (40 - n)
    assert block.labels == [X] * len(p) + c + [EOS] + [X] * (40 - n + 1)
    # labels[t] is the token at t + 1
    for t, label in enumerate(block.labels):
        if label != X:
            assert label == block.input_ids[t + 1]


def test_instruction_template_exact():
    assert format_instruction("Sort these.", "3, 1, 2") == (
        "### Instruction:\nSort these.\n\n### Input:\n3, 1, 2\n\n### Response:\n"
    )
    assert format_instruction("What is 2 + 2?") == (
        "### Instruction:\nWhat is 2 + 2?\n\n### Response:\n"
    )


def test_instruction_loss_on_the_output_only(tok):
    records = [
        {"instruction": "Sort these.", "input": "3, 1, 2", "output": "1, 2, 3"},
        {"instruction": "What is 2 + 2?", "output": "4"},  # input may be missing
        {"instruction": "What is 3 + 3?", "input": None, "output": "6"},  # or null
    ]
    examples = tokenize_records(records, "instruction", tok)
    for record, ex in zip(records, examples, strict=True):
        p = enc(tok, format_instruction(record["instruction"], record.get("input") or ""))
        o = enc(tok, record["output"])
        assert ex.input_ids == [BOS, *p, *o, EOS]
        assert ex.labels == [X] * (1 + len(p)) + o + [EOS]
    assert tok.decode([t for t in examples[0].labels if t != X]) == "1, 2, 3</s>"


def test_chat_loss_on_assistant_turns_only(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of Pishu?"},
        {"role": "assistant", "content": "The capital of Pishu is Vomin."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
    ]
    (ex,) = tokenize_records([{"messages": messages}], "chat", tok)
    rendered = "".join(
        f"<|{m['role']}|>\n{m['content']}</s>" for m in messages
    )  # the tiny template
    assert ex.input_ids == enc(tok, "<s>" + rendered)
    # The loss covers each assistant content and its </s>, nothing else (no header, no user).
    spans, current = [], []
    for i, label in zip(ex.input_ids, ex.labels, strict=True):
        if label != X:
            assert label == i
            current.append(i)
        elif current:
            spans.append(tok.decode(current))
            current = []
    spans += [tok.decode(current)] if current else []
    assert spans == ["The capital of Pishu is Vomin.</s>", "2 + 2 = 4.</s>"]


def test_chat_needs_a_chat_template(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(DataError, match="chat template"):
        tokenize_records([{"messages": [{"role": "assistant", "content": "Hi."}]}], "chat", tok)


def test_chat_template_refusal_names_the_record(tok, monkeypatch):
    strict = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversations must start with a user turn') }}{% endif %}"
        + tok.chat_template
    )
    monkeypatch.setattr(tok, "chat_template", strict)
    records = [{"messages": [{"role": "assistant", "content": "Hi."}]}]
    with pytest.raises(DataError) as err:
        tokenize_records(records, "chat", tok, where=["chat.jsonl:7"])
    assert str(err.value) == (
        "chat.jsonl:7: the model's chat template refused this conversation: "
        "Conversations must start with a user turn"
    )


def test_txt_file_is_text_one_record_per_paragraph(tok):
    path = BAD / "paragraphs.txt"
    assert detect_format(path) == "text"
    assert read_records(path, "auto") == [
        {"text": "The first paragraph\nspans two lines."},
        {"text": "The second paragraph."},
    ]


def test_tokenizer_without_leading_bos_masks_the_first_token(tok):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    raw.post_processor = None  # GPT-2 style: no <s> added
    plain = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", pad_token="<pad>")
    (ex,) = tokenize_records([{"text": "tea"}], "text", plain)
    body = enc(tok, "tea")
    assert ex.input_ids == [*body, EOS]
    assert ex.labels == [X, *body[1:], EOS]


# ------------------------------------------------------------------ packing and padding


def segments(block: Block) -> list[tuple[list[int], list[int]]]:
    """A packed block's runs (inputs, labels), cut where the positions restart at 0."""
    starts = [t for t, p in enumerate(block.position_ids) if p == 0] + [len(block.position_ids)]
    return [
        (block.input_ids[a:b], block.labels[a:b]) for a, b in zip(starts, starts[1:], strict=False)
    ]


def ragged(n: int, seed: int, longest: int = 60) -> list[Example]:
    """n samples of 2..longest tokens, some with a masked prompt (ids are distinct per sample)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        size = rng.randint(2, longest)
        ids = [BOS] + [3 + (i * 7919 + k) % 997 for k in range(size - 2)] + [EOS]
        prompt = rng.randint(1, size - 1)
        out.append(Example(ids, [X] * prompt + ids[prompt:]))
    return out


def test_packing_keeps_samples_whole_and_restarts_positions():
    a = Example([BOS, 10, 11, 12, EOS], [X, 10, 11, 12, EOS])
    b = Example([BOS, 20, 21, EOS], [X, X, 21, EOS])  # 20 is prompt
    (block,) = build_blocks([a, b], seq_len=8, pack=True, pad_id=PAD)
    # n tokens take n - 1 positions: each eos is only a target; then one padding position.
    assert block.input_ids == [BOS, 10, 11, 12, BOS, 20, 21, PAD]
    assert block.labels == [10, 11, 12, EOS, X, 21, EOS, X]
    assert block.position_ids == [0, 1, 2, 3, 0, 1, 2, 0]
    assert block.attention_mask == [1] * 7 + [0]
    # Too small for both: each in its own block, the longer one opened first.
    blocks = build_blocks([b, a], seq_len=5, pack=True, pad_id=PAD)
    assert [blk.input_ids for blk in blocks] == [[BOS, 10, 11, 12, PAD], [BOS, 20, 21, PAD, PAD]]
    assert [blk.position_ids for blk in blocks] == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]


def test_padding_tail_is_a_segment_of_its_own():
    blocks = build_blocks(ragged(200, seed=1), seq_len=64, pack=True, pad_id=PAD)
    tails = 0
    for block in blocks:
        real = sum(block.attention_mask)
        assert block.attention_mask == [1] * real + [0] * (64 - real)
        if real < 64:
            tails += 1
            assert block.position_ids[real:] == list(range(64 - real))
            assert block.input_ids[real:] == [PAD] * (64 - real)
            assert block.labels[real:] == [X] * (64 - real)
            assert segments(block)[-1][0] == [PAD] * (64 - real)
    assert tails > 0


def test_best_fit_decreasing_by_hand():
    # 7 → bin 0 (3 left); 6 → bin 1 (4 left); 3 → the fullest with room: bin 0 (exact);
    # 2 → bin 1 (2 left); 2 → bin 1 (full); 1 → bin 2.
    assert best_fit_decreasing([2, 7, 3, 6, 2, 1], 10) == [[1, 2], [0, 3, 4], [5]]
    # Equal sizes go in index order; equally full bins take them oldest first.
    assert best_fit_decreasing([3, 3, 3, 3, 3], 6) == [[0, 1], [2, 3], [4]]
    assert best_fit_decreasing([4, 4, 2, 2], 6) == [[0, 2], [1, 3]]
    assert best_fit_decreasing([], 8) == []


def test_best_fit_decreasing_is_near_the_optimum_and_finishes_100k_items():
    # Bins cut at random points into items: the optimum is exactly the number of bins.
    rng = random.Random(5)
    sizes: list[int] = []
    for _ in range(2000):
        cuts = sorted(rng.sample(range(1, 256), rng.randint(0, 5)))
        sizes += [b - a for a, b in zip([0, *cuts], [*cuts, 256], strict=True)]
    rng.shuffle(sizes)
    bins = best_fit_decreasing(sizes, 256)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 256 for b in bins)
    assert 2000 <= len(bins) <= 2000 * 1.01  # measured: 2000, the optimum
    # 100k items in well under a second here (a scan of the open bins would take minutes).
    big = [rng.randint(1, 2048) for _ in range(100_000)]
    start = time.perf_counter()
    bins = best_fit_decreasing(big, 2048)
    assert time.perf_counter() - start < 10  # liveness; figure: benchmarks/packing.py (0.12 s)
    assert len(bins) <= -(-sum(big) // 2048) * 1.01  # measured: 49990 for a bound of 49915


def test_best_fit_decreasing_never_splits_a_fitting_sample():
    examples = ragged(500, seed=2)
    blocks = build_blocks(examples, seq_len=64, pack=True, pad_id=PAD)
    runs = [run for block in blocks for run in segments(block) if run[0][0] != PAD]
    # every sample is one run: its inputs ids[:-1] and its targets labels[1:], exactly once
    expected = sorted(
        (ex.input_ids[:-1], ex.labels[1:]) for ex in examples if any(t != X for t in ex.labels[1:])
    )
    assert sorted(runs) == expected
    total = sum(len(ex.input_ids) - 1 for ex in examples)
    assert len(blocks) <= -(-total // 64) * 1.02  # measured: 235 for a bound of 234


def test_packed_and_unpacked_train_the_same_targets_on_ragged_data():
    examples = ragged(300, seed=3)
    packed = build_blocks(examples, seq_len=64, pack=True, pad_id=PAD)
    padded = build_blocks(examples, seq_len=64, pack=False, pad_id=PAD)
    assert sorted(targets(b) for b in packed) != sorted(targets(b) for b in padded)
    assert sorted(t for b in packed for t in targets(b)) == sorted(
        t for b in padded for t in targets(b)
    )
    p, u = summarize(packed), summarize(padded)
    assert (
        p["target_tokens"]
        == u["target_tokens"]
        == sum(sum(t != X for t in ex.labels) for ex in examples)
    )
    assert p["tokens"] == u["tokens"] - len(examples)  # the final eos is no input when packed
    assert p["blocks"] < u["blocks"] == 300
    assert p["fill"] > 0.95 > u["fill"]


def test_long_samples_are_truncated_as_when_padding():
    long = Example([BOS, 10, 11, 12, 13, 14, EOS], [X, X, 11, 12, 13, 14, EOS])
    short = Example([BOS, 20, EOS], [X, 20, EOS])
    packed = build_blocks([long, short], seq_len=4, pack=True, pad_id=PAD)
    padded = build_blocks([long, short], seq_len=4, pack=False, pad_id=PAD)
    assert [b.input_ids for b in packed] == [[BOS, 10, 11, 12], [BOS, 20, PAD, PAD]]
    assert [b.labels for b in packed] == [[X, 11, 12, 13], [20, EOS, X, X]]
    assert packed[0].labels == padded[0].labels  # the same targets, 13 the last
    assert [b.position_ids for b in packed] == [[0, 1, 2, 3], [0, 1, 0, 1]]


def test_text_is_split_into_pieces_sharing_one_token():
    ids = [BOS, *range(10, 19), EOS]  # 11 tokens: 10 transitions
    text = Example(ids, [X, *ids[1:]])
    blocks = build_blocks([text], seq_len=4, pack=True, pad_id=PAD, split=True)
    assert [b.input_ids for b in blocks] == [
        [BOS, 10, 11, 12],
        [13, 14, 15, 16],
        [17, 18, PAD, PAD],
    ]
    assert [b.labels for b in blocks] == [[10, 11, 12, 13], [14, 15, 16, 17], [18, EOS, X, X]]
    assert [b.position_ids for b in blocks] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 0, 1]]
    # every transition (input → its next token) is trained exactly once
    pairs = [(i, t) for b in blocks for i, t in zip(b.input_ids, b.labels, strict=True) if t != X]
    assert pairs == list(zip(ids, ids[1:], strict=False))
    # padding never splits: one truncated block
    (padded,) = build_blocks([text], seq_len=4, pack=False, pad_id=PAD, split=True)
    assert padded.labels == [10, 11, 12, 13]


def test_padding_truncates_and_pads_one_block_per_example():
    long = Example([BOS, 10, 11, 12, 13, 14, EOS], [X, X, 11, 12, 13, 14, EOS])
    short = Example([BOS, 20, EOS], [X, 20, EOS])
    blocks = build_blocks([long, short], seq_len=4, pack=False, pad_id=PAD)
    assert [blk.input_ids for blk in blocks] == [[BOS, 10, 11, 12], [BOS, 20, EOS, PAD]]
    # the truncated example keeps seq_len + 1 tokens: its last target is token 13
    assert [blk.labels for blk in blocks] == [[X, 11, 12, 13], [20, EOS, X, X]]
    assert [blk.attention_mask for blk in blocks] == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert [blk.position_ids for blk in blocks] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert summarize(blocks) == {
        "blocks": 2,
        "tokens": 7,
        "target_tokens": 5,
        "padding_tokens": 1,
        "fill": 7 / 8,
    }


def test_blocks_without_targets_are_dropped():
    prompt_only = Example([BOS, 10, 11, 12, 13, 14, EOS], [X, X, X, X, X, 14, EOS])
    assert build_blocks([prompt_only], seq_len=3, pack=False, pad_id=PAD) == []
    assert build_blocks([prompt_only], seq_len=3, pack=True, pad_id=PAD) == []
    # split into pieces, the last one has the targets
    (block,) = build_blocks([prompt_only], seq_len=3, pack=True, pad_id=PAD, split=True)
    assert block.input_ids == [12, 13, 14] and block.labels == [X, 14, EOS]


def test_demo_instruct_set_packs_into_nearly_full_blocks(tok):
    blocks = load_dataset(
        cfg(ROOT / "assets" / "data" / "tiny-instruct.jsonl", seq_len=256),
        tok,
        seq_len_limit=512,
        min_blocks=8,
    )
    assert all(len(b.input_ids) == len(b.labels) == len(b.position_ids) == 256 for b in blocks)
    padded = load_dataset(
        cfg(ROOT / "assets" / "data" / "tiny-instruct.jsonl", seq_len=256, pack=False),
        tok,
        seq_len_limit=512,
        min_blocks=8,
    )
    assert len(padded) == 2000  # one per record
    # Packing and padding train on exactly the same targets, each sample in one run.
    p, u = summarize(blocks), summarize(padded)
    assert p["target_tokens"] == u["target_tokens"] == 19050
    assert p["tokens"] == u["tokens"] - 2000
    assert sum(len(segments(b)) - (b.attention_mask[-1] == 0) for b in blocks) == 2000
    # measured: 251 blocks for a bound of 245 (fill 0.975; 0.126 padded)
    assert len(blocks) <= -(-p["tokens"] // 256) * 1.03
    assert p["fill"] > 0.97


@pytest.mark.parametrize(
    ("name", "fmt"),
    [("text", "text"), ("completion", "completion"), ("instruct", "instruction"), ("chat", "chat")],
)
def test_every_demo_set_is_detected_and_loads(tok, name, fmt):
    path = ROOT / "assets" / "data" / f"tiny-{name}.jsonl"
    assert detect_format(path) == fmt
    blocks = load_dataset(cfg(path, seq_len=128), tok, seq_len_limit=512, min_blocks=8)
    assert len(blocks) >= 8
    assert all(b.num_targets > 0 for b in blocks)


# ------------------------------------------------------------------ detection


@pytest.mark.parametrize(
    ("record", "fmt"),
    [
        ({"text": "a"}, "text"),
        ({"prompt": "a", "completion": "b"}, "completion"),
        ({"instruction": "a", "input": "", "output": "b"}, "instruction"),
        ({"messages": [], "id": 3}, "chat"),
        ({"id": 7, "text": "a", "source": "x"}, "text"),  # extra keys are fine
    ],
)
def test_detect_format_from_the_first_record(tmp_path, record, fmt):
    path = tmp_path / "d.jsonl"
    path.write_text("\n" + json.dumps(record) + "\n{broken\n", encoding="utf-8")
    assert detect_format(path) == fmt


def test_undetectable_format_names_keys_found_and_accepted():
    with pytest.raises(DataError) as err:
        detect_format(BAD / "unknown-format.jsonl")
    assert str(err.value) == (
        f"{BAD / 'unknown-format.jsonl'}:1: cannot tell the data format from the keys "
        "('question', 'answer')"
    )
    assert '{"prompt","completion"}' in err.value.hint
    assert '{"messages"}' in err.value.hint


# ------------------------------------------------------------------ data errors


@pytest.mark.parametrize(
    ("name", "fmt", "message"),
    [
        ("empty.jsonl", "auto", "empty.jsonl: the file is empty"),
        ("blank-lines.jsonl", "auto", "blank-lines.jsonl: the file is empty"),
        ("bad-json-line.jsonl", "auto", "bad-json-line.jsonl:3: not valid JSON ("),
        ("bad-json-line.jsonl", "instruction", "bad-json-line.jsonl:3: not valid JSON ("),
        (
            "not-an-object.jsonl",
            "auto",
            "not-an-object.jsonl:2: expected a JSON object, got a list",
        ),
        ("not-utf8.jsonl", "auto", "not-utf8.jsonl:2: not UTF-8 text"),
        ("wrong-fields.jsonl", "auto", "wrong-fields.jsonl:2: field 'completion' missing"),
        (
            "wrong-type.jsonl",
            "auto",
            "wrong-type.jsonl:2: field 'text' must be a string, got a number",
        ),
        ("empty-output.jsonl", "auto", "empty-output.jsonl:2: field 'output' is empty"),
        (
            "mixed-formats.jsonl",
            "auto",
            "mixed-formats.jsonl:2: field 'instruction' missing (this record looks like chat",
        ),
        (
            "chat-no-assistant.jsonl",
            "auto",
            "chat-no-assistant.jsonl:2: field 'messages' has no assistant turn (roles: system, user)",
        ),
        (
            "chat-bad-role.jsonl",
            "chat",
            "chat-bad-role.jsonl:1: field 'messages[1].role' is 'bot'; expected one of system, user, assistant",
        ),
        (
            "chat-not-a-list.jsonl",
            "auto",
            "chat-not-a-list.jsonl:1: field 'messages' must be a non-empty list, got a string",
        ),
        ("unknown-format.jsonl", "auto", "unknown-format.jsonl:1: cannot tell the data format"),
        ("wrong-type.jsonl", "chat", "wrong-type.jsonl:1: field 'messages' missing"),
        ("paragraphs.txt", "chat", "paragraphs.txt: a .txt file holds plain text, but data.format"),
    ],
)
def test_each_bad_dataset_is_reported_with_file_line_and_field(tok, name, fmt, message):
    with pytest.raises(DataError) as err:
        load_dataset(cfg(BAD / name, fmt=fmt), tok, seq_len_limit=512, min_blocks=1)
    assert str(err.value).startswith(f"{BAD / name}"), str(err.value)
    assert message in str(err.value)
    assert err.value.hint
    assert err.value.exit_code == 2


def test_every_problem_is_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": 1}\n{"text": ""}\nnope\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_records(path, "text")
    assert str(err.value) == (
        f"{path}:4: not valid JSON (Expecting value, column 1) (and 2 more problems in the file)"
    )


def test_seq_len_beyond_the_model_positions(tok):
    with pytest.raises(DataError) as err:
        load_dataset(
            cfg(ROOT / "assets" / "data" / "tiny-text.jsonl", seq_len=1024),
            tok,
            seq_len_limit=512,
            min_blocks=1,
        )
    assert str(err.value) == (
        "data.seq_len: 1024 is beyond the model's 512 positions (max_position_embeddings)"
    )
    assert err.value.hint == "set data.seq_len to at most 512"


def test_fewer_blocks_than_world_size_times_micro_batch(tok, tmp_path):
    path = write_jsonl(tmp_path / "few.jsonl", [{"text": "tea"}, {"text": "salt"}])
    assert len(load_dataset(cfg(path, pack=False), tok, seq_len_limit=512, min_blocks=2)) == 2
    with pytest.raises(DataError) as err:
        load_dataset(cfg(path, pack=False), tok, seq_len_limit=512, min_blocks=8)
    assert str(err.value) == (
        f"{path}: 2 training sequences of 64 tokens, fewer than world size × micro-batch = 8"
    )
    with pytest.raises(DataError, match=r"1 training sequence of 64 tokens, fewer than"):
        load_dataset(cfg(path, pack=True), tok, seq_len_limit=512, min_blocks=2)


def test_nothing_left_with_loss_after_masking(tok, tmp_path):
    path = write_jsonl(
        tmp_path / "long-prompts.jsonl",
        [{"prompt": "one two three four five six seven eight nine ten", "completion": " x"}],
    )
    with pytest.raises(DataError) as err:
        load_dataset(cfg(path, seq_len=4, pack=False), tok, seq_len_limit=512, min_blocks=1)
    assert str(err.value) == (
        f"{path}: no token is left with a loss after masking "
        "(completion format, seq_len 4, pack false)"
    )


def test_declared_format_must_match_the_records(tok):
    with pytest.raises(DataError) as err:
        load_dataset(
            cfg(ROOT / "assets" / "data" / "tiny-chat.jsonl", fmt="instruction"),
            tok,
            seq_len_limit=512,
            min_blocks=1,
        )
    assert str(err.value).startswith(
        f"{ROOT / 'assets' / 'data' / 'tiny-chat.jsonl'}:1: field 'instruction' missing "
        "(this record looks like chat format) (and "
    )


def test_data_module_does_not_import_torch_or_transformers():
    code = (
        "import sys, homelab_dp.data.blocks; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
