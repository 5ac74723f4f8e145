"""The NVIDIA backend's plugin module, registered through the "deepinfer" entry point group like
every other backend. Selected by DEEPINFER_ACCELERATOR=nvidia (or cuda), probed first when a
CUDA device and Triton are present."""
from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.backends.cuda.probe import unavailable_reason
from deepinfer.core.plugins import AcceleratorInfo, hookimpl

if TYPE_CHECKING:
    from deepinfer.core.accelerator import Accelerator


def _load_cuda() -> type["Accelerator"]:
    # Imported on demand: triton and the kernels load only when this backend is chosen.
    from deepinfer.backends.cuda.accelerator import CUDAAccelerator

    return CUDAAccelerator


@hookimpl
def deepinfer_register_accelerators() -> list[AcceleratorInfo]:
    return [AcceleratorInfo(
        name="nvidia", aliases=("cuda", "gpu"), priority=100, load=_load_cuda,
        probe=unavailable_reason,
        description="NVIDIA GPUs: Triton attention, CUDA graphs, UVA page copy (extra: [cuda])",
    )]
