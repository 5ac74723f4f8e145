"""Host values to the device without waiting for the device.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory and synchronizes the
stream: the host then waits for every kernel already queued, which under async scheduling is
the whole step in flight. Staging through pinned memory (PyTorch's caching host allocator,
which keeps a block until its copy has run) makes the copy one more operation in stream order.
On other devices this is a plain copy.
"""
from __future__ import annotations

from typing import Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def tensor_on(values: Sequence, device: torch.device | str,
              dtype: torch.dtype = torch.long) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device), queued rather than synchronous."""
    return to_device(torch.tensor(values, dtype=dtype), device)
