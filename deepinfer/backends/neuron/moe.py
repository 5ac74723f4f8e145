"""The static-shape MoE of the Neuron backend: every shape depends only on the padded token
count, k, the slots, H, F and a capacity, never on the routing, because on Trainium each shape
is a compiled graph (on the host the same code runs as plain torch, gloo for collectives).

Per MoE layer the exchange all-gathers the tokens and ONE packed route tensor
[padded, 2k+1] = slot ids | weights | valid flag (float32: ids are exact below 2**24), counts
the routes of every slot over all ranks from the gathered ids, and computes this rank's slots:
- grouped: each slot gets a [capacity, H] buffer (a route's row is its position within its
  slot, a cumsum of one-hot), batched matmuls over [S, capacity, ...], a weighted scatter-add
  back. Routes past a slot's capacity would be dropped, so it runs only when none overflows;
- dense: every slot over every token with masked weights, exact at any load. It reruns a layer
  whose counts overflow the capacity: no token is ever dropped. On a traced device (XLA, where
  reading the counts back would cut the step's graph) the layer stays grouped and raises a
  device flag; the backend reads it with the step's logits and reruns the whole step with
  dense experts (a graph of its own, built at start-up).
Every rank sees the same gathered counts, so all take the same branch without a collective.
A reduce-scatter sums each token's partial outputs back on its rank.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Mapping, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deepinfer.backends.neuron.env import neuron_settings
from deepinfer.models.moe.exchange import all_gather
from deepinfer.models.moe.experts import swiglu
from deepinfer.models.moe.ops import MoEOps

CAPACITY_ENV = "DEEPINFER_NEURON_MOE_CAPACITY"
# Steps of at most this many gathered tokens get capacity = tokens: a token sends at most one
# route to a slot, so they can never overflow (no host read of the counts), and at decode sizes
# a factor-sized capacity would overflow on most steps (the mean load is a fraction of a token).
DECODE_MAX_TOKENS = 64
# float32 holds every integer below 2**24 exactly: the packed slot ids stay exact below it.
MAX_EXACT_SLOTS = 2 ** 24

Collective = Callable[..., Any]  # torch.distributed's (out, in, group=...) signature
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class StaticCompute(Protocol):
    """(tokens [n, H], route weights [n, k], local slots [n, k] (-1: not here), capacity per
    slot or None for the exact dense path) -> [n, H]. MoEBlock._compute is one."""

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                 capacity: int | None = None) -> torch.Tensor: ...


# ---- packed routes ---------------------------------------------------------------------------
def pack_routes(phys: torch.Tensor, weights: torch.Tensor, num_real: int | torch.Tensor,
                padded: int) -> torch.Tensor:
    """phys [T, k] physical slots (< MAX_EXACT_SLOTS), weights [T, k] -> float32
    [padded, 2k+1]: ids | weights | valid (1.0 for the first num_real rows of T; padding rows
    and rows past T are all zeros). num_real may be a device scalar (no host read)."""
    tokens = phys.shape[0]
    if padded < tokens:
        raise ValueError(f"padded={padded} is below this rank's {tokens} tokens")
    if phys.is_floating_point():
        raise TypeError("slot ids must be an integer tensor (bf16 would round them)")
    rows = torch.arange(padded, device=phys.device)
    valid = ((rows < num_real) & (rows < tokens)).unsqueeze(1)
    routes = torch.cat((phys.to(torch.float32), weights.to(torch.float32)), dim=1)
    routes = F.pad(routes, (0, 0, 0, padded - tokens))
    return torch.cat((torch.where(valid, routes, 0.0), valid.to(torch.float32)), dim=1)


def unpack_routes(packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    """[n, 2k+1] -> (slot ids [n, k] int64, weights [n, k] float32, valid [n] bool)."""
    return packed[:, :k].long(), packed[:, k:2 * k], packed[:, 2 * k] > 0.5


def expert_counts(ids: torch.Tensor, valid: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Routes per slot [num_slots] int64 over the valid rows of ids [n, k] (a scatter-add of
    fixed size, not a bincount sized by the data)."""
    real = valid.unsqueeze(1).expand_as(ids)
    flat = torch.where(real, ids, 0).reshape(-1)
    counts = torch.zeros(num_slots, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, flat, real.reshape(-1).long())


# ---- capacity --------------------------------------------------------------------------------
def capacity_factor(environ: Mapping[str, str] | None = None) -> float:
    """The factor from DEEPINFER_NEURON_MOE_CAPACITY (DEFAULT_CAPACITY_FACTOR if unset)."""
    return neuron_settings(environ).moe_capacity


def _checked_factor(factor: float) -> float:
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"the MoE capacity factor must be a positive number, not {factor}")
    return factor


def capacity_for(num_tokens: int, k: int, num_slots: int, factor: float | None = None,
                 decode_tokens: int = DECODE_MAX_TOKENS) -> int:
    """Routes each slot computes in the grouped layout for a step of num_tokens (gathered over
    every rank) with k routes each over num_slots slots: factor x the mean load, at most
    num_tokens (a slot's most); num_tokens itself for steps of at most decode_tokens."""
    factor = capacity_factor() if factor is None else _checked_factor(factor)
    if num_tokens <= decode_tokens:
        return num_tokens
    return max(1, min(num_tokens, math.ceil(factor * num_tokens * k / num_slots)))


# ---- expert computation ----------------------------------------------------------------------
def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    local: torch.Tensor, capacity: int,
                    swiglu_limit: float | None = None) -> torch.Tensor:
    """x [N, H], w13 [S, 2F, H], w2 [S, H, F], weights [N, k], local [N, k] (-1: not here)
    -> [N, H] in x.dtype, each slot computing its first `capacity` routes (the caller makes
    sure none has more: the rest would be dropped). swiglu_limit: experts.swiglu's clamp."""
    slots, (tokens, hidden) = w13.shape[0], x.shape
    source, scale = _group_rows(local, weights, slots, capacity)
    # Row `tokens` is zeros: the empty buffer rows read it and their output is added there.
    xs = torch.cat((x, x.new_zeros(1, hidden)))[source].view(slots, capacity, hidden)
    gate, up = torch.bmm(xs, w13.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(swiglu(gate, up, swiglu_limit), w2.transpose(1, 2))
    y = y.reshape(slots * capacity, hidden)
    out = torch.zeros((tokens + 1, hidden), dtype=torch.float32, device=x.device)
    out.index_add_(0, source, y.float() * scale.unsqueeze(1))
    return out[:tokens].to(x.dtype)


def _group_rows(local: torch.Tensor, weights: torch.Tensor, slots: int,
                capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the [slots * capacity] buffer rows: its token (N where empty) and its route
    weight (0 where empty). A route's row is slot * capacity + its position within the slot."""
    tokens, k = local.shape
    flat = local.reshape(-1).long()
    here, slot = flat >= 0, flat.clamp_min(0)
    one_hot = F.one_hot(slot, slots).to(torch.int32) * here.unsqueeze(1)
    position = one_hot.cumsum(0, dtype=torch.int32).gather(1, slot.unsqueeze(1)).squeeze(1) - 1
    dump = slots * capacity  # one extra row takes every route not placed (and is cut off)
    row = torch.where(here & (position < capacity), slot * capacity + position, dump)
    token = torch.arange(tokens * k, device=local.device).div(k, rounding_mode="floor")
    source = torch.full((dump + 1,), tokens, dtype=torch.int64, device=local.device)
    source.scatter_(0, row, token)
    scale = torch.zeros(dump + 1, dtype=torch.float32, device=local.device)
    scale.scatter_(0, row, weights.reshape(-1).to(torch.float32))
    return source[:dump], scale[:dump]


def dense_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  local: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """grouped_experts without a capacity: every slot over every token, each weighted by the
    routes it serves (0 for the others). Exact at any load."""
    slots = w13.shape[0]
    here = (local >= 0).unsqueeze(-1)
    mask = F.one_hot(local.long().clamp_min(0), slots) * here  # [N, k, S]
    scale = (mask.to(torch.float32) * weights.to(torch.float32).unsqueeze(-1)).sum(1)
    gate, up = torch.matmul(x, w13.transpose(1, 2)).chunk(2, dim=-1)  # [S, N, 2F]
    y = torch.bmm(swiglu(gate, up, swiglu_limit), w2.transpose(1, 2))  # [S, N, H]
    return torch.einsum("ns,snh->nh", scale, y.float()).to(x.dtype)


# ---- the exchange ----------------------------------------------------------------------------
class StaticMoEExchange:
    """AllGatherExchange's interface with one packed route gather per layer and a grouped or
    dense computation chosen from the gathered counts. One rank: no collectives, same path.

    Attributes for tests and metrics: grouped_runs and dense_runs (layers computed each way).
    Settable: capacity_factor, decode_tokens, and num_real (this rank's real tokens, an int or
    a device scalar; None: all of them) for callers that do not pass it to run()."""

    def __init__(self, group: Any, rank: int, world_size: int, slots_per_rank: int,
                 factor: float | None = None, gather: Collective | None = None,
                 reduce_scatter: Collective | None = None) -> None:
        if world_size * slots_per_rank >= MAX_EXACT_SLOTS:
            raise ValueError(f"{world_size * slots_per_rank} expert slots: float32 route ids "
                             f"are exact below {MAX_EXACT_SLOTS} only")
        self.group, self.rank, self.world_size = group, rank, world_size
        self.slots_per_rank = slots_per_rank
        self.capacity_factor = capacity_factor() if factor is None else _checked_factor(factor)
        self.decode_tokens = DECODE_MAX_TOKENS
        self.num_real: int | torch.Tensor | None = None
        self.grouped_runs = self.dense_runs = 0
        # A traced device (XLA) cannot read the counts back mid-step: there every layer runs
        # grouped and ORs "some slot overflowed" into `overflow`, a device flag the backend
        # reads with the step's logits and then reruns the step with `force_dense` set.
        self.traced = False
        self.force_dense = False
        self.overflow: torch.Tensor | None = None
        # Region timing (timing.RegionTimer): the exchange, the experts and the combine are
        # the graph-split boundaries of a MoE layer. None: untimed.
        self.timer = None
        self._gather_fn = gather or all_gather
        self._reduce_scatter_fn = reduce_scatter or _reduce_scatter

    @property
    def num_slots(self) -> int:
        return self.world_size * self.slots_per_rank

    def run(self, x: torch.Tensor, weights: torch.Tensor, phys: torch.Tensor, padded: int,
            compute: StaticCompute, num_real: int | torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] this rank's tokens, phys [T, k] the physical slot of each route, the first
        num_real rows real (default: self.num_real, else all); every rank passes the same
        `padded` >= its T. Returns [T, H]."""
        tokens, k = phys.shape
        real = self.num_real if num_real is None else num_real
        with self._region("router_exchange"):
            packed = pack_routes(phys, weights, tokens if real is None else real, padded)
            all_x = self._gather(F.pad(x, (0, 0, 0, padded - tokens)))
            ids, route_weights, valid = unpack_routes(self._gather(packed), k)
            local = self._local(ids, valid)
            capacity = capacity_for(ids.shape[0], k, self.num_slots, self.capacity_factor,
                                    self.decode_tokens)
            fits = not self.force_dense and self._fits(ids, valid, capacity)
        with self._region("experts"):
            if fits:
                self.grouped_runs += 1
                partial = compute(all_x, route_weights, local, capacity=capacity)
            else:
                self.dense_runs += 1
                partial = compute(all_x, route_weights, local, capacity=None)
        with self._region("combine"):
            return self._reduce(partial, padded)[:tokens]

    def _region(self, name: str):
        return self.timer.region(name) if self.timer is not None else contextlib.nullcontext()

    def _fits(self, ids: torch.Tensor, valid: torch.Tensor, capacity: int) -> bool:
        """Whether no slot of any rank gets more routes than capacity. A token routes at most
        once to a slot (distinct experts, distinct replicas), so capacity >= tokens always
        fits and needs no host read of the counts. Traced: True, and the answer goes into
        the `overflow` flag instead of a host read."""
        if capacity >= ids.shape[0]:
            return True
        over = expert_counts(ids, valid, self.num_slots).max() > capacity
        if self.traced:
            self.overflow = over if self.overflow is None else self.overflow | over
            return True
        return not bool(over)

    def may_overflow(self, tokens: int) -> bool:
        """Whether a step of `tokens` on this rank can overflow a slot (every rank pads to
        the same count): capacity below the gathered tokens. Taken at one route a token, the
        smallest capacity, so that no step that can overflow is missed."""
        gathered = tokens * self.world_size
        return gathered > self.decode_tokens and capacity_for(
            gathered, 1, self.num_slots, self.capacity_factor, self.decode_tokens) < gathered

    def _local(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Gathered slot ids -> this rank's slot index, -1 for other ranks' slots and padding."""
        first = self.rank * self.slots_per_rank
        mine = valid.unsqueeze(1) & (ids >= first) & (ids < first + self.slots_per_rank)
        return torch.where(mine, ids - first, -1).to(torch.int32)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        self._gather_fn(out, t.contiguous(), group=self.group)
        return out

    def _reduce(self, partial: torch.Tensor, padded: int) -> torch.Tensor:
        if self.world_size == 1:
            return partial
        out = partial.new_empty((padded, *partial.shape[1:]))
        self._reduce_scatter_fn(out, partial.contiguous(), group=self.group)
        return out


class StaticMoEOps(MoEOps):
    """MoEOps of a static-shape backend, mixed into its ModelOps before it (class
    NeuronOps(StaticMoEOps, ReferenceOps)): its MoE layers compute grouped within a capacity,
    or dense, and exchange through StaticMoEExchange on one rank as on many."""

    def fused_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, slots: torch.Tensor,
                      capacity: int | None = None, swiglu_limit: float | None = None
                      ) -> torch.Tensor:
        if capacity is None:
            return dense_experts(x, w13, w2, weights, slots, swiglu_limit)
        return grouped_experts(x, w13, w2, weights, slots, capacity, swiglu_limit)

    def expert_exchange(self, group: Any, rank: int, world_size: int,
                        slots_per_rank: int) -> StaticMoEExchange:
        return StaticMoEExchange(group, rank, world_size, slots_per_rank)
