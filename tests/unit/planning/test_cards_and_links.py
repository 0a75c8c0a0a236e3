"""Issue 32, point 8: a pair on NVSwitch is priced at the card's NVLink bandwidth (not PCIe),
a MIG slice at its share of the card's FLOPs, and the newer cards are in the tables."""

from __future__ import annotations

import pytest

from homelab_dp.planning.flops import mig_share, peak_flops
from homelab_dp.planning.links import NVLINK_EFFICIENCY, pair_link
from homelab_dp.probe.hardware import GpuLink

PCIE4 = (4, 16)


@pytest.mark.parametrize(
    ("capability", "links", "gb_a_way"),
    [((9, 0), 18, 450.0), ((8, 0), 12, 300.0), ((10, 0), 18, 900.0)],
    ids=["hgx-h100-h200", "hgx-a100", "hgx-b200"],
)
def test_a_pair_on_nvswitch_is_priced_at_the_cards_nvlink(capability, links, gb_a_way) -> None:
    switch = GpuLink(0, 1, "nvlink", nvlink_links=0, p2p=True)  # NVML: NVLink P2P, no direct link
    speed = pair_link(PCIE4, PCIE4, capability, switch)
    assert speed.kind == "nvlink" and f"NVSwitch, {links} links" in speed.words
    assert speed.bytes_per_s == pytest.approx(gb_a_way * 1e9 * NVLINK_EFFICIENCY)
    pcie = pair_link(PCIE4, PCIE4, capability, GpuLink(0, 1, "p2p", p2p=True))
    assert speed.bytes_per_s > 5 * pcie.bytes_per_s  # was priced as this PCIe P2P link


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GB200", 2500.0),
        ("NVIDIA GH200 480GB", 989.5),
        ("NVIDIA GeForce RTX 5090", 209.5),
        ("NVIDIA GeForce RTX 5070", 61.7),
        ("NVIDIA GeForce RTX 5070 Ti", 87.9),
        ("NVIDIA GeForce RTX 5060 Ti", 47.4),
        ("NVIDIA GeForce RTX 5060", 38.4),
        ("NVIDIA A30", 165.0),
        ("NVIDIA H200", 989.5),
    ],
)
def test_the_newer_cards_have_their_peaks(name, tflops) -> None:
    assert peak_flops(name) == pytest.approx(tflops * 1e12)


def test_a_mig_slice_has_its_share_of_the_cards_flops() -> None:
    assert mig_share("NVIDIA A100-SXM4-80GB MIG 3g.40gb") == pytest.approx(3 / 7)
    assert peak_flops("NVIDIA A100-SXM4-80GB MIG 3g.40gb") == pytest.approx(312e12 * 3 / 7)
    assert peak_flops("NVIDIA H100 80GB HBM3 MIG 1g.10gb") == pytest.approx(989.5e12 / 7)
    assert peak_flops("NVIDIA H200 MIG 7g.141gb") == pytest.approx(989.5e12)
    assert peak_flops("NVIDIA A30 MIG 2g.12gb") == pytest.approx(165e12 / 2)  # 4 slices
    assert mig_share("NVIDIA A100-SXM4-80GB") == 1.0
