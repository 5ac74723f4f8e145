"""Whether this machine can run the NVIDIA backend, asked without loading it (torch only)."""
from __future__ import annotations

import importlib.util


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
