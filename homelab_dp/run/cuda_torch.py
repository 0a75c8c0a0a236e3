"""Whether the installed torch can drive these cards, and how to install one that can.

Pure: reads the probe (`HardwareReport`) and what torch said (`TorchFacts`). Used by
`homelab-dp doctor` and by the run controller's preflight, which refuses a CUDA plan (exit 2)
when the installed torch cannot see the planned cards.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from homelab_dp.core.hardware import GpuInfo, HardwareReport, mig_on
from homelab_dp.run.machine_facts import TorchFacts

WHEEL_INDEX = "https://download.pytorch.org/whl/"
MIN_DRIVER = {11: "450.80", 12: "525.60", 13: "580"}
"""The oldest Linux driver for each CUDA major version (minor versions are compatible)."""


def parse_version(text: str | None) -> tuple[int, int] | None:
    """``"12.4"`` -> (12, 4); None for anything else."""
    m = re.match(r"^\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def short_name(name: str) -> str:
    """``NVIDIA GeForce RTX 3090`` -> ``RTX 3090``: what both NVML and torch call a card."""
    return name.removeprefix("NVIDIA ").removeprefix("GeForce ").strip()


def card_key(name: str) -> str:
    """A card's name as both NVML and torch spell it, lower case, single spaces."""
    return " ".join(short_name(name).lower().split())


def same_card(a: str, b: str) -> bool:
    return card_key(a) == card_key(b)


def is_mig_device(name: str) -> bool:
    """A torch device that is a MIG slice: CUDA names it ``<card> MIG <profile>``."""
    return " mig " in f" {card_key(name)} "


def mig_parent(name: str, cards: Sequence[GpuInfo]) -> GpuInfo | None:
    """The card with MIG on that the MIG slice torch calls ``name`` belongs to."""
    key = card_key(name)
    found = [g for g in cards if mig_on(g) and key.startswith(card_key(g.name) + " mig ")]
    return found[0] if found else None


def card_names(names: Sequence[str]) -> str:
    """Short names, comma-separated ("none" for none)."""
    return ", ".join(short_name(n) for n in names) if names else "none"


def is_consumer(name: str) -> bool:
    """GeForce and TITAN cards: NVIDIA turns PCIe peer-to-peer off on most of them."""
    lowered = name.lower()
    return "geforce" in lowered or "titan" in lowered


def capability_of(gpu: GpuInfo, torch: TorchFacts) -> tuple[int, int] | None:
    """The card's compute capability: from the probe, else from the torch device of that name."""
    if gpu.compute_capability:
        return (int(gpu.compute_capability[0]), int(gpu.compute_capability[1]))
    same = [d for d in torch.devices if same_card(d.name, gpu.name) and d.capability]
    return same[0].capability if same else None


def wheel_tag(
    driver_cuda: str | None, capabilities: Sequence[tuple[int, int] | None] = ()
) -> str | None:
    """The PyTorch wheel index (``cu126``…) for this driver and these cards, or None when the
    driver is too old for any current build.

    CUDA minor versions are compatible, so a CUDA 12.x driver runs the cu126 build (which still
    has kernels for Pascal and Volta); Blackwell cards (10.x, 12.x) need cu128 or newer; the
    CUDA 13 builds drop cards older than Turing (7.5).
    """
    driver = parse_version(driver_cuda)
    if driver is None:
        return None
    known = [c for c in capabilities if c]
    blackwell = any(c >= (10, 0) for c in known)
    old = any(c < (7, 5) for c in known)
    if driver >= (13, 0):
        return "cu126" if old else "cu130"
    if driver >= (12, 0):
        return "cu128" if blackwell and driver >= (12, 8) else "cu126"
    if driver >= (11, 8):
        return "cu118"
    return None


def install_hint(report: HardwareReport, torch: TorchFacts) -> str:
    """How to install the CUDA build of torch that this driver runs."""
    caps = [capability_of(g, torch) for g in report.gpus]
    tag = wheel_tag(report.cuda_driver_version, caps)
    driver = report.cuda_driver_version
    if driver is None:
        return (
            "install the CUDA build of torch for your driver (`nvidia-smi` shows its CUDA "
            f"version), e.g. for CUDA 12: pip uninstall -y torch && pip install torch "
            f"--index-url {WHEEL_INDEX}cu126"
        )
    if tag is None:
        return (
            f"the driver supports CUDA {driver}, older than any current torch build: update the "
            "NVIDIA driver (CUDA 12 needs 525.60 or newer), then install the CUDA build of torch"
        )
    built = f"{tag[2:-1]}.{tag[-1]}"
    return (
        f"install the CUDA build of torch: pip uninstall -y torch && "
        f"pip install torch --index-url {WHEEL_INDEX}{tag} (CUDA {built}; "
        f"the driver supports CUDA {driver})"
    )


def no_gpu(report: HardwareReport) -> str:
    """Why GPU checks are skipped, from the probe's notice: ``no GPU: no NVIDIA driver found``."""
    reason = re.sub(r"\s*\(.*\)$", "", (report.notice or "").split(";")[0].strip().rstrip("."))
    return f"no GPU: {reason[:1].lower()}{reason[1:]}" if reason else "no GPU"


def visible_hint(torch: TorchFacts) -> str:
    if torch.visible_devices is None:
        return ""
    return (
        f"CUDA_VISIBLE_DEVICES={torch.visible_devices} is set: torch reads its numbers in CUDA's "
        "order (the fastest card first unless CUDA_DEVICE_ORDER=PCI_BUS_ID), `homelab-dp probe` "
        "in PCI bus order; export CUDA_DEVICE_ORDER=PCI_BUS_ID or name the cards by UUID "
        "(`nvidia-smi -L`). "
    )


def torch_unusable(report: HardwareReport, torch: TorchFacts) -> tuple[str, str] | None:
    """Why the installed torch cannot drive the probed GPUs at all, as (problem, hint): not
    importable, a CPU-only (or ROCm) build, or CUDA would not start. None when it can."""
    if not report.gpus:
        return None
    if torch.version is None:
        return (
            f"torch cannot be imported ({torch.error})",
            "install torch into this environment: " + install_hint(report, torch),
        )
    if not torch.cuda or torch.hip:
        build = f"a ROCm build (HIP {torch.hip})" if torch.hip else "a CPU-only build"
        return (
            f"the installed torch {torch.version} is {build}: it cannot use the GPUs",
            install_hint(report, torch) + "; or run on the CPU with --gpus cpu:N",
        )
    if not torch.cuda_available:
        why = f": {torch.error}" if torch.error else ""
        built, driver = parse_version(torch.cuda), parse_version(report.cuda_driver_version)
        if built and driver and built[0] > driver[0]:
            hint = (
                f"torch was built for CUDA {torch.cuda} but the driver supports CUDA "
                f"{report.cuda_driver_version}: update the driver (CUDA {built[0]} needs "
                f"{MIN_DRIVER.get(built[0], 'a newer one')} or newer), or "
                + install_hint(report, torch)
            )
        else:
            hint = (
                visible_hint(torch) + "check that `nvidia-smi` works and that you may open "
                "/dev/nvidia*; in a container, start it with --gpus all"
            )
        return f"torch {torch.version} (CUDA {torch.cuda}) cannot start CUDA{why}", hint
    return None


def torch_mismatch(report: HardwareReport, torch: TorchFacts) -> tuple[str, str] | None:
    """Why the installed torch cannot train on the probed cards, as (problem, hint), naming
    both lists of cards; None when it sees them all (same count, same names; torch may number
    them in another order). A card with MIG on counts as seen whether torch shows one of its
    MIG slices or none: CUDA gives a process one MIG slice, and the run names its own."""
    if not report.gpus:
        return None
    nvml_names = [g.name for g in report.gpus]
    listed = f"NVML lists {len(nvml_names)} ({card_names(nvml_names)})"
    unusable = torch_unusable(report, torch)
    if unusable:
        return f"{unusable[0]}; {listed}", unusable[1]
    torch_names = [d.name for d in torch.devices]
    # A card with MIG on shows CUDA at most one of its slices (one per process), named
    # "<card> MIG <profile>": the whole cards must match, and each slice be of a MIG card.
    whole = [g.name for g in report.gpus if not mig_on(g)]
    torch_whole = [n for n in torch_names if not is_mig_device(n)]
    strays = [n for n in torch_names if is_mig_device(n) and mig_parent(n, report.gpus) is None]
    if strays or sorted(map(card_key, whole)) != sorted(map(card_key, torch_whole)):
        return (
            f"torch sees {len(torch_names)} GPU{'s' if len(torch_names) != 1 else ''} "
            f"({card_names(torch_names)}) but {listed}",
            visible_hint(torch) + "`nvidia-smi` and torch should list the same cards; check "
            "the driver and that no card is held by another container or VM",
        )
    return None
