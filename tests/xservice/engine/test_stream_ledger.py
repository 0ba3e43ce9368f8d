"""``StreamLedger``: unasked aborts and lost streams are found, requested aborts and normal ends are not."""

from __future__ import annotations

from xengine.api.messages import CompletionDelta
from xservice.engine.stream_ledger import UNASKED_ABORT, StreamLedger


def _d(req_id: str, finish: str | None = None, index: int = 0) -> CompletionDelta:
    return CompletionDelta(req_id=req_id, index=index, new_token_ids=[1], finish_reason=finish)


def test_an_abort_nobody_asked_for_is_a_failure() -> None:
    ledger = StreamLedger()
    ledger.opened("a", 1)
    assert ledger.on_delta(_d("a")) is None
    assert ledger.on_delta(_d("a", "abort")) == UNASKED_ABORT
    assert len(ledger) == 0


def test_a_requested_abort_and_a_normal_end_are_not() -> None:
    ledger = StreamLedger()
    ledger.opened("a", 1)
    ledger.opened("b", 2)
    ledger.aborting("a")
    assert ledger.on_delta(_d("a", "abort")) is None
    assert ledger.on_delta(_d("b", "length", 0)) is None and len(ledger) == 1  # one of two sequences
    assert ledger.on_delta(_d("b", "stop", 1)) is None and len(ledger) == 0


def test_a_shutdown_the_service_asked_for_expects_its_aborts() -> None:
    ledger = StreamLedger()
    ledger.opened("a", 1)
    ledger.aborting_all()
    assert ledger.on_delta(_d("a", "abort")) is None


def test_the_audit_finds_only_requests_sent_before_it_and_not_running() -> None:
    ledger = StreamLedger()
    ledger.opened("gone", 1)
    ledger.opened("running", 1)
    mark = ledger.mark()
    ledger.opened("after", 1)  # sent after the audit: the engine could not list it yet
    assert ledger.lost(mark, ["running"]) == ["gone"]
    assert ledger.lost(ledger.mark(), ["running", "after"]) == []
    # "gone" left the ledger (reported once); what it still holds is exactly what is still owed
    assert len(ledger) == 2
    assert ledger.lost(ledger.mark(), []) == ["running", "after"]


def test_an_error_finish_ends_every_sequence() -> None:
    ledger = StreamLedger()
    ledger.opened("a", 4)
    assert ledger.on_delta(_d("a", "error")) is None and len(ledger) == 0
