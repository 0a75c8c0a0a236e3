"""What the gradients cross: link bandwidths of NVLink, PCIe with and without P2P, Ethernet, and
the CPU's gloo between processes (pure: no torch).

A ring collective moves its bytes over every hop at once, so its time is set by the slowest
hop of the ring: `ring_link` takes the slowest pair of the planned cards. Figures are one
direction, in bytes a second, at the share of the line rate NCCL's bus bandwidth reaches:

- NVLink: active links × the per-link rate of the card's generation (`NVLINK_GB_PER_LINK`, by
  compute capability: an RTX 3090's NVLink 3 bridge has 4 links of 14.06 GB/s, an A100's
  NVLink 3 12 links of 25 GB/s), at `NVLINK_EFFICIENCY`;
- NVSwitch (HGX A100/H100/H200/B200: NVML says ``nvlink`` with no direct link between the
  pair): the card's own links to the switches (`NVSWITCH_CARD_LINKS`) at the same rate;
- PCIe with P2P: the slower card's PCIe generation × width, at `P2P_EFFICIENCY`;
- PCIe without P2P (GeForce cards on most boards): NCCL stages every chunk through host memory,
  a copy up and a copy down over the same links, at `HOST_BOUNCE_EFFICIENCY` of one PCIe link;
- between machines (`--network 10GbE|25GbE|100GbE|<Gbit/s>`): the network's line rate at
  `NETWORK_EFFICIENCY`;
- on the CPU: gloo between processes on this host, measured once per host and torch version
  (`homelab_dp.train.parallelism.gloo_bandwidth`) and cached here (`read_cached_gloo`, `write_cached_gloo`).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homelab_dp.errors import HardwareSpecError
from homelab_dp.planning.plan_hardware import PlanHardware
from homelab_dp.probe.hardware import GpuLink, pcie_bytes_per_s
from homelab_dp.user_files.paths import cache_home, ensure_private_dir
from homelab_dp.user_files.private_write import read_back, write_private

NVLINK_GB_PER_LINK: dict[tuple[int, int], tuple[str, float]] = {
    (6, 0): ("NVLink 1", 20.0),  # P100
    (7, 0): ("NVLink 2", 25.0),  # V100
    (7, 5): ("NVLink 2", 25.0),  # RTX 2080 Ti / Titan RTX bridge (2 links, 50 GB/s a way)
    (8, 0): ("NVLink 3", 25.0),  # A100
    (8, 6): ("NVLink 3", 14.0625),  # GA102 bridge: RTX 3090, A6000, A40 (4 links, 56.25 GB/s)
    (8, 9): ("NVLink 4", 25.0),  # none ship with a bridge; kept for a data-centre Ada
    (9, 0): ("NVLink 4", 25.0),  # H100/H200 (18 links, 450 GB/s)
    (10, 0): ("NVLink 5", 50.0),  # B200 (18 links, 900 GB/s)
}
"""Compute capability → (NVLink generation, GB/s per link and direction)."""

NVSWITCH_CARD_LINKS: dict[tuple[int, int], int] = {
    (8, 0): 12,  # HGX A100: 12 NVLink 3 links a card to the NVSwitches (300 GB/s a way)
    (9, 0): 18,  # HGX H100/H200, GH200 NVL: 18 NVLink 4 links (450 GB/s)
    (10, 0): 18,  # HGX B200: 18 NVLink 5 links (900 GB/s)
}
"""Compute capability → the NVLink links each card has to its NVSwitches. Through NVSwitch a
pair has no direct link (NVML: ``nvlink`` with 0 links between them), and a ring hop runs at
the card's whole NVLink bandwidth."""

NVLINK_EFFICIENCY = 0.8
"""Share of NVLink's line rate NCCL's ring bus bandwidth reaches (nccl-tests, large messages)."""
P2P_EFFICIENCY = 0.8
"""Share of a PCIe link's line rate P2P copies reach."""
HOST_BOUNCE_EFFICIENCY = 0.22
"""Share of one PCIe link's line rate a DDP step's all-reduce effectively reaches when P2P is
off: every chunk is copied to pinned host memory and back (two crossings, the host's memory
bandwidth shared), and the time model overlaps none of it with backward. Fitted on one
published run (GPT-2 124M on two TITAN RTX without P2P: ×1.56 one card's speed, PCIe 3.0 x16)
and checked on the others in docs/planning.md (tests/unit/planning/test_published_scaling.py);
0.45, the bus bandwidth alone, predicted ×1.99 there."""
NETWORK_EFFICIENCY = 0.85
"""Share of an Ethernet's line rate NCCL's socket transport reaches."""
ASSUMED_PCIE = (4, 16)
"""A card whose PCIe link is not known (a what-if card): PCIe 4.0 x16."""
GPU_LATENCY_S = 20e-6
"""Seconds a GPU collective costs whatever its size (NCCL's launch and ring latency)."""
NETWORK_LATENCY_S = 100e-6
"""The same over Ethernet."""

NETWORKS_GBIT: dict[str, float] = {
    "1gbe": 1.0,
    "2.5gbe": 2.5,
    "5gbe": 5.0,
    "10gbe": 10.0,
    "25gbe": 25.0,
    "40gbe": 40.0,
    "50gbe": 50.0,
    "100gbe": 100.0,
    "200gbe": 200.0,
    "400gbe": 400.0,
}
"""Network names `--network` takes → Gbit/s of line rate."""

DEFAULT_GLOO_BYTES_PER_S = 1e9
"""The CPU's gloo bandwidth when it was not measured (1 GB/s: loopback TCP on a small host)."""
DEFAULT_GLOO_LATENCY_S = 100e-6


@dataclass(frozen=True)
class LinkSpeed:
    """The link a ring collective is priced at."""

    bytes_per_s: float
    """One direction, at the share of the line rate a collective reaches."""
    latency_s: float
    """Seconds each collective costs whatever its size."""
    kind: str
    """"nvlink", "p2p", "host-bounce", "network", "gloo" or "none" (one device)."""
    words: str
    """The link in words: "NVLink 3 × 4 links (45 GB/s)", "PCIe 4.0 x16 without P2P …"."""
    source: str
    """"table" (from the tables here), "measured" (gloo, measured on this host) or "given"
    (a ``--network`` figure)."""

    def to_json(self) -> dict[str, Any]:
        return {"value": self.bytes_per_s, "latency_s": self.latency_s, "kind": self.kind,
                "words": self.words, "source": self.source}  # fmt: skip


NO_LINK = LinkSpeed(0.0, 0.0, "none", "one device: nothing to synchronise", "table")


def _gbs(x: float) -> str:
    return f"{x / 1e9:.1f} GB/s" if x < 10e9 else f"{x / 1e9:.0f} GB/s"


def nvlink_rate(capability: tuple[int, int] | None) -> tuple[str, float]:
    """(generation, bytes/s per link and direction) for a card of ``capability``; an unknown or
    unlisted one is taken as NVLink 3 at 25 GB/s."""
    if capability in NVLINK_GB_PER_LINK:
        gen, gb = NVLINK_GB_PER_LINK[capability]  # type: ignore[index]
        return gen, gb * 1e9
    return "NVLink", 25e9


def pair_link(a: tuple[int | None, int | None], b: tuple[int | None, int | None],
              capability: tuple[int, int] | None, link: GpuLink | None) -> LinkSpeed:  # fmt: skip
    """The link between two cards with PCIe (gen, width) ``a`` and ``b``, as NVML described it
    (``link``: None when not known, e.g. what-if cards: PCIe with P2P is assumed)."""
    known = [x for x in (a, b) if x[0] and x[1]]
    gen, width = min(known, key=lambda x: pcie_bytes_per_s(x[0], x[1])) if known else ASSUMED_PCIE  # type: ignore[arg-type]
    pcie = pcie_bytes_per_s(int(gen), int(width))  # type: ignore[arg-type]
    pcie_words = f"PCIe {gen}.0 x{width}" + ("" if known else " (assumed)")
    if link is not None and link.kind == "nvlink" and link.nvlink_links > 0:
        name, per = nvlink_rate(capability)
        rate = link.nvlink_links * per * NVLINK_EFFICIENCY
        words = f"{name} × {link.nvlink_links} links ({_gbs(rate)})"
        return LinkSpeed(rate, GPU_LATENCY_S, "nvlink", words, "table")
    if link is not None and link.kind == "nvlink":  # NVSwitch: no direct link, the card's all
        name, per = nvlink_rate(capability)
        n = NVSWITCH_CARD_LINKS.get(capability, 12) if capability else 12  # type: ignore[arg-type]
        rate = n * per * NVLINK_EFFICIENCY
        words = f"{name} through NVSwitch, {n} links a card ({_gbs(rate)})"
        return LinkSpeed(rate, GPU_LATENCY_S, "nvlink", words, "table")
    if link is not None and (link.kind == "pcie" or link.p2p is False):
        rate = pcie * HOST_BOUNCE_EFFICIENCY
        words = f"{pcie_words} without P2P, through host memory ({_gbs(rate)})"
        return LinkSpeed(rate, GPU_LATENCY_S, "host-bounce", words, "table")
    rate = pcie * P2P_EFFICIENCY
    p2p = "P2P" if link is not None and link.p2p else "P2P assumed"
    return LinkSpeed(rate, GPU_LATENCY_S, "p2p", f"{pcie_words} {p2p} ({_gbs(rate)})", "table")


def ring_link(hw: PlanHardware, links: tuple[GpuLink, ...] = ()) -> LinkSpeed:
    """The slowest hop of a ring over the planned cards (`NO_LINK` for one device).

    ``links``: the probe's pairs (by NVML index, `PlanHardware.indices`); a pair it does not
    list (what-if cards) is PCIe with P2P assumed. On the CPU use `gloo_link`.
    """
    n = hw.world_size
    if n < 2:
        return NO_LINK
    by_pair = {frozenset((x.a, x.b)): x for x in links}
    worst: LinkSpeed | None = None
    for i in range(n):
        j = (i + 1) % n
        di, dj = hw.devices[i], hw.devices[j]
        pair = None
        if len(hw.indices) == n:
            pair = by_pair.get(frozenset((hw.indices[i], hw.indices[j])))
        cap = min(c for c in (di.compute_capability, dj.compute_capability) if c) if (
            di.compute_capability or dj.compute_capability) else None  # fmt: skip
        speed = pair_link((di.pcie_gen, di.pcie_width), (dj.pcie_gen, dj.pcie_width), cap, pair)
        if worst is None or speed.bytes_per_s < worst.bytes_per_s:
            worst = speed
    assert worst is not None
    return worst


def parse_network(text: str) -> LinkSpeed:
    """``--network``: a name (10GbE, 25GbE, 100GbE, …) or Gbit/s (``40``, ``40Gbit``)."""
    t = text.strip().lower().replace(" ", "")
    gbit = NETWORKS_GBIT.get(t)
    source = "table"
    if gbit is None:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(?:gbit(?:/s)?|gbps|g)?", t)
        if not m or float(m.group(1)) <= 0:
            raise HardwareSpecError(
                f"--network {text!r}: not a network name or a speed in Gbit/s",
                hint="use e.g. --network 10GbE, --network 25GbE, --network 100GbE or "
                "--network 40 (Gbit/s)",
            )
        gbit, source = float(m.group(1)), "given"
    rate = gbit * 1e9 / 8 * NETWORK_EFFICIENCY
    words = f"{gbit:g} Gbit/s Ethernet between machines ({_gbs(rate)})"
    return LinkSpeed(rate, NETWORK_LATENCY_S, "network", words, source)


def gloo_link(measured: dict[str, Any] | None) -> LinkSpeed:
    """The CPU's link between processes: gloo on loopback as measured (`read_cached_gloo`), else
    the stated default."""
    if measured and measured.get("bytes_per_s"):
        rate = float(measured["bytes_per_s"])
        lat = float(measured.get("latency_s") or DEFAULT_GLOO_LATENCY_S)
        return LinkSpeed(rate, lat, "gloo", f"gloo between processes on this host, measured "
                         f"({_gbs(rate)})", "measured")  # fmt: skip
    return LinkSpeed(DEFAULT_GLOO_BYTES_PER_S, DEFAULT_GLOO_LATENCY_S, "gloo",
                     f"gloo between processes, assumed {_gbs(DEFAULT_GLOO_BYTES_PER_S)} (not "
                     "measured yet: `homelab-dp plan` measures it once)", "table")  # fmt: skip


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:120]


def gloo_cache_path(host: str, torch_version: str | None) -> Path:
    """The cache file of one host and torch version: ``$XDG_CACHE_HOME/homelab-dp/links/``
    (``~/.cache`` by default), beside the token cache. A measurement can always be made again,
    so it is a cache, not data: every data home on the host (a test's, a user's) shares it."""
    name = f"gloo-{_safe(host)}-torch-{_safe(torch_version or 'none')}.json"
    return cache_home() / "links" / name


def read_cached_gloo(host: str, torch_version: str | None) -> dict[str, Any] | None:
    """The cached gloo measurement of this host, or None (absent, unreadable, or not a
    measurement: `gloo_doc_ok`; the plan then measures again). Only a regular file of at most
    64 KiB is read (a FIFO or a link to ``/dev/zero`` there is no measurement)."""
    doc = read_back(gloo_cache_path(host, torch_version), 64 * 1024).doc
    return doc if gloo_doc_ok(doc) else None


def gloo_doc_ok(doc: Any) -> bool:
    """Whether ``doc`` is a gloo measurement: ``bytes_per_s`` a finite number in (0, 10^13]
    (a negative or zero rate would price communication as negative or endless), ``latency_s``
    absent, null, or finite in [0, 10] s."""
    if not isinstance(doc, dict):
        return False
    rate, lat = doc.get("bytes_per_s"), doc.get("latency_s")
    if type(rate) not in (int, float) or not (math.isfinite(rate) and 0 < rate <= 1e13):
        return False
    return lat is None or (type(lat) in (int, float) and math.isfinite(lat) and 0 <= lat <= 10)


def write_cached_gloo(host: str, torch_version: str | None, doc: dict[str, Any]) -> Path:
    """Cache a gloo measurement: a 0600 file in a 0700 folder, written atomically."""
    path = gloo_cache_path(host, torch_version)
    os.chmod(ensure_private_dir(path.parent), 0o700)  # one that lost its mode too
    return write_private(path, json.dumps(doc))
