"""Ranks that step together: the torch.distributed group of the rank processes, and the
per-iteration agreement on whether anyone has work.

A model whose layers exchange tokens between ranks (expert parallel MoE) runs a collective in
every layer, so every rank must run every step: a rank with no requests runs a dummy step. Each
loop iteration the ranks all-reduce "I have work" over a CPU (gloo) group; if anyone has, all
step. The group itself is torch.distributed's, on the backend the accelerator names (gloo on
CPU, NCCL on CUDA), rendezvoused over TCP at the API process's address and port.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer.core.accelerator import ParallelContext
from deepinfer.core.config import ParallelConfig

# A peer that died leaves the others in a collective; they give up after this long.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def init_rank_group(parallel: ParallelConfig, local_rank: int, backend: str,
                    timeout: timedelta = COLLECTIVE_TIMEOUT,
                    placement_from: int | None = None) -> ParallelContext:
    """Join the group of all ranks of every host; returns the context init_device receives
    (`placement_from`: a regroup's, see ParallelContext)."""
    rank = parallel.first_rank + local_rank
    dist.init_process_group(backend, init_method=f"tcp://{parallel.master_addr}:"
                            f"{parallel.master_port}", rank=rank,
                            world_size=parallel.world_size, timeout=timeout)
    return ParallelContext(rank, parallel.world_size, dist.group.WORLD, parallel.ep,
                           parallel.eplb_redundant_experts, placement_from)


class Lockstep:
    """The per-iteration vote, on a gloo group (host tensors, whatever the device group's
    backend): does anyone have work, and does anyone want an expert rebalance (EPLB)? Every
    rank then takes the same branch."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" \
            else dist.group.WORLD
        self.peers_busy = False  # the last vote: some rank had work

    def vote(self, busy: bool, rebalance: bool) -> tuple[bool, bool]:
        flags = torch.tensor([int(busy), int(rebalance)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        self.peers_busy = bool(flags[0])
        return self.peers_busy, bool(flags[1])


class RebalanceTimer:
    """When this rank asks for an EPLB rebalance: every `interval_s` seconds; with
    `after_prefill`, after a step that prefilled (and, with both, the first such step once the
    interval has passed). Any rank asking is enough (the vote is a MAX)."""

    def __init__(self, interval_s: float, after_prefill: bool, clock=time.monotonic) -> None:
        self.interval_s, self.after_prefill, self.clock = interval_s, after_prefill, clock
        self.last = clock()

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 or self.after_prefill

    def due(self, prefilled: bool) -> bool:
        elapsed = self.interval_s <= 0 or self.clock() - self.last >= self.interval_s
        if self.after_prefill:
            return prefilled and elapsed
        return self.interval_s > 0 and elapsed

    def done(self) -> None:
        self.last = self.clock()


def shutdown_group() -> None:
    """Leave the group: the world and every group made over it (the vote's, the MoE
    layers' shape group)."""
    if dist.is_initialized():
        dist.destroy_process_group()
