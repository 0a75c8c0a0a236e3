"""Which GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible, read as CUDA and torch read it.

A user's own ``CUDA_VISIBLE_DEVICES`` restricts the probe, and so the plan and the run, instead
of being overwritten: the probe keeps only the cards it names (`homelab_dp.probe.nvml`), each
still numbered by its NVML index, and the run names the planned ones among them by UUID
(`homelab_dp.supervise.launcher.worker_env`).

How the value is read (the rules of ``torch.cuda._parse_visible_devices``, which follow CUDA's):

- unset: every GPU; set but empty: none.
- Comma-separated entries, all of one form, decided by the first entry: device numbers
  (``"1"``, ``"0,2"``) or GPU UUIDs as NVML and ``nvidia-smi -L`` write them
  (``"GPU-5f3c1a2e-..."``), where a prefix that matches one GPU is enough (``"GPU-5f3c"``).
- Reading stops at the first entry that names no GPU here (a negative number such as ``-1``, a
  number past the last GPU, a UUID prefix that matches no GPU or several, an entry of the other
  form): ``"0,-1,1"`` is GPU 0 alone, ``"-1"`` hides every GPU.
- A GPU named twice hides every GPU: CUDA refuses the whole list.
- Device numbers are NVML indices, the PCI bus order that ``nvidia-smi`` and ``homelab-dp
  probe`` show, as CUDA counts with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``. CUDA's default order
  (``FASTEST_FIRST``) can number mixed cards differently; the notice then says so.
- The order of the entries does not matter here: homelab-dp numbers cards by NVML index.
- MIG instances (``"MIG-..."``, as ``nvidia-smi -L`` lists them; a prefix that matches one is
  enough): CUDA gives a process one MIG instance, the first named, so the card that holds it is
  the one visible card and plans use that slice (`Visibility.mig_uuid`); the rest of the list
  is not used, and the notice says so. A value whose first entry names no MIG instance NVML
  lists here (another machine's, or the older ``MIG-GPU-.../gi/ci`` form) is not applied.

Every child process that may touch CUDA (the training workers, eval, serve replicas, chat,
merge and export) gets its cards from one rule, `cuda_device_env`: ``CUDA_DEVICE_ORDER`` is
``PCI_BUS_ID`` whenever ``CUDA_VISIBLE_DEVICES`` is set, so an NVML index names the same card
for CUDA on a rig of mixed cards.

Pure (stdlib); the probe passes the environment in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
ORDER_ENV = "CUDA_DEVICE_ORDER"


@dataclass(frozen=True)
class Visibility:
    """What ``CUDA_VISIBLE_DEVICES`` does to the GPUs NVML lists."""

    value: str | None
    """The variable as found (None: unset)."""
    indices: tuple[int, ...] | None
    """NVML indices of the visible GPUs, ascending; None: every GPU (unset, or not applied)."""
    notice: str | None = None
    """What it hides and how it was read, for people; None when it hides nothing."""
    mig_uuid: str | None = None
    """The MIG instance it names (its full ``MIG-...`` UUID), which plans use on its card;
    None when it names none."""

    def visible(self, index: int) -> bool:
        return self.indices is None or index in self.indices


def cuda_device_env(env: Mapping[str, str], cards: Sequence[str] | None) -> dict[str, str]:
    """``env`` for a child process that may touch CUDA, limited to ``cards``.

    ``cards`` names the cards the child may see, each by UUID or NVML index (as strings), in
    the order the child numbers them; an empty sequence hides every GPU (a CPU child never
    holds a CUDA context); None keeps ``env``'s own ``CUDA_VISIBLE_DEVICES`` (the probe already
    reads it in NVML order). ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` goes with every setting, because
    NVML indices are PCI bus order while CUDA counts the fastest card first by default: without
    it index 0 can be the other card of a mixed pair.
    """
    out = dict(env)
    if cards is not None:
        out[VISIBLE_ENV] = ",".join(cards)
    if VISIBLE_ENV in out:
        out[ORDER_ENV] = "PCI_BUS_ID"
    return out


def _number(entry: str) -> int:
    """The leading integer of ``entry`` (strtoul as torch applies it); -1 when there is none."""
    m = re.match(r"[+-]?\d+", entry.strip())
    return int(m.group()) if m else -1


def _uuid_index(candidate: str, uuids: Mapping[int, str | None]) -> int:
    """The NVML index of the one GPU whose UUID starts with ``candidate``; -1 for none or many."""
    found = [i for i, uuid in uuids.items() if uuid and uuid.startswith(candidate)]
    return found[0] if len(found) == 1 else -1


_TWICE = object()


def _parse(value: str, count: int, uuids: Mapping[int, str | None]) -> tuple[list[int], object]:
    """The visible NVML indices in the variable's order, and the entry that stopped the reading
    (None if none did; ``_TWICE`` when a GPU is named twice, which hides them all)."""
    entries = value.split(",")
    out: list[int] = []
    by_uuid = value.startswith("GPU-")
    for entry in entries:
        if by_uuid:
            index = _uuid_index(entry, uuids) if entry.startswith("GPU-") else -1
        else:
            index = _number(entry)
            if index >= count:
                index = -1
        if index < 0:
            return out, entry
        if index in out:
            return [], _TWICE
        out.append(index)
    return out, None


def _cards(indices: list[int] | tuple[int, ...], names: Mapping[int, str]) -> str:
    if not indices:
        return "no GPU"
    words = [f"GPU {i}" + (f" ({names[i]})" if i in names else "") for i in indices]
    return ", ".join(words)


def _mig_visibility(
    value: str,
    count: int,
    names: Mapping[int, str],
    slices: Mapping[int, Sequence[str]],
) -> Visibility:
    """``CUDA_VISIBLE_DEVICES`` naming MIG instances: the first one named, if NVML lists it."""
    shown = f"{VISIBLE_ENV}={value!r}"
    first, *rest = value.split(",")
    found = [
        (i, u) for i, listed in slices.items() for u in listed if first and u.startswith(first)
    ]
    if len(found) != 1:
        return Visibility(
            value,
            None,
            f"{shown} names a MIG instance that NVML does not list here, so it is not applied "
            f"(`homelab-dp probe` lists the MIG slices; a run sets {VISIBLE_ENV} to the GPU or "
            f"MIG slice it planned)",
        )
    index, uuid = found[0]
    text = f"{shown} names MIG instance {uuid} of {_cards([index], names)}"
    hidden = [i for i in range(count) if i != index]
    if hidden:
        text += f" and hides {_cards(hidden, names)}"
    text += "; plans and runs use that slice only"
    if rest:
        text += (
            f" (CUDA gives a process one MIG instance, the first named: {len(rest)} more not used)"
        )
    return Visibility(value, (index,), text, mig_uuid=uuid)


def visibility(
    env: Mapping[str, str],
    count: int,
    uuids: Mapping[int, str | None],
    names: Mapping[int, str],
    slices: Mapping[int, Sequence[str]] | None = None,
) -> Visibility:
    """Apply ``env``'s ``CUDA_VISIBLE_DEVICES`` to the ``count`` GPUs NVML lists.

    ``uuids`` and ``names`` map NVML indices to what NVML said of each card (a card that could not
    be opened has neither, so only its number can name it); ``slices`` maps the index of each
    card with MIG on to the UUIDs of its MIG instances.
    """
    value = env.get(VISIBLE_ENV)
    if value is None:
        return Visibility(None, None)
    shown = f"{VISIBLE_ENV}={value!r}"
    if value.startswith("MIG-"):
        return _mig_visibility(value, count, names, slices or {})
    order, stop = _parse(value, count, uuids)
    indices = tuple(sorted(order))
    hidden = [i for i in range(count) if i not in indices]
    if not hidden:
        return Visibility(value, indices)
    if indices:
        text = f"{shown} hides {_cards(hidden, names)}"
    else:
        text = f"{shown} hides every GPU ({_cards(hidden, names)})"
    if stop is _TWICE:
        text += ": it names a GPU twice, and CUDA then refuses the whole list"
    elif stop is not None and value.strip():
        text += f": CUDA stops reading it at {stop!r}, which names no GPU here"
    if indices:
        text += f"; plans and runs use {_cards(indices, names)} only"
    numbers = indices and not value.startswith("GPU-")
    mixed = len({names.get(i) for i in range(count)}) > 1
    if numbers and mixed and env.get(ORDER_ENV, "FASTEST_FIRST") != "PCI_BUS_ID":
        text += (
            f". Its numbers are read as NVML indices (PCI bus order, as `homelab-dp probe` and "
            f"nvidia-smi count); CUDA's default order, fastest first, may number these mixed "
            f"cards differently: set {ORDER_ENV}=PCI_BUS_ID or name the cards by UUID"
        )
    return Visibility(value, indices, text)
