"""KV pool sizing from what a profiling run leaves free (as vLLM's --gpu-memory-utilization).

budget = total * utilization - (peak of a worst-case step: weights + activations + sampler)
         - memory outside torch's allocator (CUDA context, cuBLAS workspaces) - graph reserve
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30
# Decode graphs hold their activations in a private pool captured after the KV allocation.
GRAPH_RESERVE_BYTES = GIB // 2


@dataclass(frozen=True)
class MemoryBudget:
    total: int
    peak: int
    non_torch: int
    kv_bytes: int

    def describe(self) -> str:
        return (f"device {self.total / GIB:.1f} GiB: peak step {self.peak / GIB:.2f} GiB, "
                f"outside torch {self.non_torch / GIB:.2f} GiB, "
                f"KV pool {self.kv_bytes / GIB:.2f} GiB")


def kv_budget(device: torch.device, utilization: float, profile_peak: int) -> MemoryBudget:
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    kv = int(total * utilization) - profile_peak - non_torch - GRAPH_RESERVE_BYTES
    if kv <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache: {total / GIB:.1f} GiB x {utilization} leaves "
            f"nothing after a {profile_peak / GIB:.2f} GiB profiling step; raise "
            f"--gpu-memory-utilization or lower --max-num-batched-tokens")
    return MemoryBudget(total, profile_peak, non_torch, kv)
