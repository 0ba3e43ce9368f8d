"""Stop strings: split across deltas, overlapping candidates, inclusion, and no leaks."""

from __future__ import annotations

import random

import pytest

from xengine.api.text.stop import StopStringMatcher


def _run(stop: list[str], deltas: list[str], include: bool = False) -> tuple[str, str | None]:
    m = StopStringMatcher(stop, include_stop_str_in_output=include)
    out = []
    for d in deltas:
        emit, matched = m.feed(d)
        out.append(emit)
        if matched is not None:
            return "".join(out), matched
    out.append(m.flush())
    return "".join(out), None


def test_no_stop_strings_passes_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", None)
    assert m.flush() == ""


def test_split_across_deltas_and_holdback() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello S") == ("hello ", None)
    assert m.feed("TO") == ("", None)
    assert m.feed("P and more") == ("", "STOP")
    assert m.feed("after") == ("", None)
    assert m.flush() == ""


def test_false_start_is_released() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ("", None)
    assert m.feed("ep") == ("STep", None)
    assert m.feed("STO") == ("", None)
    assert m.flush() == "STO"


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(include: bool) -> None:
    text, matched = _run(["</s>"], ["ab</", "s>cd"], include=include)
    assert matched == "</s>"
    assert text == ("ab</s>" if include else "ab")


def test_overlapping_candidates_first_to_complete_wins() -> None:
    # "bc" completes (at 'c') before "abcd" does
    assert _run(["abcd", "bc"], ["xabcd"]) == ("xa", "bc")
    assert _run(["abcd", "bc"], ["xa", "b", "c", "d"]) == ("xa", "bc")
    # same end: the longer one (earlier start) wins
    assert _run(["abc", "bc"], ["xabc"]) == ("x", "abc")
    # a suffix that is a prefix of one stop string but not of another
    assert _run(["aab"], ["a", "a", "a", "b"]) == ("a", "aab")


def test_never_leaks_random() -> None:
    rng = random.Random(7)
    alphabet = "abc "
    for _ in range(500):
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        deltas, i = [], 0
        while i < len(text):
            k = rng.randint(1, 4)
            deltas.append(text[i : i + k])
            i += k
        out, matched = _run(stops, deltas)
        # reference: scan one character at a time for the first stop string to complete
        ref_end = next((j for j in range(1, len(text) + 1) if any(text[:j].endswith(s) for s in stops)), None)
        if ref_end is None:
            assert (out, matched) == (text, None)
        else:
            done = [s for s in stops if text[:ref_end].endswith(s)]
            stop = max(done, key=len)
            assert matched == stop and out == text[: ref_end - len(stop)]
            assert not any(s in out for s in stops)
