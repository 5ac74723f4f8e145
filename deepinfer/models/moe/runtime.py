"""What a model's MoE layers share at run time: where every expert lives (the placement, the
same on every rank), which slots this rank holds, the exchange between ranks, and how many
tokens each expert received (EPLB's input, also exported in /metrics).

Every per-step tensor has a fixed shape and address (the replica tables are padded to their
largest possible width, counters accumulate in place, the count of real tokens is a device
scalar), so the MoE layers run inside CUDA graphs and a rebalance only copies into them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.core.accelerator import ParallelContext
from deepinfer.models.moe.eplb import Placement, imbalance, rebalance
from deepinfer.models.moe.exchange import AllGatherExchange, AllToAllExchange, Compute, all_gather
from deepinfer.models.moe.ops import MoEOps
from deepinfer.models.moe.routing import RouteCounts

# Agreed step sizes (tokens per rank) from which MoE layers exchange routes all-to-all rather
# than all-gather + reduce-scatter: all-gather won at every size measured on one NVLink host
# (docs/benchmarks.md, "Tuned constants"), so all-to-all is kept for larger steps.
ALL_TO_ALL_MIN_TOKENS = 16384


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class RebalanceReport:
    """One EPLB rebalance, as the rank loop reports it."""

    stall_s: float  # wall time the ranks stopped serving for it
    imbalance_before: float  # max/mean tokens per rank over the window, old placement
    imbalance_after: float  # the same load under the new placement
    window_tokens: int  # routed tokens the decision was based on
    experts_moved: int  # slots whose expert changed (all ranks, all layers)


class ExpertRuntime:
    def __init__(self, num_layers: int, num_experts: int,
                 parallel: ParallelContext | None = None, num_groups: int = 1) -> None:
        # Host tensors even while the model is built on the meta device.
        with torch.device("cpu"):
            self._init(num_layers, num_experts, parallel, num_groups)

    def _init(self, num_layers: int, num_experts: int, parallel: ParallelContext | None,
              num_groups: int) -> None:
        ep = parallel is not None and parallel.expert_parallel and parallel.world_size > 1
        self.num_ranks = parallel.world_size if ep else 1
        self.rank = parallel.rank if ep else 0
        self.group = parallel.group if ep else None
        redundant = parallel.redundant_experts if ep else 0
        self.num_layers, self.num_experts, self.num_groups = num_layers, num_experts, num_groups
        self.placement = Placement.identity(num_layers, num_experts, self.num_ranks, redundant)
        self.max_replicas = redundant + 1
        self.exchange = AllGatherExchange(self.group, self.rank, self.num_ranks,
                                          self.slots_per_rank) if ep else None
        self.all_to_all = AllToAllExchange(self.group, self.rank, self.num_ranks,
                                           self.slots_per_rank) if ep else None
        self.all_to_all_min_tokens = ALL_TO_ALL_MIN_TOKENS
        # A static-shape backend's own exchange (ops.expert_exchange, see add_block): it then
        # serves every step, on one rank too. None on other backends.
        self.static_exchange = None
        # Shapes are agreed on a host (gloo) group: no device sync before a forward. Made here,
        # as every rank builds its model, so every rank creates its groups in the same order.
        self.shape_group = _host_group(self.group) if ep else None
        if ep and parallel.placement_from is not None:
            self._take_placement(parallel.placement_from)
        self.blocks: list = []  # the MoE blocks, in layer order (their weights move on rebalance)
        self.moving = False  # a rebalance's weight moves are under way
        self.padded_tokens = 0  # tokens every rank passes to the exchange this step
        self.device = torch.device("cpu")
        self._tables(torch.device("cpu"))
        self.total_load = torch.zeros((num_layers, num_experts), dtype=torch.int64)

    def rebind(self, parallel: ParallelContext) -> None:
        """Take a new group of the same ranks (a rank of the group was replaced): the same
        calls, in the same order, as a rank joining it makes in _init, so the groups' creation
        and the placement's broadcast are matched."""
        if self.group is None:
            return
        if (parallel.rank, parallel.world_size) != (self.rank, self.num_ranks):
            raise ValueError(f"a regroup keeps each rank's place: rank {self.rank} of "
                             f"{self.num_ranks}, got {parallel.rank} of {parallel.world_size}")
        if self.moving:  # the rank then exits, and the whole group restarts
            raise RuntimeError("the group broke off an expert rebalance mid-move: this rank's "
                               "expert weights match no placement, so it cannot keep its model")
        self.group = parallel.group
        for exchange in (self.exchange, self.all_to_all, self.static_exchange):
            if exchange is not None:
                exchange.group = parallel.group
        self.shape_group = _host_group(self.group)
        if parallel.placement_from is not None:
            self._take_placement(parallel.placement_from)

    def _take_placement(self, source: int) -> None:
        """Collective: every rank takes `source`'s placement. A replaced rank loads its
        experts from it (EPLB may have moved them since the group started); the others hold
        it already."""
        p = self.placement
        layers, slots = p.phy2log.shape
        log2phy = torch.full((layers, self.num_experts, self.max_replicas), -1, dtype=torch.int64)
        log2phy[:, :, :p.log2phy.shape[2]] = p.log2phy
        packed = torch.cat((p.phy2log, log2phy.view(layers, -1)), dim=1)
        dist.broadcast(packed, source, group=self.shape_group)
        log2phy = packed[:, slots:].reshape(layers, self.num_experts, self.max_replicas)
        logcnt = (log2phy >= 0).sum(-1)
        self.placement = Placement(packed[:, :slots].contiguous(),
                                   log2phy[:, :, :int(logcnt.max())].contiguous(), logcnt,
                                   self.num_ranks)

    @property
    def slots_per_rank(self) -> int:
        return self.placement.slots_per_rank

    def rank_slots(self, rank: int | None = None) -> range:
        """The physical slots a rank holds."""
        start = (self.rank if rank is None else rank) * self.slots_per_rank
        return range(start, start + self.slots_per_rank)

    def local_slots_of(self, layer: int, expert: int) -> list[int]:
        """This rank's slots (0-based) that hold a replica of `expert` in `layer`."""
        held = self.placement.phy2log[layer, self.rank_slots()].tolist()
        return [i for i, e in enumerate(held) if e == expert]

    def add_block(self, block) -> None:
        """A model's MoE layer (an MoEBlock), in layer order. The first one brings the model's
        ops: if they provide an exchange (ops.expert_exchange: static-shape backends), it
        replaces the all-gather one under expert parallel and is also used on one rank, so
        every step runs the same static path; all-to-all is then never used (its split sizes
        depend on the routes)."""
        if not self.blocks:
            ops = block.ops  # None where the model is built for its KV spec alone
            exchange = ops.expert_exchange(self.group, self.rank, self.num_ranks,
                                           self.slots_per_rank) \
                if isinstance(ops, MoEOps) else None
            if exchange is not None:
                self.static_exchange = exchange
                if self.num_ranks > 1:  # agree() and needs_collectives read self.exchange
                    self.exchange = exchange
        self.blocks.append(block)

    def to(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._tables(self.device)

    def _tables(self, device: torch.device) -> None:
        p = self.placement
        log2phy = torch.full((self.num_layers, self.num_experts, self.max_replicas), -1,
                             dtype=torch.int64)
        log2phy[:, :, :p.log2phy.shape[2]] = p.log2phy
        self.log2phy = log2phy.to(device)
        self.logcnt = p.logcnt.to(device)
        self.load = torch.zeros((self.num_layers, self.num_experts), dtype=torch.int64,
                                device=device)  # this rank's tokens since the last rebalance
        self.valid = torch.zeros((), dtype=torch.int64, device=device)
        self._valid_value: int | None = 0

    # ---- per step --------------------------------------------------------------------------
    def agree(self, num_tokens: int, graphable: bool = False) -> tuple[int, bool]:
        """Collective under expert parallel, before every forward: the step's token count for
        every rank's exchange (the largest), and whether every rank can replay a CUDA graph
        (then all do, at the bucket of that count; else all run eagerly)."""
        if self.exchange is None:
            return num_tokens, graphable
        votes = torch.tensor([num_tokens, int(not graphable)])
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.shape_group)
        return int(votes[0]), not bool(votes[1])

    def set_step(self, padded_tokens: int, num_real: int | torch.Tensor) -> None:
        """The agreed token count, and how many of this rank's tokens are real (padding is
        not counted in any expert's load). Outside any CUDA graph: it writes a device
        scalar the graphs read. A device scalar given instead is used as it is: a traced
        graph (XLA) takes it as an input, where a fill would trace into the step's graph."""
        self.padded_tokens = padded_tokens
        if isinstance(num_real, torch.Tensor):
            self.valid, self._valid_value = num_real, None
        elif num_real != self._valid_value:  # a steady decode batch launches no fill
            if self._valid_value is None:  # the last step's input tensor: a buffer again
                self.valid = torch.zeros((), dtype=torch.int64, device=self.device)
            self.valid.fill_(num_real)
            self._valid_value = num_real

    def begin_step(self, num_tokens: int, num_real: int | torch.Tensor) -> None:
        """Before an eager forward: agree, then set the step."""
        self.set_step(self.agree(num_tokens)[0], num_real)

    def counts(self, layer: int) -> RouteCounts:
        """Where the layer's router adds the routes of this step's real tokens."""
        return RouteCounts(self.load[layer], self.valid)

    def run(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            compute: Compute) -> torch.Tensor:
        """The routed experts' output for x [T, H] routed to logical experts ids [T, k]."""
        if self.static_exchange is not None:
            return self._run_static(layer, x, weights, ids, compute)
        if self.exchange is None:
            # One rank: slot e holds expert e (no replicas, nothing to rebalance).
            return compute(x, weights, ids.to(torch.int32))
        phys = self._physical(layer, ids)
        padded = max(self.padded_tokens, x.shape[0])
        if padded >= self.all_to_all_min_tokens and not _capturing(x):
            return self.all_to_all.run(x, weights, phys, compute)
        return self.exchange.run(x, weights, phys, padded, compute)

    def _run_static(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    compute: Compute) -> torch.Tensor:
        """Through the backend's static exchange, which leaves this rank's padding rows (at or
        past the device scalar `valid`, as in the load counts) out of every expert."""
        # One rank: slot e holds expert e, and the exchange skips its collectives.
        phys = ids.long() if self.num_ranks == 1 else self._physical(layer, ids)
        padded = max(self.padded_tokens, x.shape[0])
        return self.static_exchange.run(x, weights, phys, padded, compute, num_real=self.valid)

    def _physical(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """A physical slot per route: replicas of an expert take turns by token index."""
        ids = ids.long()
        turn = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        choice = turn % self.logcnt[layer][ids]
        return self.log2phy[layer][ids, choice]

    # ---- EPLB ------------------------------------------------------------------------------
    def expert_load(self) -> torch.Tensor:
        """[layers, experts] routed tokens of this rank since start (host)."""
        return self.total_load + self.load.cpu()

    def rebalance(self) -> RebalanceReport | None:
        """Collective: every rank calls it at the same step. A new placement from the
        group's load since the last rebalance, then every rank fetches its new slots' weights.
        None (on every rank) when no token was routed since the last one."""
        start = time.perf_counter()
        window = self.load.clone()
        if self.group is not None:
            dist.all_reduce(window, group=self.group)
        window = window.cpu()
        if not int(window.sum()):
            return None
        old = self.placement
        new = rebalance(window, self.num_ranks, self.max_replicas - 1, self.num_groups)
        # Until the last layer has moved, this rank's weights match neither placement: a group
        # that breaks off meanwhile cannot be mended around it (see rebind).
        self.moving = True
        for layer, block in enumerate(self.blocks):
            # The same placement on every rank, so every rank skips the same layers' gathers.
            if not torch.equal(old.phy2log[layer], new.phy2log[layer]):
                block.move_experts(self._sources(old, new, layer), self)
        self.total_load += self.load.cpu()
        self.load.zero_()
        self.placement, self.moving = new, False
        self._refresh_tables()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        moved = int((old.phy2log != new.phy2log).sum())
        return RebalanceReport(time.perf_counter() - start, imbalance(window, old),
                               imbalance(window, new), int(window.sum()), moved)

    def _sources(self, old: Placement, new: Placement, layer: int) -> torch.Tensor:
        """For each of this rank's new slots: an old physical slot holding the same expert."""
        wanted = new.phy2log[layer, self.rank_slots()]
        return old.log2phy[layer, wanted, 0]

    def _refresh_tables(self) -> None:
        p = self.placement
        self.log2phy.fill_(-1)
        self.log2phy[:, :, :p.log2phy.shape[2]].copy_(p.log2phy)
        self.logcnt.copy_(p.logcnt)

    def gather_slots(self, weight: torch.Tensor) -> torch.Tensor:
        """Every rank's slots of one stacked expert weight [S, ...] -> [P, ...]."""
        if self.group is None:
            return weight
        out = weight.new_empty((self.num_ranks * weight.shape[0], *weight.shape[1:]))
        all_gather(out, weight.contiguous(), group=self.group)
        return out


def _host_group(group):
    """A gloo group over the ranks of `group` (itself when it is gloo): shapes and votes are
    agreed on host tensors, without a device sync."""
    return group if dist.get_backend(group) == "gloo" else dist.new_group(backend="gloo")
