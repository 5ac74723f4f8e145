"""The NVIDIA backend's plugin module, registered through the "deepinfer" entry point group like
every other backend. Selected by DEEPINFER_ACCELERATOR=nvidia (or cuda), probed first when a
CUDA device and Triton are present."""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from deepinfer.core.plugins import AcceleratorInfo, hookimpl

if TYPE_CHECKING:
    from deepinfer.core.accelerator import Accelerator


def _load_cuda() -> type["Accelerator"]:
    # Imported on demand: triton and the kernels load only when this backend is chosen.
    from deepinfer.backends.cuda.accelerator import CUDAAccelerator

    return CUDAAccelerator


def unavailable_reason() -> str | None:
    """None where a GPU and Triton are here; else what is missing. Imports torch only."""
    import torch

    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a build without CUDA: install a CUDA build of "
                "torch (https://pytorch.org/get-started/locally/), then "
                "pip install 'deepinfer[cuda]'")
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check the "
                "driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed: pip install 'deepinfer[cuda]'"
    return None


@hookimpl
def deepinfer_register_accelerators() -> list[AcceleratorInfo]:
    return [AcceleratorInfo(
        name="nvidia", aliases=("cuda", "gpu"), priority=100, load=_load_cuda,
        probe=unavailable_reason,
        description="NVIDIA GPUs: Triton attention, CUDA graphs, UVA page copy (extra: [cuda])",
    )]
