"""Data sets through the ``datasets`` library (`homelab_dp.data.sources`): Parquet, CSV and JSON
files, folders by split and Hub ids from the local cache, data.columns, ShareGPT, the rows a
problem names, and the token cache (`homelab_dp.data.token_cache`) that tokenizes them once.

Each source is compared with the same records written as JSON lines: the blocks must be equal.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from homelab_dp.data import token_cache
from homelab_dp.data.eval_split import load_dataset, load_train_eval
from homelab_dp.data.samples import load_examples
from homelab_dp.errors import DataError
from homelab_dp.presets.preset import DataSection

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "assets" / "models" / "tiny-llama"
INSTRUCT = [json.loads(x) for x in (ROOT / "assets/data/tiny-instruct.jsonl").open()][:24]
CHAT = [json.loads(x) for x in (ROOT / "assets/data/tiny-chat.jsonl").open()][:12]
QA = [
    {"question": r["instruction"], "context": r["input"], "answer": r["output"]} for r in INSTRUCT
]
MAP = {"instruction": "question", "input": "context", "output": "answer"}
GPT = {"user": "human", "assistant": "gpt", "system": "system"}
SHAREGPT = [
    {"conversations": [{"from": GPT[m["role"]], "value": m["content"]} for m in r["messages"]]}
    for r in CHAT
]


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(MODEL)


def cfg(path: Path | str, **kw) -> DataSection:
    return DataSection(path=str(path), seq_len=kw.pop("seq_len", 64), **kw)


def jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def parquet(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def write_csv(path: Path, records: list[dict]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    return path


def blocks(tok, data: DataSection):
    return load_dataset(data, tok, seq_len_limit=512, min_blocks=1)


def error(fn, *args, **kw) -> str:
    with pytest.raises(DataError) as err:
        fn(*args, **kw)
    assert err.value.hint and err.value.exit_code == 2
    return str(err.value)


def test_parquet_csv_and_json_with_columns_equal_the_same_records_as_json_lines(tok, tmp_path):
    reference = blocks(tok, cfg(jsonl(tmp_path / "ref.jsonl", INSTRUCT)))
    assert len(reference) >= 4
    qa = parquet(tmp_path / "qa.parquet", QA)
    assert blocks(tok, cfg(qa, columns=MAP)) == reference
    # CSV: every cell a string, an empty cell "" (an instruction without input), so a
    # number-like answer stays text.
    assert any(r["input"] == "" for r in INSTRUCT)
    assert blocks(tok, cfg(write_csv(tmp_path / "qa.csv", QA), columns=MAP)) == reference
    numbers = [{**r, "answer": "42"} for r in QA[:4]]
    got = load_examples(
        cfg(write_csv(tmp_path / "n.csv", numbers), columns=MAP), tok, seq_len_limit=None
    )
    assert got.fmt == "instruction" and len(got.examples) == 4
    (tmp_path / "qa.json").write_text(json.dumps(QA), encoding="utf-8")  # a JSON list
    assert blocks(tok, cfg(tmp_path / "qa.json", columns=MAP)) == reference
    # The mapped column wins over a column already named like its field.
    clash = [{**r, "output": "not this"} for r in QA]
    assert blocks(tok, cfg(parquet(tmp_path / "c.parquet", clash), columns=MAP)) == reference
    # JSON lines take data.columns too.
    assert blocks(tok, cfg(jsonl(tmp_path / "qa.jsonl", QA), columns=MAP)) == reference


def test_sharegpt_reads_as_chat_in_json_lines_and_parquet(tok, tmp_path):
    reference = blocks(tok, cfg(jsonl(tmp_path / "chat.jsonl", CHAT)))
    for path in (jsonl(tmp_path / "s.jsonl", SHAREGPT), parquet(tmp_path / "s.parquet", SHAREGPT)):
        got = load_examples(cfg(path), tok, seq_len_limit=None)
        assert got.fmt == "chat"
        assert blocks(tok, cfg(path)) == blocks(tok, cfg(path, format="sharegpt")) == reference
    # OpenAI messages in Parquet (a list of structs) are chat as they are.
    assert blocks(tok, cfg(parquet(tmp_path / "m.parquet", CHAT))) == reference
    # A ShareGPT data set under another column name.
    renamed = [{"dialog": r["conversations"]} for r in SHAREGPT]
    data = cfg(jsonl(tmp_path / "d.jsonl", renamed), columns={"conversations": "dialog"})
    assert blocks(tok, data) == reference


def test_bad_rows_are_named_by_file_and_row(tok, tmp_path):
    rows = [dict(r) for r in QA[:6]]
    rows[2]["answer"] = None  # a null cell: the field is missing
    rows[4]["question"] = ""
    path = parquet(tmp_path / "bad.parquet", rows)
    msg = error(blocks, tok, cfg(path, columns=MAP))
    assert msg == (f"{path} row 3: field 'output' missing (and 1 more problem in the file)")
    msg = error(blocks, tok, cfg(path, columns={**MAP, "instruction": "prompt_text"}))
    assert msg.startswith(f"{path}: no column 'prompt_text' (data.columns.instruction); ")
    assert "question, context, answer" in msg
    lines = jsonl(tmp_path / "bad.jsonl", [QA[0], {"q": 1}, QA[1]])
    msg = error(blocks, tok, cfg(lines, columns=MAP))
    assert msg.startswith(f"{lines}:2: column 'question' (data.columns.instruction) missing")
    turns = [dict(r) for r in SHAREGPT[:3]]
    turns[1] = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "x"}]}
    path = write_csv(tmp_path / "t.csv", [{"a": "x"}])
    assert "cannot tell the data format from the keys ('a')" in error(blocks, tok, cfg(path))
    share = parquet(tmp_path / "share.parquet", turns)
    msg = error(blocks, tok, cfg(share))
    assert msg == (
        f"{share} row 2: field 'conversations[1].from' is 'bot'; expected one of human, gpt, system"
    )
    msg = error(blocks, tok, cfg(lines, columns={"answer": "a"}))
    assert msg.startswith("data.columns.answer: not a field of any format")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    msg = error(blocks, tok, cfg(tmp_path / "broken.parquet"))
    assert msg.startswith(f"{tmp_path / 'broken.parquet'}: cannot read it as parquet")
    msg = error(blocks, tok, cfg(tmp_path / "nowhere.jsonl"))
    assert msg == f"data.path: {tmp_path / 'nowhere.jsonl'} does not exist"


def test_folders_by_split_and_eval_from_the_validation_split(tok, tmp_path):
    folder = tmp_path / "qa"
    parquet(folder / "train.parquet", QA[:16])
    write_csv(folder / "validation.csv", QA[16:])
    (folder / "README.md").write_text("# not data\n", encoding="utf-8")
    train_ref = blocks(tok, cfg(jsonl(tmp_path / "t.jsonl", INSTRUCT[:16])))
    eval_ref = blocks(tok, cfg(jsonl(tmp_path / "v.jsonl", INSTRUCT[16:])))
    assert blocks(tok, cfg(folder, columns=MAP)) == train_ref
    assert blocks(tok, cfg(folder, columns=MAP, split="validation")) == eval_ref
    split = load_train_eval(cfg(folder, columns=MAP, eval_path=str(folder)), tok, seed=0,
                            seq_len_limit=None, min_blocks=1)  # fmt: skip
    assert (split.train, split.eval) == (train_ref, eval_ref)
    msg = error(blocks, tok, cfg(folder, columns=MAP, split="test"))
    assert msg == f"data.split: no split 'test' in {folder} (splits found: train, validation)"
    # No split names: every file is train, in name order, each checked with its own rows.
    flat = tmp_path / "flat"
    parquet(flat / "a.parquet", QA[:16])
    jsonl(flat / "b.jsonl", QA[16:])
    assert blocks(tok, cfg(flat, columns=MAP)) == blocks(
        tok, cfg(jsonl(tmp_path / "a.jsonl", INSTRUCT))
    )
    jsonl(flat / "c.jsonl", [{"question": "q", "context": "", "answer": ""}])
    msg = error(blocks, tok, cfg(flat, columns=MAP))
    assert msg.startswith(f"{flat / 'c.jsonl'}:1: field 'output' is empty")


def test_hub_ids_come_from_the_local_cache_only(tok, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "datasets--org--qa"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abc", encoding="utf-8")
    snap = repo / "snapshots" / "0123abc" / "data"
    parquet(snap / "train-00000-of-00001.parquet", QA)
    parquet(snap / "test-00000-of-00001.parquet", QA[:8])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reference = blocks(tok, cfg(jsonl(tmp_path / "ref.jsonl", INSTRUCT)))
    assert blocks(tok, cfg("org/qa", columns=MAP)) == reference
    assert len(blocks(tok, cfg("org/qa", columns=MAP, split="test"))) < len(reference)
    # A dataset card's configs name the splits (as on the Hub), whatever the file names.
    chat = cache / "datasets--org--chat" / "snapshots" / "0123abc"
    parquet(chat / "data" / "sft-00000-of-00001.parquet", SHAREGPT)
    parquet(chat / "data" / "gen-00000-of-00001.parquet", SHAREGPT[:3])
    card = "---\nconfigs:\n- config_name: default\n  data_files:\n"
    card += (
        "  - split: train_sft\n    path: data/sft-*\n  - split: test_gen\n    path: data/gen-*\n"
    )
    (chat / "README.md").write_text(card + "---\n# chat\n", encoding="utf-8")
    (chat.parent.parent / "refs").mkdir()
    (chat.parent.parent / "refs" / "main").write_text("0123abc", encoding="utf-8")
    chat_ref = blocks(tok, cfg(jsonl(tmp_path / "chat.jsonl", CHAT)))
    assert blocks(tok, cfg("org/chat", split="train_sft")) == chat_ref
    msg = error(blocks, tok, cfg("org/chat"))
    assert msg == f"data.split: no split 'train' in {chat} (splits found: train_sft, test_gen)"
    bare = cache / "datasets--org--bare" / "snapshots" / "0123abc"
    bare.mkdir(parents=True)
    (bare / "README.md").write_text("# no data here\n", encoding="utf-8")
    (bare.parent.parent / "refs").mkdir()
    (bare.parent.parent / "refs" / "main").write_text("0123abc", encoding="utf-8")
    assert error(blocks, tok, cfg("org/bare")).startswith(f"data.path: {bare} holds no data files")
    msg = error(blocks, tok, cfg("org/missing", columns=MAP))
    assert msg == (
        f"data.path: the dataset org/missing is not in the Hugging Face cache ({cache}), "
        "and nothing is downloaded here"
    )


def test_the_token_cache_tokenizes_once_and_notices_a_changed_file(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = parquet(tmp_path / "qa.parquet", QA)
    data = cfg(path, columns=MAP)
    first = load_examples(data, tok, seq_len_limit=None)
    second = load_examples(data, tok, seq_len_limit=None)
    assert (first.cache, second.cache) == ("built", "hit") and first.key == second.key
    assert second.examples == first.examples and second.fmt == "instruction"
    folder = token_cache.cache_root() / first.key
    assert folder.parent == tmp_path / "cache" / "homelab-dp" / "tokens"
    assert [u["use"] for u in token_cache.uses(folder)] == ["built", "hit"]
    schema = pa.ipc.open_file(pa.memory_map(str(folder / token_cache.FILE))).schema
    assert schema.field("input_ids").type == pa.list_(pa.int32())
    assert schema.field("labels").type == pa.list_(pa.int32())
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    # A new seq_len reuses the samples; another format, columns or file does not.
    assert load_examples(cfg(path, columns=MAP, seq_len=32), tok, seq_len_limit=None).cache == "hit"
    parquet(path, QA[:20])
    os.utime(path, ns=(1, 1))
    third = load_examples(data, tok, seq_len_limit=None)
    assert third.cache == "built" and third.key != first.key and len(third.examples) == 20
    # A damaged entry is made again, not trusted.
    (token_cache.cache_root() / third.key / token_cache.FILE).write_bytes(b"garbage")
    assert load_examples(data, tok, seq_len_limit=None).cache == "built"


def test_a_cache_hit_loads_no_tokenizer(tmp_path: Path, monkeypatch) -> None:
    """The preflight of data tokenized before reads the cache without loading the tokenizer:
    the key needs only the tokenizer's files, so no transformers import (seconds) happens.
    The samples, their format and the padding id are those of the run that made the entry."""
    import subprocess
    import sys

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the children inherit it
    data = parquet(tmp_path / "qa.parquet", QA)
    doc = {"model": {"path": str(MODEL)},
           "data": {"path": str(data), "columns": MAP, "seq_len": 64}}  # fmt: skip
    code = (
        "import json, sys\n"
        "from homelab_dp.presets.preset import preset_from_dict\n"
        "from homelab_dp.app.runs import check_data\n"
        f"preset = preset_from_dict(json.loads({json.dumps(json.dumps(doc))}))\n"
        "blocks, share, span, warnings = check_data(preset, 128, 2, 2)\n"
        "print(json.dumps([blocks, share, 'transformers' in sys.modules, span]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           check=True, cwd=tmp_path) for _ in range(2)]  # fmt: skip
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert first[2] and not second[2]  # tokenized with transformers, then read without it
    assert first[:2] == second[:2] and first[3] == second[3]
    assert 0 < first[3] <= 64  # keys a token attends over: at most the block's 64 tokens
    (entry,) = [p for p in token_cache.cache_root().iterdir() if p.is_dir()]
    assert [u["use"] for u in token_cache.uses(entry)] == ["built", "hit"]


def test_reading_the_cache_starts_no_thread(tmp_path: Path) -> None:
    """A cache hit maps the file and reads it as a buffer: no pyarrow I/O thread is left
    behind in the rank or CLI that read it (a process exiting with such threads alive has been
    seen to abort after its work was done)."""
    import subprocess
    import sys

    code = (
        "import os\n"
        "from homelab_dp.data import token_cache\n"
        "from homelab_dp.data.tokenize import Example\n"
        "threads = lambda: len(os.listdir('/proc/self/task'))\n"
        "token_cache.write('k', [Example([1, 2, 3], [2, 3, -100])], 'text', 'x', pad_id=0)\n"
        "before = threads()\n"
        "got = token_cache.read('k')\n"
        "print(before, threads(), got.examples[0].input_ids, got.pad_id)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    assert out[0] == out[1], out  # as many threads after the read as before
    assert out[2:] == ["[1,", "2,", "3]", "0"]
