"""Sequence parallelism in the plan (issue 38): may a sequence be split, over how many ranks,
and what the split costs (pure: no torch).

``train.sequence_parallel = N`` splits every sequence over N ranks (`homelab_dp.train.
sequence_parallel`: Ulysses-style all-to-alls over the attention heads); the world is data
ranks × N. What the plan needs of it:

- **the checks** (`check_split`): N divides the world, the sequence length and the query heads;
  N is at most the world; every decoder layer's token mixer is attention (a state-space or
  linear-attention mixer carries a state from token to token: its sequence cannot be cut
  between ranks by exchanging heads); the objective is SFT. Each refusal names the field and
  says what to change.
- **the memory** (`split_len`): each rank holds ``seq_len / N`` tokens of every layer's
  activations and of the logits; attention's own tensors, over the whole sequence for
  ``heads / N`` heads, are the same size as those of ``seq_len / N`` tokens of every head. So a
  split option is budgeted as the same option with ``seq_len / N`` tokens per row.
- **the traffic** (`all_to_all_bytes`): four exchanges per attention layer (q, k, v before it,
  the output after), each sending ``(N - 1) / N`` of the tensor; backward sends as much again,
  and activation checkpointing's recompute repeats the forward's.
- **the decision** (`choose_degree`): ``auto`` keeps whole sequences while the run fits one
  card per rank; when it does not, the smallest degree that fits (before any parameter
  offload: the branch comes first in the tree).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from homelab_dp.errors import PresetError
from homelab_dp.planning.model_layers import STATE_KINDS
from homelab_dp.planning.model_spec import ModelSpec

FIELD = "train.sequence_parallel"


def requested(preset: Any) -> int | str:
    """The preset's degree: an int (1: off) or "auto"."""
    value = preset.train.sequence_parallel
    return value if value == "auto" else int(value)


def degree_of(preset: Any) -> int:
    """The resolved degree of ``preset`` (1 while it is still "auto")."""
    value = requested(preset)
    return 1 if value == "auto" else int(value)


def kv_repeats(kv_heads: int, degree: int) -> int:
    """How often each key/value head is repeated so that ``degree`` divides them: 1 when it
    already does, else ``degree / gcd(kv_heads, degree)``, which divides the query heads' group
    size whenever ``degree`` divides the query heads (so the grouped-query mapping holds)."""
    return 1 if kv_heads % degree == 0 else degree // math.gcd(kv_heads, degree)


def unsplittable_reason(spec: ModelSpec) -> str | None:
    """Why ``spec``'s layers cannot be split over ranks by heads, or None when they can."""
    kinds = sorted({m.kind for g in spec.layer_groups for m in g.kind.mixers} & STATE_KINDS)
    if kinds:
        return (f"{spec.model_type} has {', '.join(kinds)} layers, which carry a state from "
                "token to token: a sequence cut between ranks would need that state passed "
                "along, which the all-to-all over attention heads does not do")  # fmt: skip
    return None


def split_problems(spec: ModelSpec, preset: Any, world: int, degree: int) -> list[tuple[str, str]]:
    """``(error, hint)`` for every reason ``degree`` cannot split ``preset`` on ``world`` ranks."""
    if degree <= 1:
        return []
    seq_len = int(preset.data.seq_len)
    out: list[tuple[str, str]] = []
    if degree > world:
        out.append((f"{FIELD} = {degree} is above the world size ({world} processes)",
                    f"set {FIELD} to at most {world}, or plan on more devices"))  # fmt: skip
    elif world % degree:
        out.append((f"{FIELD} = {degree} does not divide the world size ({world} processes)",
                    f"use a divisor of {world}: {_divisors(world)}"))  # fmt: skip
    if seq_len % degree:
        out.append((f"{FIELD} = {degree} does not divide data.seq_len = {seq_len}",
                    f"set data.seq_len to a multiple of {degree} "
                    f"(e.g. {seq_len - seq_len % degree})"))  # fmt: skip
    if spec.heads % degree:
        out.append((f"{FIELD} = {degree} does not divide the {spec.heads} attention heads of "
                    f"{spec.model_type}", f"use a divisor of {spec.heads}: "
                    f"{_divisors(spec.heads)}"))  # fmt: skip
    why = unsplittable_reason(spec)
    if why:
        out.append((f"{FIELD}: {why}", f"set {FIELD} = 1 (or train a shorter data.seq_len)"))
    if preset.train.objective != "sft":
        out.append((f"{FIELD}: splits SFT sequences only, not train.objective = "
                    f"{preset.train.objective!r}", f"set {FIELD} = 1"))  # fmt: skip
    return out


def check_split(spec: ModelSpec, preset: Any, world: int) -> None:
    """Refuse a pinned degree that cannot split ``preset`` on ``world`` ranks (`PresetError`:
    exit 2, the field named, a hint), before anything starts."""
    value = requested(preset)
    if value == "auto":
        return
    problems = split_problems(spec, preset, world, int(value))
    if problems:
        message, hint = problems[0]
        raise PresetError(message, hint=hint, problems=[m for m, _ in problems])


def candidate_degrees(spec: ModelSpec, preset: Any, world: int) -> list[int]:
    """The degrees ``auto`` may choose, smallest first (1 always)."""
    return [1] + [n for n in range(2, world + 1) if not split_problems(spec, preset, world, n)]


def with_degree(preset: Any, degree: int) -> Any:
    """``preset`` with ``train.sequence_parallel`` pinned to ``degree``."""
    return replace(preset, train=replace(preset.train, sequence_parallel=degree))


def choose_degree(
    spec: ModelSpec, preset: Any, world: int, fits: Callable[[Any], bool]
) -> tuple[Any, str | None]:
    """``preset`` with its degree resolved, and the plan's reason line (None: nothing to say).

    ``auto``: 1 when the run fits without splitting (``fits(preset)``, no offload), else the
    smallest degree that fits; 1 again when none does (offload is tried next). A pinned
    degree stays (checked by `check_split`)."""
    if requested(preset) != "auto":
        degree = degree_of(preset)
        return preset, (split_reason(spec, preset, degree, chosen=False) if degree > 1 else None)
    whole = with_degree(preset, 1)
    options = candidate_degrees(spec, preset, world)
    if len(options) == 1 or fits(whole):
        return whole, None
    for n in options[1:]:
        split = with_degree(preset, n)
        if fits(split):
            return split, split_reason(spec, preset, n, chosen=True)
    return whole, (f"Sequence parallelism (auto): no split of data.seq_len = "
                   f"{preset.data.seq_len} over {', '.join(map(str, options[1:])) or 'no'} "
                   "ranks fits either; whole sequences, offload next.")  # fmt: skip


def params_on_cards(chosen: Any) -> bool:
    """Whether the decision tree's choice (a `Candidate`, or None: nothing fits) fits with the
    parameters on the cards: what a split must reach, as it comes before parameter offload."""
    return chosen is not None and chosen.offload != "params"


def split_reason(spec: ModelSpec, preset: Any, degree: int, *, chosen: bool) -> str:
    """The plan's line for a split of ``degree``."""
    seq = int(preset.data.seq_len)
    why = ("the sequence does not fit one card, so auto split it (before offloading the "
           "parameters)" if chosen else f"{FIELD} = {degree}")  # fmt: skip
    rep = kv_repeats(spec.kv_heads, degree)
    kv = f"; the {spec.kv_heads} key/value head(s) repeated ×{rep}" if rep > 1 else ""
    return (f"Sequence parallelism: every sequence of {seq} tokens split over {degree} ranks "
            f"({seq // degree} tokens each, attention over the whole sequence for "
            f"{spec.heads // degree} of {spec.heads} heads{kv}): {why}.")  # fmt: skip


def split_len(seq_len: int, degree: int) -> int:
    """Tokens of every sequence one rank holds."""
    return seq_len // max(1, degree)


def all_to_all_bytes(spec: ModelSpec, *, degree: int, micro_batch: int, local_len: int,
                     width: int, checkpointing: bool) -> float:  # fmt: skip
    """Bytes one rank sends in the all-to-alls of one micro-step (forward, backward and any
    recompute), over every attention layer: q, k, v and the output, ``(N - 1) / N`` of each."""
    if degree <= 1:
        return 0.0
    kv = spec.kv_heads * kv_repeats(spec.kv_heads, degree)
    per_token = (2 * spec.heads + 2 * kv) * spec.head_dim * width
    passes = 3 if checkpointing else 2
    per_layer = micro_batch * local_len * per_token * (degree - 1) / degree
    return passes * per_layer * max(1, spec.layers)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
