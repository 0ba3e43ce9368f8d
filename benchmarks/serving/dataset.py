"""Random prompts of an exact token count, built from the model's own tokenizer.

Like vLLM's random dataset: sample random token ids, decode to text, re-encode, and trim (or top up
with more random ids) until the text encodes to exactly ``input_len`` tokens. Prompts go out as text.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from tokenizers import Tokenizer

MAX_ROUNDS = 32


def load_tokenizer(path: str) -> Tokenizer:
    """Load ``tokenizer.json`` from a model folder (or the file itself)."""
    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def normal_token_ids(tok: Tokenizer) -> list[int]:
    """Every vocabulary id that is not a special token."""
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    return sorted(i for s, i in tok.get_vocab(with_added_tokens=True).items() if s not in special)


def random_prompt(tok: Tokenizer, ids_pool: list[int], input_len: int, rng: random.Random) -> str:
    """Text that ``tok`` encodes to exactly ``input_len`` tokens (best effort after MAX_ROUNDS).

    Each round decodes, re-encodes, cuts the ids back (a few more each round, since a cut can
    re-merge into one token too many) and tops them up with fresh random ids.
    """
    ids = [rng.choice(ids_pool) for _ in range(input_len)]
    for round_ in range(MAX_ROUNDS):
        text = tok.decode(ids, skip_special_tokens=True)
        ids = tok.encode(text, add_special_tokens=False).ids
        if len(ids) == input_len:
            return text
        keep = min(len(ids), max(0, input_len - round_ % 8))
        ids = ids[:keep] + [rng.choice(ids_pool) for _ in range(input_len - keep)]
    text = tok.decode(ids, skip_special_tokens=True)
    got = len(tok.encode(text, add_special_tokens=False).ids)
    if got != input_len:
        print(f"warning: prompt encodes to {got} tokens, wanted {input_len}", file=sys.stderr)
    return text


def random_prompts(tokenizer_dir: str | None, num: int, input_len: int, seed: int) -> list[tuple[str, int]]:
    """``num`` (prompt text, prompt token count) pairs.

    Without a tokenizer the prompts are repeated short words, one token each in most BPE vocabularies,
    and the count is the requested length (an estimate).
    """
    rng = random.Random(seed)
    if tokenizer_dir is None:
        words = ["hello", "world", "the", "of", "and", "to", "in", "is"]
        return [(" ".join(rng.choice(words) for _ in range(input_len)), input_len) for _ in range(num)]
    tok = load_tokenizer(tokenizer_dir)
    pool = normal_token_ids(tok)
    out = []
    for _ in range(num):
        text = random_prompt(tok, pool, input_len, rng)
        out.append((text, len(tok.encode(text, add_special_tokens=False).ids)))
    return out
