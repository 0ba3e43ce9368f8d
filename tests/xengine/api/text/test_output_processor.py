"""RequestOutputState: detokenization, stop strings, n > 1, eos, errors."""

from __future__ import annotations

from xengine.api.messages import CompletionDelta, SamplingParams, TokenLogprob
from xengine.api.text.output_processor import RequestOutputState
from xengine.api.text.tokenizer import Tokenizer


def _delta(ids: list[int], index: int = 0, **kw) -> CompletionDelta:
    return CompletionDelta(req_id="r", index=index, new_token_ids=ids, **kw)


def _feed_one_by_one(state: RequestOutputState, ids: list[int], index: int, finish: str | None = None):
    deltas = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        d = state.process(_delta([t], index, finish_reason=finish if last else None))
        deltas.append(d)
    return deltas


def test_n2_with_stop_string(tok: Tokenizer) -> None:
    params = SamplingParams(n=2, stop=["STOP"], max_tokens=64)
    prompt = tok.encode("prompt")
    state = RequestOutputState("r", tok, params, prompt)
    ids0 = tok.encode("Hello there STOP and more")
    ids1 = tok.encode("Grüße 😀 no stop here S")
    streamed0 = [d for d in _feed_one_by_one(state, ids0, 0) if d is not None]
    assert "".join(d.text for d in streamed0) == "Hello there "
    assert streamed0[-1].finish_reason == "stop" and streamed0[-1].stop_reason == "STOP"
    out0 = state.outputs[0]
    assert out0.text == "Hello there " and out0.finish_reason == "stop" and out0.stop_reason == "STOP"
    # kept up to the token that completed "STOP"; later ones dropped
    assert tok.decode(out0.token_ids).endswith("STOP") and len(out0.token_ids) < len(ids0)
    assert not state.finished and not state.needs_abort  # sequence 1 still running
    streamed1 = _feed_one_by_one(state, ids1, 1, finish="length")
    # the trailing "S" is held back (it could start "STOP") until the finish flushes it
    assert "".join(d.text for d in streamed1) == "Grüße 😀 no stop here S"
    assert state.outputs[1].finish_reason == "length" and state.outputs[1].token_ids == ids1
    # the engine still runs sequence 0 (only this side saw "STOP"), so the caller must abort it
    assert state.finished and state.needs_abort
    assert state.num_prompt_tokens == len(prompt)


def test_needs_abort_when_all_running_sequences_stopped(tok: Tokenizer) -> None:
    state = RequestOutputState("r", tok, SamplingParams(n=2, stop=["."]), tok.encode("p"))
    state.process(_delta(tok.encode("one. two"), 0))
    assert not state.needs_abort
    state.process(_delta(tok.encode("three. four"), 1))
    assert state.finished and state.needs_abort
    assert [o.text for o in state.outputs] == ["one", "three"]
    # deltas for stopped sequences are ignored
    assert state.process(_delta(tok.encode(" more"), 0)) is None
    assert state.outputs[0].text == "one"
    state.process(_delta([], 0, finish_reason="abort"))
    state.process(_delta([], 1, finish_reason="abort"))
    assert not state.needs_abort and state.outputs[0].finish_reason == "stop"


def test_include_stop_str_and_logprob_truncation(tok: Tokenizer) -> None:
    params = SamplingParams(stop=["END"], include_stop_str_in_output=True, logprobs=1)
    state = RequestOutputState("r", tok, params, [])
    ids = tok.encode("abc END xyz")
    lps = [-0.1 * (i + 1) for i in range(len(ids))]
    tops = [[TokenLogprob(t, lp)] for t, lp in zip(ids, lps)]
    d = state.process(_delta(ids, new_logprobs=lps, new_top_logprobs=tops))
    out = state.outputs[0]
    assert d.text == out.text == "abc END"
    n = len(out.token_ids)
    assert (
        n < len(ids)
        and out.logprobs == lps[:n]
        and out.top_logprobs == [[(t, lp)] for t, lp in zip(ids, lps)][:n]
    )


def test_eos_finish_excludes_eos_text(tok: Tokenizer) -> None:
    state = RequestOutputState("r", tok, SamplingParams(skip_special_tokens=False), [])
    ids = tok.encode("bye") + [tok.eos_token_id]
    d = state.process(_delta(ids, finish_reason="stop", stop_reason=tok.eos_token_id))
    out = state.outputs[0]
    assert d.text == out.text == "bye"
    assert out.token_ids == ids and out.finish_reason == "stop" and out.stop_reason == tok.eos_token_id
    assert state.finished and not state.needs_abort


def test_split_multibyte_char_is_held_then_flushed(tok: Tokenizer, byte_token_ids) -> None:
    state = RequestOutputState("r", tok, SamplingParams(stop=["zz"]), [])
    ids = byte_token_ids("é😀".encode())  # 2 + 4 single-byte tokens
    texts = [state.process(_delta([i])).text for i in ids[:4]]
    assert texts == ["", "é", "", ""]
    last = state.process(_delta([], finish_reason="length"))
    assert last.finish_reason == "length" and last.text == "\ufffd"  # the cut emoji, flushed at the end
    assert state.outputs[0].text == tok.decode(ids[:4]) == "é\ufffd"


def test_engine_error_finishes_everything(tok: Tokenizer) -> None:
    state = RequestOutputState("r", tok, SamplingParams(n=2), [1, 2])
    state.process(_delta(tok.encode("partial"), 0, num_prompt_tokens=2, num_cached_tokens=1))
    d = state.process(CompletionDelta(req_id="r", index=0, error="out of memory"))
    assert d is not None and d.finish_reason == "error"
    assert state.error == "out of memory" and state.finished
    assert [o.finish_reason for o in state.outputs] == ["error", "error"]
    assert state.outputs[0].text == "partial" and state.num_cached_tokens == 1
