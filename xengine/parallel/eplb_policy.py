"""Expert placement for EPLB: which logical expert each physical expert slot holds, per MoE layer.

With expert parallelism each rank computes the experts in its slots, so a step is as slow as the rank that
received the most tokens. Routing is skewed (a few experts take most tokens), so we place experts by load
(xLLM report §4.4.2, following DeepSeek's published EPLB):

1. **Replicate.** There are ``E + R`` slots for ``E`` logical experts. Every expert keeps one replica; the
   ``R`` redundant slots go one at a time to the expert with the highest ``load / replica count`` (ties: fewer
   replicas, then lower index), never giving an expert more replicas than there are ranks while another
   expert can still take one (two replicas on one rank balance nothing).
2. **Pack.** Each replica carries ``load / replica count`` of its expert (routing spreads tokens evenly over
   replicas). Replicas go heaviest first to the least-loaded rank with a free slot (exactly
   ``slots_per_rank`` each), preferring ranks that do not already hold that expert. Greedy longest-first
   packing: not optimal, but within 4/3 of it and cheap.
3. **Hierarchical** (``num_nodes > 1`` and ``num_groups % num_nodes == 0``): the ``num_groups`` contiguous
   expert groups are first packed onto nodes by group load, then steps 1-2 run inside each node on its ranks.
   All replicas of a group stay on one node, so group-limited routing keeps its traffic inside a node.

Why pure: this module is stdlib only, does no I/O and breaks every tie by index. Every rank of an
expert-parallel engine all-reduces the same load counters and then computes the *same* placement on its own;
no rank has to broadcast the plan, and the policy can be unit-tested and simulated without devices.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Which logical expert sits in each physical expert slot, per MoE layer. Physical slots are numbered
    rank-major: rank r owns slots [r * slots_per_rank, (r + 1) * slots_per_rank)."""

    phy_to_log: tuple[tuple[int, ...], ...]  # [num_layers][num_physical]
    num_ranks: int
    num_logical: int

    def __post_init__(self) -> None:
        if not self.phy_to_log or self.num_ranks < 1 or self.num_logical < 1:
            raise ValueError("Placement needs >= 1 layer, num_ranks >= 1 and num_logical >= 1")
        n = len(self.phy_to_log[0])
        if n % self.num_ranks or n < self.num_ranks:
            raise ValueError(f"{n} physical slots do not split evenly over {self.num_ranks} ranks")
        for row in self.phy_to_log:
            if len(row) != n or set(row) != set(range(self.num_logical)):
                raise ValueError(f"every layer needs {n} slots holding each of {self.num_logical} experts")

    @property
    def num_layers(self) -> int:
        return len(self.phy_to_log)

    @property
    def num_physical(self) -> int:
        return len(self.phy_to_log[0])

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def replicas(self, layer: int) -> tuple[tuple[int, ...], ...]:
        """For each logical expert, the physical slots holding it, ascending."""
        slots: list[list[int]] = [[] for _ in range(self.num_logical)]
        for slot, expert in enumerate(self.phy_to_log[layer]):
            slots[expert].append(slot)
        return tuple(tuple(s) for s in slots)

    def local_logical(self, layer: int, rank: int) -> tuple[int, ...]:
        """The logical expert in each of ``rank``'s slots, in slot order."""
        start = rank * self.slots_per_rank
        return self.phy_to_log[layer][start : start + self.slots_per_rank]

    def rank_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_rank


def _check_sizes(num_logical: int, num_ranks: int, num_redundant: int) -> int:
    """Slots per rank, or ValueError saying what to change."""
    if num_logical < 1 or num_ranks < 1:
        raise ValueError(f"need >= 1 expert and >= 1 rank, got {num_logical} experts and {num_ranks} ranks")
    if num_redundant < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant}")
    num_physical = num_logical + num_redundant
    if num_physical % num_ranks or num_physical < num_ranks:
        raise ValueError(
            f"{num_logical} experts + {num_redundant} redundant = {num_physical} slots must split evenly "
            f"over {num_ranks} ranks with >= 1 each: choose num_redundant_experts so that "
            f"(experts + redundant) is a multiple of {num_ranks}"
        )
    return num_physical // num_ranks


def initial_placement(num_layers: int, num_logical: int, num_ranks: int, num_redundant: int = 0) -> Placement:
    """Before any load is known: slot i holds logical expert i % num_logical (so with no redundancy rank r
    holds the contiguous block of experts r*E/N ..; redundant slots replicate experts 0..R-1)."""
    _check_sizes(num_logical, num_ranks, num_redundant)
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    row = tuple(i % num_logical for i in range(num_logical + num_redundant))
    return Placement((row,) * num_layers, num_ranks, num_logical)


def _replicate(load: Sequence[float], num_slots: int, max_replicas: int) -> list[int]:
    """Replica count per expert: the extra slots go one by one to the highest load / count."""
    counts = [1] * len(load)
    heap = [(-w, 1, e) for e, w in enumerate(load) if max_replicas > 1]
    heapq.heapify(heap)
    for _ in range(num_slots - len(load)):
        if not heap:  # every expert is on every rank already: extra replicas cannot be avoided
            heap = [(-load[e] / counts[e], counts[e], e) for e in range(len(load))]
            heapq.heapify(heap)
            max_replicas = num_slots
        _, _, e = heapq.heappop(heap)
        counts[e] += 1
        if counts[e] < max_replicas:
            heapq.heappush(heap, (-load[e] / counts[e], counts[e], e))
    return counts


def _pack(weights: Sequence[float], keys: Sequence[int], num_bins: int, capacity: int) -> list[int]:
    """Bin of each item: heaviest first onto the lightest bin with room, avoiding bins that already hold an
    item with the same key when one without it has room. Ties by index."""
    bin_load = [0.0] * num_bins
    bin_count = [0] * num_bins
    held: list[set[int]] = [set() for _ in range(num_bins)]
    bin_of = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        free = [b for b in range(num_bins) if bin_count[b] < capacity]
        fresh = [b for b in free if keys[i] not in held[b]] or free
        b = min(fresh, key=lambda b: (bin_load[b], b))
        bin_of[i] = b
        bin_load[b] += weights[i]
        bin_count[b] += 1
        held[b].add(keys[i])
    return bin_of


def _place_flat(load: Sequence[float], num_ranks: int, num_slots: int) -> list[int]:
    """Replicate then pack over ``num_ranks`` ranks; slot -> index into ``load``; within a rank by index."""
    counts = _replicate(load, num_slots, max_replicas=num_ranks)
    keys = [e for e, c in enumerate(counts) for _ in range(c)]
    weights = [load[e] / counts[e] for e in keys]
    rank_of = _pack(weights, keys, num_ranks, num_slots // num_ranks)
    return [e for r in range(num_ranks) for e, re in zip(keys, rank_of) if re == r]


def _place_hierarchical(
    load: Sequence[float], num_ranks: int, num_slots: int, num_groups: int, num_nodes: int
) -> list[int]:
    """Groups onto nodes by group load, then replicate and pack inside each node."""
    size = len(load) // num_groups
    group_load = [sum(load[g * size : (g + 1) * size]) for g in range(num_groups)]
    node_of = _pack(group_load, range(num_groups), num_nodes, num_groups // num_nodes)
    row: list[int] = []
    for node in range(num_nodes):
        experts = [
            e for g in range(num_groups) if node_of[g] == node for e in range(g * size, (g + 1) * size)
        ]
        local = _place_flat([load[e] for e in experts], num_ranks // num_nodes, num_slots // num_nodes)
        row += [experts[i] for i in local]
    return row


def rebalance(
    load: Sequence[Sequence[float]],
    num_ranks: int,
    num_redundant: int,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> Placement:
    """A load-balanced placement from ``load[layer][logical expert]`` (tokens routed to it over the window):
    replicate the hottest experts into the ``num_redundant`` extra slots, then pack replicas onto ranks;
    hierarchical over nodes when ``num_nodes > 1`` and ``num_groups % num_nodes == 0`` (see module doc).
    Every logical expert keeps >= 1 replica; every rank gets exactly ``slots_per_rank`` slots."""
    if not load or not load[0]:
        raise ValueError("load needs >= 1 layer and >= 1 expert")
    num_logical = len(load[0])
    num_slots = _check_sizes(num_logical, num_ranks, num_redundant) * num_ranks
    if num_groups < 1 or num_nodes < 1:
        raise ValueError(f"num_groups and num_nodes must be >= 1, got {num_groups} and {num_nodes}")
    hierarchical = num_nodes > 1 and num_groups % num_nodes == 0
    if hierarchical and (num_ranks % num_nodes or num_logical % num_groups):
        raise ValueError(
            f"hierarchical EPLB needs num_ranks ({num_ranks}) divisible by num_nodes ({num_nodes}) and "
            f"experts ({num_logical}) divisible by num_groups ({num_groups})"
        )
    rows = []
    for layer, row in enumerate(load):
        if len(row) != num_logical or any(not w >= 0 for w in row):  # `not >=` also catches NaN
            raise ValueError(f"load[{layer}] must hold {num_logical} non-negative numbers")
        if hierarchical:
            rows.append(tuple(_place_hierarchical(row, num_ranks, num_slots, num_groups, num_nodes)))
        else:
            rows.append(tuple(_place_flat(row, num_ranks, num_slots)))
    return Placement(tuple(rows), num_ranks, num_logical)


def rank_loads(placement: Placement, layer: int, load_per_physical: Sequence[float]) -> list[float]:
    """Tokens per rank given tokens per physical slot."""
    if len(load_per_physical) != placement.num_physical:
        raise ValueError(f"need {placement.num_physical} per-slot loads, got {len(load_per_physical)}")
    spr = placement.slots_per_rank
    return [float(sum(load_per_physical[r * spr : (r + 1) * spr])) for r in range(placement.num_ranks)]


def balancedness(rank_load: Sequence[float]) -> float:
    """mean / max of tokens per rank (1.0 = perfect; 1.0 when there is no load at all)."""
    peak = max(rank_load, default=0.0)
    return 1.0 if peak <= 0 else sum(rank_load) / len(rank_load) / peak


def expected_physical_load(placement: Placement, layer: int, load: Sequence[float]) -> list[float]:
    """Each logical expert's load split evenly over its replicas -> per physical slot (to predict balancedness)."""
    if len(load) != placement.num_logical:
        raise ValueError(f"need {placement.num_logical} per-expert loads, got {len(load)}")
    row = placement.phy_to_log[layer]
    counts = [0] * placement.num_logical
    for e in row:
        counts[e] += 1
    return [load[e] / counts[e] for e in row]
