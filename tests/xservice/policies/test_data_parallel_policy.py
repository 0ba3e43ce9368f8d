"""Which data-parallel rank takes a request: the fewest in flight, ties round-robin from the last pick."""

from __future__ import annotations

from xservice.policies.data_parallel import pick_rank


def test_the_rank_with_the_fewest_requests_in_flight_wins() -> None:
    assert pick_rank([3, 1, 2], last=1) == 1
    assert pick_rank([0, 5], last=0) == 0


def test_a_burst_on_an_idle_instance_spreads_over_every_rank() -> None:
    inflight, last, picks = [0, 0, 0, 0], -1, []
    for _ in range(8):
        last = pick_rank(inflight, last)
        inflight[last] += 1
        picks.append(last)
    assert picks == [0, 1, 2, 3, 0, 1, 2, 3]


def test_ties_rotate_even_when_requests_finish_between_picks() -> None:
    assert [pick_rank([1, 1], last) for last in (-1, 0, 1)] == [0, 1, 0]


def test_a_prompt_start_sticks_to_its_rank_until_that_rank_is_much_busier() -> None:
    assert pick_rank([2, 0], last=1, affinity=0) == 0  # within the slack: its prefix cache wins
    assert pick_rank([3, 0], last=1, affinity=0) == 1  # beyond it: the least loaded
    assert pick_rank([0, 0], last=0, affinity=None) == 1
