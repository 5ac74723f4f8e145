"""The token exchange of expert parallelism: each rank holds some experts' weights, each token
needs k experts wherever they are.

All-gather + reduce-scatter: every rank gathers every rank's tokens (padded to the step's
largest token count, agreed on before the forward so every rank calls collectives of the same
size) with their routes packed into one float tensor (slot ids are exact in float32), computes
the routes its own slots serve, and a reduce-scatter sums each token's partial outputs back on
its owner. Shapes depend only on the agreed token count, so a decode step can run inside a CUDA
graph. Its traffic is N x the tokens, which is what small decode batches want.

All-to-all: each route is sent only to the rank of its slot and its output sent back, which is
what prefill-sized steps want. The runtime picks one per step from the agreed token count
(every rank picks the same), all-gather whenever a CUDA graph is being captured.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

# (tokens [n, H], route weights [n, k], local slots [n, k] with -1 elsewhere) -> [n, H]
Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# torch >= 2.12 names them *_single (the *_tensor names are deprecated aliases).
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class AllGatherExchange:
    def __init__(self, group: Any, rank: int, world_size: int, slots_per_rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.slots_per_rank = slots_per_rank

    def run(self, x: torch.Tensor, weights: torch.Tensor, phys: torch.Tensor, padded: int,
            compute: Compute) -> torch.Tensor:
        """x [T, H] this rank's tokens, phys [T, k] the physical slot of each route; every
        rank passes the same `padded` >= its T."""
        tokens, k = phys.shape
        routes = torch.cat((phys.float(), weights.float()), dim=1)
        routes = F.pad(routes, (0, 0, 0, padded - tokens), value=-1.0)
        all_x = self._gather(F.pad(x, (0, 0, 0, padded - tokens)))
        all_routes = self._gather(routes)
        all_phys = all_routes[:, :k].long()
        mine = all_phys.div(self.slots_per_rank, rounding_mode="floor") == self.rank
        local = torch.where(mine, all_phys - self.rank * self.slots_per_rank, -1)
        partial = compute(all_x, all_routes[:, k:].clamp_min(0.0), local.to(torch.int32))
        out = x.new_empty((padded, x.shape[1]))
        _reduce_scatter(out, partial.contiguous(), group=self.group)
        return out[:tokens]

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        all_gather(out, t.contiguous(), group=self.group)
        return out


class AllToAllExchange:
    """Each route goes only to the rank of its slot and comes back: 2 x the routes' rows of
    traffic instead of N x every token, for prefill-sized steps. Split sizes are exchanged
    first and read on the host (a device sync), so it never runs inside a CUDA graph."""

    def __init__(self, group: Any, rank: int, world_size: int, slots_per_rank: int) -> None:
        self.group, self.world_size, self.slots_per_rank = group, world_size, slots_per_rank

    def run(self, x: torch.Tensor, weights: torch.Tensor, phys: torch.Tensor,
            compute: Compute) -> torch.Tensor:
        k = phys.shape[1]
        dest = phys.reshape(-1).div(self.slots_per_rank, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.world_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        tokens = order.div(k, rounding_mode="floor")
        slots = (phys.reshape(-1)[order] % self.slots_per_rank).float()
        routes = torch.stack((slots, weights.reshape(-1)[order].float()), dim=1)
        got_x = self._swap(x[tokens], recv_sizes, send_sizes)
        got = self._swap(routes, recv_sizes, send_sizes)
        partial = compute(got_x, got[:, 1:], got[:, :1].to(torch.int32))
        back = self._swap(partial, send_sizes, recv_sizes)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, tokens, back.float()).to(x.dtype)

    def _swap(self, rows: torch.Tensor, out_sizes: list[int],
              in_sizes: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(out_sizes), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_sizes, in_sizes, group=self.group)
        return out
