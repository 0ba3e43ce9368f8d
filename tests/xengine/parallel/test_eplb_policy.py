"""The pure EPLB placement policy: shapes, invariants, determinism and balance on skewed loads."""

from __future__ import annotations

import math
import random

import pytest

from xengine.parallel.eplb_policy import (
    Placement,
    balancedness,
    expected_physical_load,
    initial_placement,
    rank_loads,
    rebalance,
)

E = 32
ZIPF = [1 / (i + 1) for i in range(E)]  # the hottest expert takes ~25% of tokens
ZIPF_STEEP = [1 / (i + 1) ** 1.5 for i in range(E)]  # the hottest expert takes ~45%
HOT4_LAST = [0.1 / 28] * 28 + [0.9 / 4] * 4  # 4 experts take 90%, all in the initial last rank
HOT4_SPREAD = [0.9 / 4 if i in (3, 7, 11, 15) else 0.1 / 28 for i in range(E)]  # 4 hot, in the first half


def predicted(placement: Placement, load: list[float], layer: int = 0) -> float:
    return balancedness(rank_loads(placement, layer, expected_physical_load(placement, layer, load)))


def cardinality_bound(load: list[float], num_ranks: int) -> float:
    """Best balancedness any placement without replicas can reach: the rank holding the hottest expert also
    holds slots_per_rank - 1 other experts, at best the coldest ones."""
    ordered = sorted(load)
    spr = len(load) // num_ranks
    return sum(load) / num_ranks / (ordered[-1] + sum(ordered[: spr - 1]))


def check_invariants(p: Placement, num_logical: int, num_ranks: int, num_redundant: int) -> None:
    assert (p.num_logical, p.num_ranks, p.num_physical) == (
        num_logical,
        num_ranks,
        num_logical + num_redundant,
    )
    for layer in range(p.num_layers):
        per_rank = [p.local_logical(layer, r) for r in range(num_ranks)]
        assert all(len(slots) == p.slots_per_rank for slots in per_rank)
        assert sum(per_rank, ()) == p.phy_to_log[layer]
        replicas = p.replicas(layer)
        assert all(len(slots) >= 1 for slots in replicas)
        assert sorted(s for slots in replicas for s in slots) == list(range(p.num_physical))
        for expert, slots in enumerate(replicas):
            assert list(slots) == sorted(slots)
            assert all(p.phy_to_log[layer][s] == expert for s in slots)


def test_initial_placement_blocks_and_redundant_slots() -> None:
    p = initial_placement(num_layers=3, num_logical=8, num_ranks=2)
    check_invariants(p, 8, 2, 0)
    assert p.local_logical(2, 0) == (0, 1, 2, 3) and p.local_logical(2, 1) == (4, 5, 6, 7)
    p = initial_placement(num_layers=1, num_logical=8, num_ranks=2, num_redundant=2)
    check_invariants(p, 8, 2, 2)
    assert p.slots_per_rank == 5 and p.phy_to_log[0] == (0, 1, 2, 3, 4, 5, 6, 7, 0, 1)
    assert p.replicas(0)[0] == (0, 8) and p.replicas(0)[2] == (2,)
    assert [p.rank_of_slot(s) for s in (0, 4, 5, 9)] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("num_layers", "num_logical", "num_ranks", "num_redundant", "says"),
    [
        (1, 8, 3, 0, "multiple of 3"),
        (1, 8, 2, 1, "multiple of 2"),
        (1, 2, 4, 0, "multiple of 4"),
        (1, 8, 2, -2, ">= 0"),
        (1, 8, 0, 0, ">= 1 rank"),
        (0, 8, 2, 0, "num_layers"),
    ],
)
def test_initial_placement_errors(num_layers, num_logical, num_ranks, num_redundant, says) -> None:
    with pytest.raises(ValueError, match=says):
        initial_placement(num_layers, num_logical, num_ranks, num_redundant)


def test_placement_rejects_a_row_missing_an_expert() -> None:
    with pytest.raises(ValueError, match="each of 4 experts"):
        Placement(((0, 1, 2, 2),), num_ranks=2, num_logical=4)


@pytest.mark.parametrize(
    ("load", "num_ranks", "num_redundant", "kw", "says"),
    [
        ([[1.0, -1.0, 1.0, 1.0]], 2, 0, {}, "non-negative"),
        ([[1.0, math.nan, 1.0, 1.0]], 2, 0, {}, "non-negative"),
        ([[1.0] * 4, [1.0] * 3], 2, 0, {}, "load\\[1\\]"),
        ([[1.0] * 4], 2, 1, {}, "multiple of 2"),
        ([], 2, 0, {}, ">= 1 layer"),
        ([[1.0] * 6], 3, 0, {"num_groups": 2, "num_nodes": 2}, "divisible by num_nodes"),
        ([[1.0] * 6], 2, 0, {"num_groups": 4, "num_nodes": 2}, "divisible by num_groups"),
    ],
)
def test_rebalance_errors(load, num_ranks, num_redundant, kw, says) -> None:
    with pytest.raises(ValueError, match=says):
        rebalance(load, num_ranks, num_redundant, **kw)


def test_balancedness_and_loads() -> None:
    assert balancedness([]) == 1.0 and balancedness([0.0, 0.0]) == 1.0
    assert balancedness([1.0, 3.0]) == pytest.approx(2 / 3)
    p = initial_placement(1, num_logical=4, num_ranks=2, num_redundant=2)  # slots: 0 1 2 | 3 0 1
    assert expected_physical_load(p, 0, [8.0, 4.0, 2.0, 1.0]) == [4.0, 2.0, 2.0, 1.0, 4.0, 2.0]
    assert rank_loads(p, 0, [4.0, 2.0, 2.0, 1.0, 4.0, 2.0]) == [8.0, 7.0]
    with pytest.raises(ValueError):
        rank_loads(p, 0, [1.0] * 4)


def test_rebalance_is_deterministic() -> None:
    rng = random.Random(7)
    load = [[rng.paretovariate(1.1) for _ in range(64)] for _ in range(4)]
    first = rebalance(load, num_ranks=8, num_redundant=8)
    assert rebalance([list(row) for row in load], 8, 8) == first
    assert rebalance(tuple(tuple(row) for row in load), 8, 8) == first  # any sequence type
    ties = [[5.0] * 16]  # all ties: broken by index, the same every time
    assert rebalance(ties, 4, 4) == rebalance(ties, 4, 4)


LOADS = {"zipf": ZIPF, "zipf_steep": ZIPF_STEEP, "hot4_last": HOT4_LAST, "hot4_spread": HOT4_SPREAD}
SKEWED = [(name, n, r) for name in LOADS for n in (2, 4) for r in (0, 2, 4, 8) if (E + r) % n == 0]
# Without replicas on 4 ranks of 8 slots, Zipf can reach only 0.817 (steep Zipf 0.541): the rank holding the
# hottest expert also holds 7 others. Every other case reaches >= 0.9.
UNREACHABLE = {("zipf", 4, 0), ("zipf_steep", 4, 0)}


@pytest.mark.parametrize(("name", "num_ranks", "num_redundant"), SKEWED)
def test_skewed_load_is_balanced(name, num_ranks, num_redundant) -> None:
    load = LOADS[name]
    before = predicted(initial_placement(1, E, num_ranks, num_redundant), load)
    p = rebalance([load], num_ranks, num_redundant)
    check_invariants(p, E, num_ranks, num_redundant)
    after = predicted(p, load)
    assert after >= before
    if (name, num_ranks, num_redundant) in UNREACHABLE:
        assert after == pytest.approx(cardinality_bound(load, num_ranks))  # greedy reaches the optimum
        assert after < 0.9
    else:
        assert after >= 0.9


def test_hot_experts_get_the_replicas() -> None:
    p = rebalance([HOT4_LAST], num_ranks=4, num_redundant=4)
    assert [len(p.replicas(0)[e]) for e in range(E)] == [1] * 28 + [2] * 4
    for e in range(28, 32):  # two replicas of a hot expert never share a rank
        assert len({p.rank_of_slot(s) for s in p.replicas(0)[e]}) == 2


def test_hierarchical_keeps_each_group_on_one_node() -> None:
    num_ranks, num_nodes, num_groups, num_redundant = 4, 2, 8, 4  # 2 nodes x 2 ranks, 8 groups of 4
    hot_02 = [0.9 / 4 if e in (0, 1, 8, 9) else 0.1 / 28 for e in range(E)]  # hot experts in groups 0 and 2
    load = [[0.5 / 28] * 28 + [0.5 / 4] * 4, hot_02]  # layer 0: one hot group (7)
    p = rebalance(load, num_ranks, num_redundant, num_groups=num_groups, num_nodes=num_nodes)
    check_invariants(p, E, num_ranks, num_redundant)
    ranks_per_node = num_ranks // num_nodes
    for layer in range(2):
        replicas = p.replicas(layer)
        nodes_of_group = [
            {p.rank_of_slot(s) // ranks_per_node for e in range(g * 4, g * 4 + 4) for s in replicas[e]}
            for g in range(num_groups)
        ]
        assert all(len(nodes) == 1 for nodes in nodes_of_group)
        assert sorted(n for (n,) in nodes_of_group) == [0] * 4 + [1] * 4  # 4 groups per node
    # the group packing puts the two hot groups on different nodes (round robin would not)
    assert predicted(p, hot_02, layer=1) >= 0.9
    # the hot group is on one node: its replicas spread over that node's two ranks
    hot_ranks = {p.rank_of_slot(s) for e in range(28, 32) for s in p.replicas(0)[e]}
    assert len(hot_ranks) == 2
    # groups not divisible over nodes: the global policy
    assert rebalance(load, num_ranks, num_redundant, num_groups=3, num_nodes=2) == rebalance(
        load, num_ranks, num_redundant
    )


def test_random_loads_keep_invariants() -> None:
    rng = random.Random(1234)
    for _ in range(150):
        num_logical = rng.choice([4, 8, 16, 32, 64])
        num_ranks = rng.choice([1, 2, 4, 8])
        options = [r for r in range(0, 2 * num_logical + 1) if (num_logical + r) % num_ranks == 0]
        options = [r for r in options if num_logical + r >= num_ranks]
        if not options:
            continue
        num_redundant = rng.choice(options)
        shape = rng.choice([0.5, 1.2, 3.0])
        load = [
            [rng.paretovariate(shape) if rng.random() < 0.8 else 0.0 for _ in range(num_logical)]
            for _ in range(2)
        ]
        kw = {}
        if num_ranks >= 2 and rng.random() < 0.5:
            kw = {"num_nodes": 2, "num_groups": rng.choice([g for g in (2, 4, 8) if num_logical % g == 0])}
        p = rebalance(load, num_ranks, num_redundant, **kw)
        check_invariants(p, num_logical, num_ranks, num_redundant)
        assert rebalance(load, num_ranks, num_redundant, **kw) == p
        for layer in range(2):
            phys = expected_physical_load(p, layer, load[layer])
            assert sum(rank_loads(p, layer, phys)) == pytest.approx(sum(load[layer]))
            if num_ranks >= 2 and num_redundant <= num_logical and not kw:
                # greedy, not a theorem: replicas of one expert landed on distinct ranks in every sample here
                assert all(len(set(p.local_logical(layer, r))) == p.slots_per_rank for r in range(num_ranks))
