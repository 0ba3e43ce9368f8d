"""Seeded random token-id prompts, shared by every runner of the offline benchmark."""

from __future__ import annotations

import random

from benchmarks.serving.dataset import load_tokenizer, normal_token_ids


def prompt_id_pool(model_dir: str) -> list[int]:
    """The non-special token ids of the model's tokenizer."""
    return normal_token_ids(load_tokenizer(model_dir))


def random_token_prompts(pool: list[int], num: int, input_len: int, seed: int) -> list[list[int]]:
    """``num`` prompts of exactly ``input_len`` random ids drawn from ``pool``."""
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(input_len)] for _ in range(num)]


def shared_prefix_pair(
    pool: list[int], length: int, shared_frac: float, seed: int
) -> tuple[list[int], list[int]]:
    """Two prompts of ``length`` ids whose first ``round(shared_frac * length)`` ids are equal."""
    rng = random.Random(seed)
    first = [rng.choice(pool) for _ in range(length)]
    num_shared = round(shared_frac * length)
    second = first[:num_shared] + [rng.choice(pool) for _ in range(length - num_shared)]
    return first, second
