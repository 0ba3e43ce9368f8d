"""Incremental detokenization equals the full decode, and never emits half a character."""

from __future__ import annotations

import random

import pytest

from xengine.api.text.detokenizer import IncrementalDetokenizer
from xengine.api.text.tokenizer import Tokenizer


def _stream(tok: Tokenizer, ids: list[int], rng: random.Random, skip: bool = True, prompt=None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3)
        deltas.append(detok.add(ids[i : i + k]))
        i += k
    deltas.append(detok.flush())
    return deltas


def test_multibyte_char_is_held_until_complete(tok: Tokenizer, byte_token_ids) -> None:
    byte_tokens = byte_token_ids("a😀b".encode())
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([t]) for t in byte_tokens]
    assert deltas == ["a", "", "", "", "😀", "b"]
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_concat_equals_decode(tok: Tokenizer, byte_token_ids, skip: bool) -> None:
    rng = random.Random(1234)
    byte_ids = byte_token_ids(bytes(range(128, 256)))
    special = tok.all_special_ids
    for _ in range(300):
        length = rng.randrange(0, 24)
        ids = [
            rng.choice((rng.randrange(tok.vocab_size), rng.choice(byte_ids), rng.choice(special)))
            for _ in range(length)
        ]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        deltas = _stream(tok, ids, rng, skip=skip, prompt=prompt or None)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        # a delta never ends in the middle of a character unless the bytes really are invalid
        assert all(
            not d.endswith("\ufffd") or "\ufffd" in tok.decode(ids, skip_special_tokens=skip) for d in deltas
        )


def test_real_text_streams_exactly(tok: Tokenizer) -> None:
    text = "Grüße aus München! 你好，世界。 Emoji 😀🚀 done.\n"
    ids = tok.encode(text)
    deltas = _stream(tok, ids, random.Random(0), prompt=tok.encode("prompt: "))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("hi") + [tok.eos_token_id]
    assert "".join(_stream(tok, ids, random.Random(0))) == "hi"
    assert "".join(_stream(tok, ids, random.Random(0), skip=False)) == "hi<|im_end|>"


def _wordpiece_tokenizer() -> Tokenizer:
    """A real WordPiece tokenizer (BERT-style decoder, which joins tokens with spaces)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[A]": 1, "[B]": 2, "hello": 3, "world": 4, "##s": 5}
    backend = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(["[A]", "[B]"])
    return Tokenizer(backend)


def test_spaces_between_special_tokens() -> None:
    tok = _wordpiece_tokenizer()
    a, b, hello, world, s = 1, 2, 3, 4, 5
    ids = [hello, a, b, a, world, s]
    assert tok.decode(ids, skip_special_tokens=False) == "hello [A] [B] [A] worlds"

    def stream(spaces: bool) -> str:
        detok = IncrementalDetokenizer(
            tok, [hello], skip_special_tokens=False, spaces_between_special_tokens=spaces
        )
        return "".join(detok.add([t]) for t in ids) + detok.flush()

    assert stream(True) == " hello [A] [B] [A] worlds"
    # without: no space between consecutive added tokens (vLLM's rule for fast tokenizers)
    assert stream(False) == " hello [A][B][A] worlds"
    # skipping special tokens makes the option moot
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True, spaces_between_special_tokens=False)
    assert detok.add(ids) + detok.flush() == "hello worlds"
