"""The runtime monitor's decode reservations (xservice/cluster/monitor.py) as dynamic PD sees them."""

from __future__ import annotations

from xservice.cluster.monitor import RuntimeMonitor
from xservice.policies.dynamic_pd import DECODE


def test_a_placed_stream_counts_before_its_first_token_and_at_its_full_size() -> None:
    mon = RuntimeMonitor()
    mon.get("d0").capacity_tokens = 1000
    mon.reserve_decode("d0", "r1", context_tokens=33, reserve_tokens=160)
    snap = mon.snapshot("d0", DECODE, DECODE, None, now=0.0)
    # placed, not streaming yet: already in the batch the next placement predicts
    assert (snap.num_decoding, snap.decode_tokens, snap.reserved_tokens) == (1, 33, 160)
    mon.decode_started("d0", "r1", 33)
    mon.decode_tokens("d0", "r1", 10, tpot_slo_s=1.0, now=1.0)
    snap = mon.snapshot("d0", DECODE, DECODE, None, now=1.0)
    assert (snap.num_decoding, snap.decode_tokens, snap.reserved_tokens) == (1, 43, 160)
    # a stream nobody reserved (e.g. a migrated decode) counts at its context
    mon.decode_started("d0", "r2", 50)
    assert mon.snapshot("d0", DECODE, DECODE, None, now=1.0).reserved_tokens == 210
    mon.decode_done("d0", "r1")
    mon.release_decode("r1")
    snap = mon.snapshot("d0", DECODE, DECODE, None, now=2.0)
    assert (snap.num_decoding, snap.reserved_tokens) == (1, 50)
    assert mon.view("d0", 2.0)["capacity_tokens"] == 1000


def test_release_drops_the_reservation_wherever_it_is() -> None:
    mon = RuntimeMonitor()
    mon.reserve_decode("d0", "r1", 33, 160)
    mon.reserve_decode("d1", "r1", 33, 160)  # re-placed after d0 failed the import
    mon.release_decode("r1")
    for name in ("d0", "d1"):
        snap = mon.snapshot(name, DECODE, DECODE, None, now=0.0)
        assert (snap.num_decoding, snap.reserved_tokens) == (0, 0)
