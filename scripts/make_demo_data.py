#!/usr/bin/env python
"""Write the demo datasets in ``assets/data/`` from text this script generates itself.

Everything here is synthetic and belongs to the project (Apache-2.0): an invented world of
small countries (names made from syllables, so no real facts are claimed), arithmetic, unit
conversions, little list tasks and "homelab" questions about GPU memory, batches and energy.
The output is deterministic for a given ``--seed``.

    python scripts/make_demo_data.py            # writes assets/data/tiny-*.jsonl

Files (one JSON object a line):

- ``tiny-text.jsonl``        {"text"}                         prose paragraphs
- ``tiny-completion.jsonl``  {"prompt", "completion"}         a sentence start and its end
- ``tiny-instruct.jsonl``    {"instruction", "input", "output"}  the main demo set
- ``tiny-chat.jsonl``        {"messages": [{"role", "content"}, ...]}  system/user/assistant

``pretraining_corpus()`` gives the prose that ``make_tiny_model.py`` pretrains the tiny model on
(generated on the fly, not committed). It states the same invented facts as prose, never in the
question/answer shape of the fine-tuning sets, so a fine-tune has something visible to learn.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
ROOT = Path(__file__).resolve().parent.parent

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr"]
_ONSETS += ["st", "tr", "th", "sh", "gl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "k", "nd", "rt"]
_EXPORTS = ["tea", "copper", "wool", "glass", "salt", "timber", "figs", "cheese", "paper", "tin"]
_EXPORTS += ["honey", "silk", "rice", "olives", "iron", "clocks", "rope", "pottery"]
_WORDS = ["red", "green", "blue", "small", "quiet", "river", "stone", "cloud", "lamp", "fast"]
_WORDS += ["card", "fan", "cable", "rack", "disk", "node", "model", "batch", "token", "light"]
_SYSTEMS = [
    "You are a helpful homelab assistant. Answer briefly.",
    "You are a patient tutor. Give short, exact answers.",
    "You answer questions about GPUs, numbers and the countries of the atlas.",
]


@dataclass(frozen=True)
class Country:
    """One invented country of the demo atlas."""

    name: str
    capital: str
    language: str
    currency: str
    river: str
    mountain: str
    export: str
    population: int  # thousands


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + rng.choice(_CODAS)).capitalize()


def make_world(seed: int = SEED, n: int = 48) -> list[Country]:
    """The invented atlas: ``n`` countries with distinct names, all made from syllables."""
    rng = random.Random(seed)
    seen: set[str] = set()

    def fresh(syllables: int) -> str:
        while True:
            w = _word(rng, syllables)
            if w not in seen:
                seen.add(w)
                return w

    world = []
    for _ in range(n):
        name = fresh(rng.choice([2, 3]))
        world.append(
            Country(
                name=name,
                capital=fresh(2),
                language=name.rstrip("aeiou") + rng.choice(["ish", "ic", "an", "ese"]),
                currency=fresh(1).lower(),
                river=fresh(2),
                mountain=fresh(2),
                export=rng.choice(_EXPORTS),
                population=rng.randrange(40, 9000),
            )
        )
    return world


# ---------------------------------------------------------------- question / answer pairs


def _atlas_qa(rng: random.Random, world: list[Country]) -> tuple[str, str]:
    c = rng.choice(world)
    kind = rng.randrange(6)
    if kind == 0:
        return f"What is the capital of {c.name}?", f"The capital of {c.name} is {c.capital}."
    if kind == 1:
        return f"Which language do people speak in {c.name}?", f"They speak {c.language}."
    if kind == 2:
        return f"What currency is used in {c.name}?", f"{c.name} pays with the {c.currency}."
    if kind == 3:
        return f"Which river flows through {c.capital}?", f"The {c.river} river."
    if kind == 4:
        return f"What is {c.name} known for?", f"{c.name} is known for its {c.export}."
    return (
        f"What is the highest mountain in {c.name}?",
        f"Mount {c.mountain} is the highest peak in {c.name}.",
    )


def _arith_qa(rng: random.Random) -> tuple[str, str]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randrange(2, 13), rng.randrange(2, 13)
        return f"What is {a} * {b}?", f"{a} * {b} = {a * b}."
    a, b = rng.randrange(1, 100), rng.randrange(1, 100)
    if op == "-":
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", f"{a} - {b} = {a - b}."
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."


_UNITS = [
    ("kilometres", "metres", 1000),
    ("metres", "centimetres", 100),
    ("kilograms", "grams", 1000),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("GiB", "MiB", 1024),
    ("TB", "GB", 1000),
    ("litres", "millilitres", 1000),
    ("kWh", "Wh", 1000),
]


def _unit_qa(rng: random.Random) -> tuple[str, str]:
    big, small, factor = rng.choice(_UNITS)
    n = rng.randrange(1, 50)
    if rng.random() < 0.5:
        return f"Convert {n} {big} to {small}.", f"{n} {big} is {n * factor} {small}."
    return f"Convert {n * factor} {small} to {big}.", f"{n * factor} {small} is {n} {big}."


_SIZES = [0.5, 1, 1.5, 3, 7, 8, 13, 14, 32, 70]
_CARDS = [8, 12, 16, 24, 48, 80]


def _num(x: float) -> str:
    return f"{x:g}"


def _a(x: float) -> str:
    """The article for a number read aloud: "an 8B model", "a 7B model"."""
    return "an" if _num(x).startswith(("8", "11", "18")) else "a"


def _homelab_qa(rng: random.Random) -> tuple[str, str]:
    p = rng.choice(_SIZES)
    kind = rng.randrange(5)
    if kind == 0:
        dtype, nbytes = rng.choice([("bf16", 2), ("fp32", 4), ("int8", 1), ("4-bit", 0.5)])
        return (
            f"How much memory do the weights of {_a(p)} {_num(p)}B model take in {dtype}?",
            f"About {_num(p * nbytes)} GB: {_num(p)} billion parameters times {_num(nbytes)} bytes.",
        )
    if kind == 1:
        gb, n = rng.choice(_CARDS), rng.choice([1, 2, 4, 8])
        return (
            f"Can I fully fine-tune {_a(p)} {_num(p)}B model with AdamW on {n} cards of {gb} GB?",
            _fit_answer(p, gb, n),
        )
    if kind == 2:
        mb, w, acc = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8])
        return (
            f"Micro-batch {mb}, {w} GPUs and gradient accumulation {acc}: what is the effective batch?",
            f"{mb * w * acc} sequences: {mb} * {w} * {acc}.",
        )
    if kind == 3:
        watts, hours = rng.choice([150, 200, 250, 300, 350, 450]), rng.randrange(1, 13)
        return (
            f"A card draws {watts} W for {hours} hours. How much energy is that?",
            f"{watts * hours} Wh, or {_num(watts * hours / 1000)} kWh.",
        )
    return (
        f"How many bytes per parameter does a full fine-tune of {_a(p)} {_num(p)}B model need with mixed-precision AdamW?",
        f"16 bytes per parameter, about {_num(16 * p)} GB: 2 for bf16 weights, 2 for gradients and 12 for the fp32 master copy and the two moments.",
    )


def _fit_answer(p: float, gb: int, n: int) -> str:
    states = 16 * p
    if states <= gb:
        return f"Yes, with DDP: the model states take about {_num(states)} GB on each card."
    if n > 1 and states / n <= gb:
        return (
            f"Not with DDP ({_num(states)} GB per card), but full sharding with FSDP "
            f"brings it to about {_num(round(states / n, 1))} GB per card."
        )
    if 2 * p <= gb:
        return (
            f"Not a full fine-tune ({_num(states)} GB of model states), but LoRA fits: "
            f"the frozen bf16 weights take about {_num(2 * p)} GB."
        )
    if 0.53 * p <= gb:
        return f"Only with QLoRA: the 4-bit weights take about {_num(round(0.53 * p, 1))} GB."
    return f"No: even 4-bit weights take about {_num(round(0.53 * p, 1))} GB, more than {gb} GB."


def _list_task(rng: random.Random, world: list[Country]) -> tuple[str, str, str]:
    kind = rng.randrange(6)
    nums = [rng.randrange(1, 100) for _ in range(rng.randrange(3, 7))]
    words = rng.sample(_WORDS, rng.randrange(3, 7))
    if kind == 0:
        return (
            "Sort these numbers from smallest to largest.",
            ", ".join(map(str, nums)),
            ", ".join(map(str, sorted(nums))),
        )
    if kind == 1:
        return "Add up these numbers.", ", ".join(map(str, nums)), f"The sum is {sum(nums)}."
    if kind == 2:
        return "Reverse the order of these words.", " ".join(words), " ".join(reversed(words))
    if kind == 3:
        return "Write this in capital letters.", " ".join(words), " ".join(words).upper()
    if kind == 4:
        return "Count the words.", " ".join(words), f"There are {len(words)} words."
    c = rng.choice(world)
    return "Which country has this capital?", c.capital, f"{c.capital} is the capital of {c.name}."


def _qa(rng: random.Random, world: list[Country]) -> tuple[str, str]:
    r = rng.random()
    if r < 0.3:
        return _atlas_qa(rng, world)
    if r < 0.55:
        return _arith_qa(rng)
    if r < 0.75:
        return _unit_qa(rng)
    return _homelab_qa(rng)


# ---------------------------------------------------------------- prose


def _country_paragraph(rng: random.Random, c: Country) -> str:
    sentences = [
        f"{c.name} is a small country whose capital is {c.capital}.",
        f"People in {c.name} speak {c.language} and pay with the {c.currency}.",
        f"The {c.river} river flows through {c.capital}, the capital of {c.name}.",
        f"{c.name} is known for its {c.export}.",
        f"Mount {c.mountain} is the highest peak in {c.name}.",
        f"About {c.population} thousand people live in {c.name}.",
    ]
    rng.shuffle(sentences)
    return " ".join(sentences[: rng.randrange(3, 7)])


def _numbers_paragraph(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randrange(3, 7)):
        a, b = rng.randrange(1, 100), rng.randrange(1, 100)
        big, small, factor = rng.choice(_UNITS)
        n = rng.randrange(1, 50)
        out.append(
            rng.choice(
                [
                    f"{a} plus {b} makes {a + b}.",
                    f"If you take {min(a, b)} from {max(a, b)}, {max(a, b) - min(a, b)} is left.",
                    f"{a % 12 + 1} times {b % 12 + 1} is {(a % 12 + 1) * (b % 12 + 1)}.",
                    f"There are {factor} {small} in one {big.rstrip('s')}, so {n} {big} make {n * factor} {small}.",
                ]
            )
        )
    return " ".join(out)


def _homelab_paragraph(rng: random.Random) -> str:
    p, gb = rng.choice(_SIZES), rng.choice(_CARDS)
    mb, w, acc = rng.choice([1, 2, 4]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8])
    sentences = [
        f"A model with {_num(p)} billion parameters needs about {_num(2 * p)} GB for its bf16 weights.",
        f"Training it fully with AdamW takes about {_num(16 * p)} GB of model states.",
        f"A card with {gb} GB of memory also needs room for activations and the logits.",
        f"With a micro-batch of {mb} on {w} cards and {acc} accumulation steps the effective batch is {mb * w * acc}.",
        "Data parallel training keeps a full copy of the model on every card and averages the gradients.",
        "Sharding splits the optimizer state, the gradients and the weights across the cards.",
        "LoRA trains small adapters and leaves the base weights frozen.",
        "A slow card slows every card, because all of them wait for the gradient exchange.",
    ]
    rng.shuffle(sentences)
    return " ".join(sentences[: rng.randrange(3, 6)])


def _paragraph(rng: random.Random, world: list[Country]) -> str:
    r = rng.random()
    if r < 0.5:
        return _country_paragraph(rng, rng.choice(world))
    if r < 0.75:
        return _numbers_paragraph(rng)
    return _homelab_paragraph(rng)


# ---------------------------------------------------------------- datasets


def text_records(rng: random.Random, world: list[Country], n: int) -> list[dict]:
    """{"text"} records: prose paragraphs."""
    return [{"text": _paragraph(rng, world)} for _ in range(n)]


def completion_records(rng: random.Random, world: list[Country], n: int) -> list[dict]:
    """{"prompt","completion"}: a question and its answer (the completion starts with a space)."""
    out = []
    for _ in range(n):
        q, a = _qa(rng, world)
        out.append({"prompt": f"Question: {q}\nAnswer:", "completion": f" {a}"})
    return out


def instruct_records(rng: random.Random, world: list[Country], n: int) -> list[dict]:
    """{"instruction","input","output"}: questions (empty input) and list tasks (with input)."""
    out = []
    for _ in range(n):
        if rng.random() < 0.3:
            instruction, inp, output = _list_task(rng, world)
        else:
            (instruction, output), inp = _qa(rng, world), ""
        out.append({"instruction": instruction, "input": inp, "output": output})
    return out


def chat_records(rng: random.Random, world: list[Country], n: int) -> list[dict]:
    """{"messages"}: an optional system turn, then one to three user/assistant exchanges."""
    out = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.7:
            messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        for _ in range(rng.randrange(1, 4)):
            q, a = _qa(rng, world)
            messages.append({"role": "user", "content": q})
            messages.append({"role": "assistant", "content": a})
        out.append({"messages": messages})
    return out


def pretraining_corpus(seed: int = SEED, n: int = 12000) -> list[str]:
    """Prose paragraphs for pretraining the tiny model (same atlas, other draws)."""
    rng = random.Random(seed + 1)
    world = make_world(seed)
    return [_paragraph(rng, world) for _ in range(n)]


def demo_datasets(seed: int = SEED) -> dict[str, list[dict]]:
    """Every demo dataset by file name, generated in memory."""
    world = make_world(seed)
    return {
        "tiny-text.jsonl": text_records(random.Random(seed + 2), world, 500),
        "tiny-completion.jsonl": completion_records(random.Random(seed + 3), world, 600),
        "tiny-instruct.jsonl": instruct_records(random.Random(seed + 4), world, 2000),
        "tiny-chat.jsonl": chat_records(random.Random(seed + 5), world, 400),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "assets" / "data")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, records in demo_datasets(args.seed).items():
        path = args.out / name
        with path.open("w", encoding="utf-8", newline="\n") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"{path}: {len(records)} records, {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
