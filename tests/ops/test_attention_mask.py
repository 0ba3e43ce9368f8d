"""The one causal / sliding-window rule (``ops/attention_mask.py``) against its definition, position by
position: a query at ``p`` sees the keys at ``p - window < k <= p``."""

from __future__ import annotations

import pytest
import torch

from ops.attention_mask import context_start, decode_mask, is_fresh_prefill, prefill_mask


def _sees(q: int, k: int, window: int | None) -> bool:
    return k <= q and (window is None or k > q - window)


@pytest.mark.parametrize("window", [None, 1, 3, 100])
def test_prefill_mask_is_the_rule_over_the_keys_it_keeps(window: int | None) -> None:
    first, seq_len = 5, 9
    start = context_start(first, window)
    mask = prefill_mask(first, seq_len, start, window, torch.device("cpu"))
    assert mask.shape == (seq_len - first, seq_len - start)
    for i, q in enumerate(range(first, seq_len)):
        for j, k in enumerate(range(start, seq_len)):
            assert bool(mask[i, j]) == _sees(q, k, window)
    # the keys dropped before ``start`` are outside every query's window
    assert not any(_sees(q, k, window) for q in range(first, seq_len) for k in range(start))


@pytest.mark.parametrize("window", [None, 2])
def test_decode_mask_is_additive_cached_per_window(window: int | None) -> None:
    last = torch.tensor([[0], [3], [5]])
    cache: dict[int | None, torch.Tensor] = {}
    mask = decode_mask(cache, last, 6, window, torch.device("cpu"))
    assert mask.shape == (3, 1, 1, 6) and mask.dtype == torch.float32
    for b, q in enumerate(last[:, 0].tolist()):
        for k in range(6):
            assert mask[b, 0, 0, k].item() == (0.0 if _sees(q, k, window) else float("-inf"))
    assert decode_mask(cache, last, 6, window, torch.device("cpu")) is mask  # built once per step


def test_fresh_prefill_needs_no_context_and_no_shorter_window() -> None:
    assert is_fresh_prefill(0, 8, None) and is_fresh_prefill(0, 8, 8)
    assert not is_fresh_prefill(0, 8, 7) and not is_fresh_prefill(1, 8, None)
