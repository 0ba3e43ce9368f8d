"""A deterministic local text corpus for training the test tokenizers.

Built only from text present on every machine with Python (the stdlib's own source files)
plus a few English paragraphs and non-ASCII lines written here, so that byte-level merges for
multi-byte characters (accents, CJK, emoji) exist in the vocabulary.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

_ENGLISH = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "Large language models predict the next token given the previous ones. Serving them fast means batching "
    "many requests together and keeping their key and value caches in paged memory.",
    "Once upon a time there was a small village by the sea. Every morning the fishermen went out on their "
    "boats, and every evening they came back with stories about the weather and the waves.",
    "Hello! How are you today? I am fine, thank you. What would you like to talk about?",
    "You are a helpful assistant. Answer the question briefly and accurately.",
    "The capital of France is Paris. The capital of Japan is Tokyo. The capital of Italy is Rome.",
    "One, two, three, four, five, six, seven, eight, nine, ten. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024.",
    "Science is a way of thinking much more than it is a body of knowledge. Questions lead to experiments, "
    "experiments lead to data, and data lead to better questions.",
]

_NON_ASCII = [
    "Café, naïve, résumé, façade, jalapeño, über, Straße, smørrebrød, crème brûlée, déjà vu.",
    "¿Dónde está la biblioteca? Ça va très bien, merci. Grüße aus München! Äpfel, Öl, Übung.",
    "Привет, как дела? Спасибо, хорошо. Ελληνικά: καλημέρα κόσμε. עברית: שלום עולם.",
    "你好，世界！今天天气很好。我们一起去公园散步吧。机器学习和自然语言处理。",
    "こんにちは、世界。日本語のテキストです。ありがとうございます。東京は大きな都市です。",
    "안녕하세요, 세계! 한국어 문장입니다. 감사합니다.",
    "Emoji: 😀 😃 😄 😁 😆 🙂 🚀 🌍 🎉 ❤️ 👍 🐍 🔥 ✨ 🤖 🍕 ☕ 🌸 👋🏽 👨‍👩‍👧",
    "Math and symbols: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ → ← ↑ ↓ € £ ¥ © ® ™ ° ± × ÷ µ Ω π λ α β γ δ.",
]


def _stdlib_paths() -> list[Path]:
    """Stdlib ``*.py`` files (installed third-party packages excluded), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""


def iter_corpus(max_chars: int, seed: int = 0) -> Iterator[str]:
    """Yield documents totalling about ``max_chars`` characters, deterministic given ``seed``.

    The hand-written English and non-ASCII paragraphs are repeated so that their merges win
    against the (much larger) code portion.
    """
    rng = random.Random(seed)
    paths = _stdlib_paths()
    rng.shuffle(paths)
    handwritten = (_ENGLISH + _NON_ASCII) * 20
    rng.shuffle(handwritten)
    total = 0
    for text in handwritten:
        total += len(text)
        yield text
    for path in paths:
        if total >= max_chars:
            return
        text = _read(path)[: max_chars - total]
        total += len(text)
        yield text
