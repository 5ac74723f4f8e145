"""Expert-parallel load balancing (EPLB): per-expert token counts -> where each expert lives.

With expert parallelism every rank holds a fixed number of expert *slots*. Routing is skewed,
so a static placement leaves some ranks serving many more tokens than others, and the slowest
rank sets the step time. DeepSeek's EPLB (github.com/deepseek-ai/EPLB, DeepSeek-V3 paper) fixes
that with two levers, which this module reimplements with the same decisions:

- *redundant experts*: spare slots hold extra replicas of the heaviest experts, whose tokens then
  split evenly over the replicas (`replicate_experts`);
- *balanced packing*: the replicas are dealt to ranks greedily, heaviest first, each to the
  lightest rank that still has a free slot (`balanced_packing`).

When the expert groups of group-limited routing (DeepSeek-V3's `n_group`) divide evenly over the
nodes, the *hierarchical* policy first packs whole groups onto nodes, so a token's experts stay
inside the few nodes its groups live on (less traffic over the slow inter-node links), then
replicates and packs within each node. Otherwise the *global* policy treats everything as a
single node with a single group.

Terms: L MoE layers, E logical experts, R redundant slots, P = E + R physical slots, N ranks of
P / N slots each (rank k owns slots k*P/N .. (k+1)*P/N - 1), M nodes of N / M ranks each.
Everything runs on CPU tensors: ids are int64, loads float64 (token counts summed over a long
window overflow float32's exact integers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Placement", "balanced_packing", "imbalance", "rank_loads", "rebalance",
           "replicate_experts"]


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no single truth value to compare
class Placement:
    """Where every physical expert slot lives, per MoE layer."""

    phy2log: torch.Tensor  # [L, P] int64: the logical expert each physical slot holds
    log2phy: torch.Tensor  # [L, E, max_replicas] int64: slots of each logical expert, -1 padded
    logcnt: torch.Tensor  # [L, E] int64: replicas of each logical expert (>= 1)
    num_ranks: int

    def __post_init__(self) -> None:
        if self.phy2log.dim() != 2 or self.num_ranks < 1:
            raise ValueError(f"phy2log must be [layers, slots] over >= 1 rank, got shape "
                             f"{tuple(self.phy2log.shape)} over {self.num_ranks} ranks")
        if self.phy2log.shape[1] % self.num_ranks:
            raise ValueError(f"{self.phy2log.shape[1]} slots do not split over "
                             f"{self.num_ranks} ranks")

    @property
    def slots_per_rank(self) -> int:
        return self.phy2log.shape[1] // self.num_ranks

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_ranks: int,
                 redundant: int = 0) -> Placement:
        """The static placement used before any statistics: slot s holds expert s % E.

        Without redundancy rank k thus holds the contiguous experts k*E/N ..; the R redundant
        slots are the last ones and hold replicas of experts 0, 1, .., R-1 (wrapping round when
        R > E), so every expert has at least one slot and every rank exactly P / N of them.
        """
        _check_sizes(num_experts, num_ranks, redundant)
        slots = torch.arange(num_experts + redundant, dtype=torch.int64)
        phy2log = (slots % num_experts).expand(num_layers, -1)
        replica = (slots // num_experts).expand(num_layers, -1)  # the wrap-round count
        return _placement(phy2log, replica, num_experts, num_ranks)

    def rank_of_slot(self, slot: int | torch.Tensor) -> int | torch.Tensor:
        return slot // self.slots_per_rank


@dataclass(frozen=True, eq=False)
class Packing:
    """Items dealt to equal-sized packs: item i is the `position`-th item of pack `pack`."""

    pack: torch.Tensor  # [X, n] int64
    position: torch.Tensor  # [X, n] int64


@dataclass(frozen=True, eq=False)
class Replication:
    """Logical experts spread over more physical slots (one row per layer, or per layer-node)."""

    phy2log: torch.Tensor  # [X, slots] int64: the first `experts` slots are 0..experts-1
    replica: torch.Tensor  # [X, slots] int64: 0 for an expert's original slot, then 1, 2, ..
    count: torch.Tensor  # [X, experts] int64: replicas per expert


def balanced_packing(weight: torch.Tensor, num_packs: int) -> Packing:
    """Deal the n items of each row of `weight` [X, n] to `num_packs` packs of n / num_packs
    items each, keeping the pack totals as even as the greedy rule can."""
    if weight.shape[1] == num_packs:
        # One item per pack: every assignment has the same totals, so keep items where they are.
        pack = torch.arange(num_packs, dtype=torch.int64).expand(weight.shape[0], -1)
        return Packing(pack, torch.zeros_like(pack))
    rows = [_pack_row(row, num_packs) for row in weight.tolist()]
    return Packing(torch.tensor([r[0] for r in rows], dtype=torch.int64).view(weight.shape),
                   torch.tensor([r[1] for r in rows], dtype=torch.int64).view(weight.shape))


def _pack_row(weights: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    """Greedy (LPT with a capacity): heaviest item first, into the lightest pack with room.
    Ties go to the lower item id and the lower pack id, so the result is deterministic."""
    capacity = len(weights) // num_packs
    totals, sizes = [0.0] * num_packs, [0] * num_packs
    pack, position = [0] * len(weights), [0] * len(weights)
    for item in sorted(range(len(weights)), key=lambda i: -weights[i]):  # sorted() is stable
        best = min((p for p in range(num_packs) if sizes[p] < capacity), key=totals.__getitem__)
        pack[item], position[item] = best, sizes[best]
        totals[best] += weights[item]
        sizes[best] += 1
    return pack, position


def replicate_experts(weight: torch.Tensor, num_slots: int) -> Replication:
    """Spread the experts of each row of `weight` [X, experts] over `num_slots` slots: each
    spare slot in turn goes to the expert whose load per replica is then highest, which
    minimises the largest load per replica."""
    rows, num_experts = weight.shape
    count = torch.ones(rows, num_experts, dtype=torch.int64)
    chosen, replica = [], []
    for _ in range(num_slots - num_experts):
        expert = (weight / count).argmax(-1, keepdim=True)  # argmax: the lowest id on ties
        chosen.append(expert)
        replica.append(count.gather(1, expert))
        count.scatter_add_(1, expert, torch.ones_like(expert))
    originals = torch.arange(num_experts, dtype=torch.int64).expand(rows, -1)
    return Replication(torch.cat([originals, *chosen], 1),
                       torch.cat([torch.zeros_like(originals), *replica], 1), count)


def rebalance(load: torch.Tensor, num_ranks: int, redundant: int = 0, num_groups: int = 1,
              num_nodes: int = 1) -> Placement:
    """load [L, E] tokens routed to each logical expert (any non-negative numbers) -> a placement
    with E + redundant physical slots over num_ranks ranks (E + redundant divisible by
    num_ranks, num_ranks by num_nodes).
    Hierarchical (groups -> nodes, replicate within node, pack to ranks) when
    num_groups % num_nodes == 0, else global."""
    _check_load(load)
    _check_sizes(load.shape[1], num_ranks, redundant)
    _check_topology(load.shape[1], num_ranks, num_groups, num_nodes)
    if num_groups % num_nodes:
        # Groups cannot sit whole on nodes: balance across all ranks, ignoring groups and nodes.
        num_groups, num_nodes = 1, 1
    return _rebalance_hierarchical(load.double(), num_ranks, redundant, num_groups, num_nodes)


def _rebalance_hierarchical(load: torch.Tensor, num_ranks: int, redundant: int, num_groups: int,
                            num_nodes: int) -> Placement:
    """Groups -> nodes, then replicas and ranks node by node: one row per (layer, node)."""
    layers, num_experts = load.shape
    rows = layers * num_nodes
    experts = _node_experts(load, num_groups, num_nodes).view(rows, -1)
    node_load = load.gather(1, experts.view(layers, -1)).view(rows, -1)
    replication = replicate_experts(node_load, (num_experts + redundant) // num_nodes)
    slot = _pack_replicas(node_load, replication, num_ranks // num_nodes)
    # Row (l, m) of a [L * M, P / M] view is node m's slots of layer l: no offsets needed.
    logical = experts.gather(1, replication.phy2log)
    phy2log = torch.empty_like(logical).scatter_(1, slot, logical).view(layers, -1)
    replica = torch.empty_like(logical).scatter_(1, slot, replication.replica).view(layers, -1)
    return _placement(phy2log, replica, num_experts, num_ranks)


def _node_experts(load: torch.Tensor, num_groups: int, num_nodes: int) -> torch.Tensor:
    """[L, E]: the logical experts of node 0, then of node 1, ..; each node's groups in the
    order the packing filled them, each group's experts in id order."""
    layers, num_experts = load.shape
    group_size = num_experts // num_groups
    packing = balanced_packing(load.view(layers, num_groups, group_size).sum(-1), num_nodes)
    place = packing.pack * (num_groups // num_nodes) + packing.position  # group -> its place
    groups = torch.arange(num_groups, dtype=torch.int64).expand(layers, -1)
    groups = torch.empty_like(place).scatter_(1, place, groups)  # place -> its group
    return (groups.unsqueeze(-1) * group_size + torch.arange(group_size)).flatten(1)


def _pack_replicas(node_load: torch.Tensor, replication: Replication,
                   ranks_per_node: int) -> torch.Tensor:
    """[rows, P / M]: the slot (within its node) of each replica, packed by load per replica."""
    per_replica = (node_load / replication.count).gather(1, replication.phy2log)
    packing = balanced_packing(per_replica, ranks_per_node)
    return packing.pack * (per_replica.shape[1] // ranks_per_node) + packing.position


def _placement(phy2log: torch.Tensor, replica: torch.Tensor, num_experts: int,
               num_ranks: int) -> Placement:
    """Complete phy2log [L, P] and each slot's replica number into a Placement."""
    layers, slots = phy2log.shape
    logcnt = torch.zeros(layers, num_experts, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    width = int(logcnt.max())
    log2phy = torch.full((layers, num_experts * width), -1, dtype=torch.int64)
    all_slots = torch.arange(slots, dtype=torch.int64).expand(layers, -1)
    log2phy.scatter_(1, phy2log * width + replica, all_slots)
    return Placement(phy2log.contiguous(), log2phy.view(layers, num_experts, width), logcnt,
                     num_ranks)


def rank_loads(load: torch.Tensor, placement: Placement) -> torch.Tensor:
    """[L, num_ranks]: tokens each rank serves if each logical expert's load splits evenly over
    its replicas."""
    _check_load(load)
    if load.shape != placement.logcnt.shape:
        raise ValueError(f"load has shape {tuple(load.shape)} but the placement is for "
                         f"{tuple(placement.logcnt.shape)} [layers, experts]")
    per_replica = load.double() / placement.logcnt
    per_slot = per_replica.gather(1, placement.phy2log)
    return per_slot.view(load.shape[0], placement.num_ranks, -1).sum(-1)


def imbalance(load: torch.Tensor, placement: Placement) -> float:
    """max over ranks / mean over ranks of rank_loads, summed over layers first (1.0 = perfect):
    the number EPLB reports before and after a rebalance."""
    per_rank = rank_loads(load, placement).sum(0)
    mean = float(per_rank.mean())
    return float(per_rank.max()) / mean if mean > 0 else 1.0  # no tokens: nothing to balance


def _check_load(load: torch.Tensor) -> None:
    if load.dim() != 2 or load.numel() == 0:
        raise ValueError(f"load must be a non-empty [layers, experts] tensor, got shape "
                         f"{tuple(load.shape)}")
    if not bool(torch.isfinite(load).all()) or bool((load < 0).any()):
        raise ValueError("load must hold finite, non-negative token counts")


def _check_sizes(num_experts: int, num_ranks: int, redundant: int) -> None:
    if num_experts < 1 or num_ranks < 1:
        raise ValueError(f"need >= 1 expert and >= 1 rank, got {num_experts} and {num_ranks}")
    if redundant < 0:
        raise ValueError(f"redundant must be >= 0, got {redundant}")
    if (num_experts + redundant) % num_ranks:
        raise ValueError(f"{num_experts} experts + {redundant} redundant = "
                         f"{num_experts + redundant} slots do not split over {num_ranks} ranks")


def _check_topology(num_experts: int, num_ranks: int, num_groups: int, num_nodes: int) -> None:
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the {num_experts} experts")
    if num_nodes < 1 or num_ranks % num_nodes:
        raise ValueError(f"num_nodes={num_nodes} must divide num_ranks={num_ranks}")
