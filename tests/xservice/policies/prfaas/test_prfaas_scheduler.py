"""The bandwidth-aware scheduler (``xservice/policies/prfaas/scheduler.py``) fed with link samples."""

from __future__ import annotations

import math

import pytest

from xservice.policies.prfaas import BandwidthAwareScheduler, LinkSample, LogNormalLengths, prefill_curve
from xservice.policies.prfaas.model import Stages
from xservice.policies.prfaas.profiles import DecodeRate

CURVE = prefill_curve(
    {"name": "c", "prefill": {"tokens": [1000, 100000], "seconds": [0.5, 50.0], "kv_bytes": [1e8, 1e10]}}
)
LENGTHS = LogNormalLengths(math.log(8000), 1.0, 100, 100000)


def _feed(
    s: BandwidthAwareScheduler, t0: float, secs: int, gbps: float, cap: float, queued: float = 0.0, busy=None
):
    sent = s._last.sent_bytes if s._last else 0.0
    out = None
    for k in range(secs):
        sent += gbps * 1e9 / 8
        out = s.observe(LinkSample(t0 + k + 1, sent, queued, cap, busy))
    return out


def test_near_the_ceiling_the_threshold_rises_and_comes_back() -> None:
    s = BandwidthAwareScheduler(10000, CURVE, LENGTHS, smoothing_s=1.0, cooldown_s=2.0)
    d = _feed(s, 0, 10, gbps=5.0, cap=10.0)
    assert d.threshold == 10000 and not d.bandwidth_scarce  # 50%: hold, bandwidth abundant
    d = _feed(s, 10, 6, gbps=9.5, cap=10.0)  # 95% of the link
    assert d.threshold > 10000 and s.threshold > 10000
    raised = s.threshold
    # the egress would fall to about the target share at the new threshold
    assert s._load(raised, LENGTHS) < s._load(10000, LENGTHS)
    d = _feed(s, 16, 20, gbps=2.0, cap=10.0)  # the link idles: back toward the plan, never below it
    assert 10000 <= s.threshold < raised


def test_a_backlog_raises_it_too_but_not_when_local_prefill_is_full() -> None:
    s = BandwidthAwareScheduler(10000, CURVE, LENGTHS, smoothing_s=1.0)
    d = _feed(s, 0, 3, gbps=6.0, cap=10.0, queued=10e9, busy=0.95)  # 8 s of backlog, locals saturated
    assert d.threshold == 10000 and d.queue_s == pytest.approx(8.0)
    d = _feed(s, 3, 6, gbps=6.0, cap=10.0, queued=10e9, busy=0.5)
    assert d.threshold > 10000 and d.reason in ("raise", "hold")


def test_replan_uses_the_measured_lengths_and_link() -> None:
    s = BandwidthAwareScheduler(10000, CURVE, LENGTHS)
    for x in LENGTHS.sample(500, seed=3):
        s.record_length(x)
    stages = Stages(local=prefill_curve({"name": "l", "prefill": {"tokens": [1000, 100000], "seconds": [2.0, 200.0], "kv_bytes": [1e8, 1e10]}}),
                    decode=DecodeRate(64, 0.05), prfaas=CURVE, bandwidth_gbps=100.0)  # fmt: skip
    wide = s.replan(stages, 256, 2, 6)
    s.observe(LinkSample(1.0, 0.0, 0.0, 1.0))  # the link is 1 Gbit/s now
    narrow = s.replan(stages, 256, 2, 6, prefill=wide.deployment.prefill)
    assert narrow.deployment.threshold > wide.deployment.threshold  # fewer, longer offloads
    assert s.planned == s.threshold == narrow.deployment.threshold
    with pytest.raises(ValueError, match="0 < low"):
        BandwidthAwareScheduler(1, CURVE, LENGTHS, low=0.9, target=0.5)


def test_it_never_sticks_past_the_longest_length() -> None:
    lengths = LogNormalLengths(math.log(2000), 0.5, 100, 5000)
    s = BandwidthAwareScheduler(4096, CURVE, lengths, smoothing_s=1.0, cooldown_s=1.0)
    d = _feed(s, 0, 4, gbps=9.9, cap=10.0)  # saturated: raised, at most to the longest length
    assert 4096 < d.threshold <= 5000
    d = _feed(s, 4, 30, gbps=0.0, cap=10.0)  # idle (nothing offloaded above it): back to the plan
    assert d.threshold == pytest.approx(4096)
    zero = BandwidthAwareScheduler(0, CURVE, lengths, smoothing_s=1.0)
    assert _feed(zero, 0, 3, gbps=0.0, cap=10.0, queued=1e11).threshold > 0  # 0 can rise too
