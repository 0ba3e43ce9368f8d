"""``max_token_chars``: a text of more than ``n * max_token_chars`` characters has more than ``n`` tokens.

Where a tokenizer can drop or swallow characters no bound is given; those cases show why.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from xengine.api.text.length_bound import max_token_chars

# Characters of 1 to 4 UTF-8 bytes, whitespace runs and symbols the small vocabularies lack.
ALPHABET = ["a", "b", "c", " ", "  ", "\n", "\t", "é", "ß", "中", "文", "😀", "🚀", "-", "=", "\u0301", "x y"]


def random_texts(num: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = ["", "a", " " * 500, "😀" * 300, "=" * 1000, "ab" * 400, "\u0301" * 50]
    for _ in range(num):
        texts.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 400))))
    return texts


def assert_sound(backend: Tokenizer, bound: int) -> None:
    for text in random_texts(200):
        num_tokens = len(backend.encode(text, add_special_tokens=False).ids)
        assert len(text) <= num_tokens * bound, (text[:40], num_tokens, bound)


def metaspace_bpe(**model_kw) -> Tokenizer:
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "▁a": 4, "ab": 5, "▁ab": 6}
    if model_kw.get("byte_fallback"):
        vocab.update({f"<0x{b:02X}>": len(vocab) for b in range(256)})
    merges = [("▁", "a"), ("a", "b"), ("▁a", "b")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, **model_kw))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    return tok


def test_byte_level_bpe_of_the_tiny_model(tok) -> None:
    bound = tok.max_token_chars
    assert bound == max(len(t) for t in tok._tok.get_vocab(with_added_tokens=True))
    assert_sound(tok._tok, bound)
    special = tok.apply_chat_template([{"role": "user", "content": "hi"}])  # added tokens count too
    assert len(special) <= len(tok.encode(special, add_special_tokens=False)) * bound


def test_sentencepiece_style_bpe_with_byte_fallback() -> None:
    backend = metaspace_bpe(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    bound = max_token_chars(backend)
    assert bound == len("<0x00>")
    assert_sound(backend, bound)


def test_unfused_unknown_token_covers_one_character() -> None:
    backend = metaspace_bpe(unk_token="<unk>", fuse_unk=False)
    bound = max_token_chars(backend)
    assert bound is not None
    assert_sound(backend, bound)


def test_fused_unknown_token_swallows_any_run() -> None:
    backend = metaspace_bpe(unk_token="<unk>", fuse_unk=True)
    assert len(backend.encode("😀" * 1000).ids) <= 2  # why no bound can hold
    assert max_token_chars(backend) is None


def test_no_unknown_token_drops_characters() -> None:
    backend = metaspace_bpe()
    assert backend.encode("😀" * 1000).ids == [1]
    assert max_token_chars(backend) is None


def test_whitespace_dropping_pre_tokenizer() -> None:
    backend = metaspace_bpe(unk_token="<unk>", fuse_unk=False)
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    assert len(backend.encode("a" + " " * 1000 + "b").ids) == 2
    assert max_token_chars(backend) is None


@pytest.mark.parametrize(
    "normalizer,bounded",
    [
        (normalizers.NFC(), False),  # composition shrinks text
        (normalizers.Strip(), False),
        (normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), True),
        (normalizers.Replace("ab", "a"), False),
        (normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()]), True),
    ],
)
def test_normalizers_that_shrink_text_give_no_bound(normalizer, bounded: bool) -> None:
    backend = metaspace_bpe(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    backend.normalizer = normalizer
    bound = max_token_chars(backend)
    assert (bound is not None) == bounded
    if bounded:
        assert_sound(backend, bound)


def test_added_token_that_strips_whitespace() -> None:
    backend = metaspace_bpe(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert len(backend.encode(" " * 1000 + "<mask>").ids) == 1
    assert max_token_chars(backend) is None


def test_truncation_and_other_models_give_no_bound(tok) -> None:
    backend = Tokenizer.from_str(tok._tok.to_str())
    backend.enable_truncation(16)
    assert max_token_chars(backend) is None
    word_piece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert max_token_chars(word_piece) is None
