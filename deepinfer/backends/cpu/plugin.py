"""The CPU backend's plugin module: registered through the "deepinfer" entry point group exactly
like a third-party backend (pyproject: `[project.entry-points.deepinfer] cpu = ...`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.core.plugins import AcceleratorInfo, hookimpl

if TYPE_CHECKING:
    from deepinfer.core.accelerator import Accelerator

def _load_cpu() -> type["Accelerator"]:
    # Imported on demand: listing plugins must not pay for (or fail on) building the backend.
    from deepinfer.backends.cpu.accelerator import CPUAccelerator

    return CPUAccelerator


def _always_available() -> None:
    # Probing by loading the class would import torch and the whole backend in the preflight's
    # short-lived process only to hear that the host CPU is there.
    return None


@hookimpl
def deepinfer_register_accelerators() -> list[AcceleratorInfo]:
    return [AcceleratorInfo(
        name="cpu", aliases=(), priority=0, load=_load_cpu, probe=_always_available,
        description="reference backend: plain torch ops on the host CPU; always available",
    )]
