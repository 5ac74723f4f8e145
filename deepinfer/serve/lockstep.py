"""Ranks that step together: the torch.distributed group of the rank processes, and the
per-iteration agreement on whether anyone has work.

A model whose layers exchange tokens between ranks (expert parallel MoE) runs a collective in
every layer, so every rank must run every step: a rank with no requests runs a dummy step. Each
loop iteration the ranks all-reduce "I have work" over a CPU (gloo) group; if anyone has, all
step. The group itself is torch.distributed's, on the backend the accelerator names (gloo on
CPU, NCCL on CUDA), rendezvoused over TCP at the API process's address and port.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer.core.accelerator import ParallelContext
from deepinfer.core.config import ParallelConfig

# A peer that died leaves the others in a collective; they give up after this long.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def init_rank_group(parallel: ParallelConfig, rank: int, backend: str) -> ParallelContext:
    """Join the group of all ranks; returns the context init_device receives."""
    dist.init_process_group(backend, init_method=f"tcp://{parallel.master_addr}:"
                            f"{parallel.master_port}", rank=rank,
                            world_size=parallel.world_size, timeout=COLLECTIVE_TIMEOUT)
    return ParallelContext(rank, parallel.world_size, dist.group.WORLD, parallel.ep)


class Lockstep:
    """The per-iteration 'anyone busy?' vote, on a gloo group (host tensors, whatever the
    device group's backend)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" \
            else dist.group.WORLD
        self.peers_busy = False  # the last vote: some rank had work

    def anyone_busy(self, busy: bool) -> bool:
        flag = torch.tensor([int(busy)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.peers_busy = bool(flag.item())
        return self.peers_busy


def shutdown_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
