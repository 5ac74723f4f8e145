"""EPLB (deepinfer.models.moe.eplb) against independent references: the example printed in
DeepSeek's EPLB README, invariants of a placement on random loads, brute-force rank loads and
replica counts, and the imbalance a rebalance buys over the static placement."""
from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer.models.moe.eplb import (
    Placement,
    balanced_packing,
    imbalance,
    rank_loads,
    rebalance,
    replicate_experts,
)

# github.com/deepseek-ai/EPLB README: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes,
# 8 GPUs; the expected phy2log is the README's printed output.
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]

# (experts, redundant, ranks, groups, nodes): global, hierarchical, and a group count that
# does not split over the nodes (falls back to global).
LAYOUTS = [(16, 0, 4, 1, 1), (16, 8, 4, 1, 1), (16, 4, 4, 4, 2), (64, 16, 8, 8, 2),
           (32, 32, 8, 8, 4), (24, 8, 4, 3, 2)]
SEEDS = [0, 1, 2]


def random_load(seed: int, layers: int, experts: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(layers, experts, generator=g) * 1000


def skewed_load(seed: int, layers: int = 4, experts: int = 64) -> torch.Tensor:
    """Half of each layer's tokens go to 10% of the experts."""
    g = torch.Generator().manual_seed(seed)
    load = torch.rand(layers, experts, generator=g)
    hot = torch.zeros(experts, dtype=torch.bool)
    hot[torch.randperm(experts, generator=g)[: experts // 10]] = True
    load[:, hot] *= 0.5 / load[:, hot].sum(1, keepdim=True)
    load[:, ~hot] *= 0.5 / load[:, ~hot].sum(1, keepdim=True)
    return (load * 100_000).round()


def brute_rank_loads(load: torch.Tensor, p: Placement) -> list[list[float]]:
    """Rank loads by walking every slot: each slot serves its expert's load / replica count."""
    layers, slots = p.phy2log.shape
    out = [[0.0] * p.num_ranks for _ in range(layers)]
    for layer, slot in itertools.product(range(layers), range(slots)):
        expert = int(p.phy2log[layer, slot])
        copies = sum(int(e) == expert for e in p.phy2log[layer])
        out[layer][slot // p.slots_per_rank] += float(load[layer, expert]) / copies
    return out


def test_readme_example():
    p = rebalance(torch.tensor(README_WEIGHT), num_ranks=8, redundant=4, num_groups=4,
                  num_nodes=2)
    assert p.phy2log.tolist() == README_PHY2LOG
    assert p.log2phy.shape == (2, 12, 2)
    assert p.slots_per_rank == 2


def check_consistent(p: Placement, experts: int, redundant: int, ranks: int) -> None:
    """Counts, log2phy <-> phy2log and slots per rank of any valid placement."""
    layers, slots = p.phy2log.shape
    assert slots == experts + redundant and p.slots_per_rank * ranks == slots
    assert p.phy2log.dtype == p.log2phy.dtype == p.logcnt.dtype == torch.int64
    assert (p.logcnt >= 1).all() and (p.logcnt.sum(1) == slots).all()
    for layer in range(layers):
        seen = []
        for e in range(experts):
            n = int(p.logcnt[layer, e])
            phys = p.log2phy[layer, e, :n].tolist()
            assert all(int(p.phy2log[layer, s]) == e for s in phys)
            assert (p.log2phy[layer, e, n:] == -1).all()
            seen += phys
        assert sorted(seen) == list(range(slots))  # every slot exactly once
        ranks_used = [p.rank_of_slot(s) for s in seen]
        assert all(ranks_used.count(r) == slots // ranks for r in range(ranks))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("experts,redundant,ranks,groups,nodes", LAYOUTS)
def test_placement_invariants(seed, experts, redundant, ranks, groups, nodes):
    load = random_load(seed, 3, experts)
    p = rebalance(load, ranks, redundant, groups, nodes)
    check_consistent(p, experts, redundant, ranks)


def node_of_expert(p: Placement, layer: int, expert: int, ranks_per_node: int) -> set[int]:
    slots = p.log2phy[layer, expert, : int(p.logcnt[layer, expert])].tolist()
    return {p.rank_of_slot(s) // ranks_per_node for s in slots}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("experts,redundant,ranks,groups,nodes",
                         [lay for lay in LAYOUTS if lay[3] % lay[4] == 0 and lay[4] > 1])
def test_hierarchical_groups_stay_on_one_node(seed, experts, redundant, ranks, groups, nodes):
    load = random_load(seed, 3, experts)
    p = rebalance(load, ranks, redundant, groups, nodes)
    size = experts // groups
    for layer in range(3):
        group_nodes = []
        for g in range(groups):
            found = set().union(*(node_of_expert(p, layer, e, ranks // nodes)
                                  for e in range(g * size, (g + 1) * size)))
            assert len(found) == 1, f"group {g} of layer {layer} spans nodes {found}"
            group_nodes += found
        assert all(group_nodes.count(n) == groups // nodes for n in range(nodes))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("experts,redundant,ranks,groups,nodes",
                         [lay for lay in LAYOUTS if lay[1] > 0])
def test_heaviest_expert_gets_most_replicas(seed, experts, redundant, ranks, groups, nodes):
    load = random_load(seed, 3, experts)
    p = rebalance(load, ranks, redundant, groups, nodes)
    if groups % nodes:
        nodes = 1  # the global policy: one pool of replicas
    for layer in range(3):
        # Replicas are handed out node by node, so compare within each node's experts.
        by_node: dict[int, list[int]] = {}
        for e in range(experts):
            (node,) = node_of_expert(p, layer, e, ranks // nodes)
            by_node.setdefault(node, []).append(e)
        for members in by_node.values():
            heaviest = max(members, key=lambda e: float(load[layer, e]))
            most = max(int(p.logcnt[layer, e]) for e in members)
            assert int(p.logcnt[layer, heaviest]) == most
        assert int(p.logcnt[layer].max()) > 1


def test_global_fallback_ignores_groups():
    load = random_load(7, 3, 24)
    fallback = rebalance(load, 4, 8, num_groups=3, num_nodes=2)  # 3 groups on 2 nodes
    plain = rebalance(load, 4, 8)
    assert torch.equal(fallback.phy2log, plain.phy2log)
    assert torch.equal(fallback.log2phy, plain.log2phy)


def test_replicate_experts_minimises_peak_load_per_replica():
    load = torch.tensor([[7.0, 1.0, 3.0, 12.0], [5.0, 5.0, 0.0, 2.0]])
    slots = 9
    rep = replicate_experts(load, slots)
    assert rep.phy2log[:, :4].tolist() == [[0, 1, 2, 3]] * 2  # originals keep their slot
    for row, counts in zip(load.tolist(), rep.count.tolist(), strict=True):
        best = min(max(w / c for w, c in zip(row, cand, strict=True))
                   for cand in itertools.product(range(1, slots), repeat=4)
                   if sum(cand) == slots)
        assert max(w / c for w, c in zip(row, counts, strict=True)) == pytest.approx(best)


def test_balanced_packing_by_hand():
    # Greedy by hand: 5->A, 4->B, 3->B (4<5), 2->A (5<7), 1->A (tie 7=7: lower pack), 1->B.
    packing = balanced_packing(torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 1.0]]), 2)
    assert packing.pack.tolist() == [[0, 1, 1, 0, 0, 1]]
    assert packing.position.tolist() == [[0, 0, 1, 1, 2, 2]]


def test_one_item_per_pack_stays_in_place():
    # Every assignment balances equally; DeepSeek's rule keeps item i in pack i (no moves).
    packing = balanced_packing(torch.tensor([[1.0, 9.0, 4.0, 7.0]]), 4)
    assert packing.pack.tolist() == [[0, 1, 2, 3]]
    assert packing.position.tolist() == [[0, 0, 0, 0]]
    p = rebalance(random_load(3, 2, 8), num_ranks=8)
    assert p.phy2log.tolist() == [list(range(8))] * 2


@pytest.mark.parametrize("seed", SEEDS)
def test_rank_loads_match_brute_force(seed):
    load = skewed_load(seed)
    for p in (rebalance(load, 8, 16, 8, 2), Placement.identity(4, 64, 8, 8)):
        brute = torch.tensor(brute_rank_loads(load, p), dtype=torch.float64)
        torch.testing.assert_close(rank_loads(load, p), brute)
        totals = brute.sum(0)
        assert imbalance(load, p) == pytest.approx(float(totals.max() / totals.mean()))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("redundant", [0, 8, 32])
def test_rebalance_beats_identity_on_skewed_load(seed, redundant):
    load = skewed_load(seed)
    before = imbalance(load, Placement.identity(4, 64, 8, redundant))
    after = imbalance(load, rebalance(load, 8, redundant))
    assert after <= before
    if redundant:
        assert before > 1.3  # the skew really is there
        assert after < 1.02
        assert imbalance(load, rebalance(load, 8, redundant, 8, 2)) < 1.05


def test_identity_without_redundancy():
    p = Placement.identity(3, 16, 4)
    assert p.phy2log.tolist() == [list(range(16))] * 3
    assert (p.logcnt == 1).all() and p.log2phy.shape == (3, 16, 1)
    assert p.log2phy[..., 0].tolist() == [list(range(16))] * 3
    assert [p.rank_of_slot(s) for s in range(16)] == [s // 4 for s in range(16)]


@pytest.mark.parametrize("experts,redundant,ranks", [(16, 4, 4), (6, 2, 4), (3, 5, 2)])
def test_identity_with_redundancy(experts, redundant, ranks):
    p = Placement.identity(2, experts, ranks, redundant)
    check_consistent(p, experts, redundant, ranks)
    assert p.phy2log[:, :experts].tolist() == [list(range(experts))] * 2


def test_balanced_load_stays_balanced():
    load = torch.full((2, 16), 10.0)
    assert imbalance(load, rebalance(load, 4)) == pytest.approx(1.0)
    assert imbalance(torch.zeros(2, 16), rebalance(torch.zeros(2, 16), 4, 4)) == 1.0


@pytest.mark.parametrize("load,kwargs,message", [
    (torch.ones(16), {"num_ranks": 4}, "layers, experts"),
    (torch.ones(2, 16), {"num_ranks": 4, "redundant": -4}, "redundant must be >= 0"),
    (torch.ones(2, 16), {"num_ranks": 3}, "do not split over 3 ranks"),
    (torch.ones(2, 16), {"num_ranks": 4, "redundant": 2}, "do not split over 4 ranks"),
    (torch.ones(2, 16), {"num_ranks": 4, "num_groups": 3}, "must divide the 16 experts"),
    (torch.ones(2, 16), {"num_ranks": 4, "num_nodes": 3}, "must divide num_ranks=4"),
    (-torch.ones(2, 16), {"num_ranks": 4}, "non-negative"),
])
def test_rebalance_rejects_bad_input(load, kwargs, message):
    with pytest.raises(ValueError, match=message):
        rebalance(load, **kwargs)


def test_other_entry_points_reject_bad_input():
    with pytest.raises(ValueError, match="do not split over 4 ranks"):
        Placement.identity(2, 16, 4, redundant=1)
    with pytest.raises(ValueError, match="placement is for"):
        rank_loads(torch.ones(2, 8), Placement.identity(2, 16, 4))
