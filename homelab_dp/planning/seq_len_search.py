"""`plan --find-seq-len` applied to the planner: the longest `data.seq_len` of the preset's
decision tree and of every candidate, what limits it and what would lift it (pure).

The answer's types and the search are `homelab_dp.planning.seq_len_finder`; this module runs the
decision tree's options (`homelab_dp.planning.planner.option_stages`, ``option_settings``) at
each length tried, as `plan_largest_micro_batch` does for the micro-batch.
"""

from __future__ import annotations

from dataclasses import replace

from homelab_dp.planning import sequence_split as split
from homelab_dp.planning.memory.memory_calibration import HardwareCalibration
from homelab_dp.planning.memory.mlp_tiles import tiled_mlp_refusal
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.planning.plan_hardware import PlanHardware
from homelab_dp.planning.plan_result import SAFETY_MARGIN, Candidate
from homelab_dp.planning.planner import (
    _decide,
    _shape_of,
    evaluate,
    resolve_dtype,
    supported,
)
from homelab_dp.planning.seq_len_finder import (
    MAX_SEQ_LEN,
    Lift,
    SeqLenFinder,
    SeqLenFit,
    limit_parts,
    search_seq_len,
)
from homelab_dp.presets.preset import Preset
from homelab_dp.vocabulary import DISTRIBUTIONS, METHODS


def _at(preset: Preset, seq_len: int) -> Preset:
    return replace(preset, data=replace(preset.data, seq_len=seq_len))


def tree_choice(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    calibration: HardwareCalibration | None = None,
) -> Candidate | None:
    """The option the decision tree chooses for ``preset`` on ``hw``, or None when nothing fits:
    stage by stage (offload only after every option without it), the options in order, each
    setting (checkpointing, tiled MLP) in order; in the first stage with a fit, the one moving
    the fewest bytes over PCIe: the planner's own `_decide`, host RAM not checked."""
    return _decide(spec, preset, hw, resolve_dtype(preset, hw), calibration, None)[0]


def longest(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    calibration: HardwareCalibration | None = None,
    *,
    granule: int = 1,
) -> SeqLenFit:
    """The longest `data.seq_len` (a multiple of ``granule``) at which ``preset``'s decision tree
    fits on ``hw``, with the option chosen there and what limits it one granule further."""
    limit = hw.budget(SAFETY_MARGIN)
    t = preset.train
    high = spec.max_positions or MAX_SEQ_LEN  # a run refuses a longer data.seq_len
    best = search_seq_len(
        lambda n: tree_choice(spec, _at(preset, n), hw, calibration) is not None,
        granule=granule, high=max(granule, high),
    )  # fmt: skip
    c = tree_choice(spec, _at(preset, max(best, granule)), hw, calibration) if best else None
    method = c.method if c else (t.method if t.method != "auto" else "qlora")
    dist = c.distribution if c else (t.distribution if t.distribution != "auto" else "ddp")
    if c is None:
        ok = supported(method, dist, hw, resolve_dtype(preset, hw))[0]
        return SeqLenFit(method, dist, 0, supported=ok, limit_bytes=limit)
    if best + granule > high:  # the model's positions end before the memory does
        return SeqLenFit(
            c.method, c.distribution, best, True, c.activation_checkpointing, c.tiled_mlp,
            c.offload, c.offload_activations, c.budget.total, limit, "positions",
        )  # fmt: skip
    over = _at(preset, best + granule)
    past = evaluate(spec, over, hw, c.method, c.distribution, c.activation_checkpointing,
                    calibration, offload=c.offload, offload_activations=c.offload_activations,
                    tiled_mlp=c.tiled_mlp)  # fmt: skip
    parts = limit_parts(spec, _shape_of(over, hw, past), past.budget.activations)
    ranked = tuple(sorted(parts.items(), key=lambda kv: -kv[1]))
    return SeqLenFit(
        c.method, c.distribution, best, True, c.activation_checkpointing, c.tiled_mlp, c.offload,
        c.offload_activations, c.budget.total, limit, ranked[0][0] if ranked else "", ranked,
    )  # fmt: skip


def _pinned(preset: Preset, **train: object) -> Preset:
    return replace(preset, train=replace(preset.train, **train))


def lifts(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    chosen: SeqLenFit,
    calibration: HardwareCalibration | None = None,
    *,
    granule: int = 1,
) -> list[Lift]:
    """What one more setting would give the chosen method and distribution: the MLP tiled, the
    checkpoints (saved layer inputs) offloaded to host RAM, QLoRA, each with its longest length;
    and a split of each sequence over two cards (`train.sequence_parallel = 2`): computed on
    two or more cards, in words on one."""
    t = preset.train
    base = _pinned(preset, method=chosen.method, distribution=chosen.distribution)
    out: list[Lift] = []

    def lift(setting: str, words: str, p: Preset) -> None:
        n = longest(spec, p, hw, calibration, granule=granule).max_seq_len
        if n > chosen.max_seq_len:
            out.append(Lift(setting, words, n))

    if t.tiled_mlp == "off" and not tiled_mlp_refusal(spec):
        lift('train.tiled_mlp = "on"', "each layer's MLP in tiles along the sequence, "
             "recomputed in backward", _pinned(base, tiled_mlp="on"))  # fmt: skip
    if hw.kind == "cuda" and t.offload_activations is False:
        lift("train.offload_activations = true with train.activation_checkpointing = true",
             "the checkpointed layer inputs in pinned host RAM, PCIe copies each step",
             _pinned(base, offload_activations=True, activation_checkpointing=True))  # fmt: skip
    elif t.activation_checkpointing is False:
        lift("train.activation_checkpointing = true", "each layer's input saved, the layer "
             "recomputed in backward", _pinned(base, activation_checkpointing=True))  # fmt: skip
    if chosen.method != "qlora" and t.method in ("auto", chosen.method):
        lift('train.method = "qlora"', "a 4-bit base: the weights' bytes go to activations",
             _pinned(base, method="qlora"))  # fmt: skip
    splits = t.sequence_parallel == 1 and split.unsplittable_reason(spec) is None
    if splits and hw.world_size >= 2 and spec.heads % 2 == 0:
        # Two of the cards hold one sequence: the longest length a split of 2 fits, computed.
        n = longest(spec, _pinned(base, sequence_parallel=2), hw, calibration,
                    granule=2 * granule).max_seq_len  # fmt: skip
        if n > chosen.max_seq_len:
            out.append(Lift("train.sequence_parallel = 2", "each sequence split over two cards "
                            "(attention over the whole sequence for half the heads each)", n))  # fmt: skip
    elif splits and hw.kind == "cuda" and hw.world_size == 1:
        out.append(Lift("a second card with train.sequence_parallel = 2", "each sequence split "
                        "over both cards: each holds half of every activation", None))  # fmt: skip
    return out


def find_seq_len(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    calibration: HardwareCalibration | None = None,
    *,
    granule: int = 1,
) -> SeqLenFinder:
    """`plan --find-seq-len`: the longest length of ``preset``'s decision tree, of every
    (method, distribution) candidate with the preset's other settings, and the lifts."""
    chosen = longest(spec, preset, hw, calibration, granule=granule)
    dtype = resolve_dtype(preset, hw)
    candidates = []
    for m in METHODS:
        for d in DISTRIBUTIONS:
            if not supported(m, d, hw, dtype)[0]:
                candidates.append(SeqLenFit(m, d, 0, supported=False))
                continue
            p = _pinned(preset, method=m, distribution=d)
            candidates.append(longest(spec, p, hw, calibration, granule=granule))
    return SeqLenFinder(
        chosen, tuple(candidates), tuple(lifts(spec, preset, hw, chosen, calibration,
                                               granule=granule)),
        micro_batch=preset.train.micro_batch, planned_seq_len=preset.data.seq_len,
        max_positions=spec.max_positions,
    )  # fmt: skip
