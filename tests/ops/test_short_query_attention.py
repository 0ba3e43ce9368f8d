"""Short queries on the decode-attention kernel (``ops/cpu_kernels/attention.py``, ``SHORT_QUERY``): a
sequence computing a few tokens in a step (a speculative step's last token and drafts, a short prompt
chunk) runs the kernel a row per token, each row seeing the KV up to its own position. The result
equals the torch reference's causal attention, with and without a sliding window, beside decodes and
beside a long chunk that still runs the reference."""

from __future__ import annotations

import pytest
import torch

from ops.attention import build_attention_metadata
from ops.cpu_kernels import attention as kernel_attention
from ops.cpu_kernels.build import kernel_library, unavailable_reason
from ops.torch_ref.attention import attention as torch_ref_attention

pytestmark = pytest.mark.skipif(
    kernel_library("decode_attention") is None,
    reason=f"CPU kernels unavailable: {unavailable_reason('decode_attention')}",
)


def _step(query_lens: list[int], seq_lens: list[int], window: int | None, seed: int):
    gen = torch.Generator().manual_seed(seed)
    block_size, num_kv_heads, head_dim, num_heads = 16, 2, 32, 4
    tables, next_block = [], 0
    for n in seq_lens:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    cache = torch.randn(2, next_block, block_size, num_kv_heads, head_dim, generator=gen)
    total = sum(query_lens)
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k, v = (torch.randn(total, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    ref_cache = cache.clone()
    ref = torch_ref_attention(
        q, k, v, ref_cache, build_attention_metadata(query_lens, seq_lens, tables, block_size), 0.2, window
    )
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    return q, k, v, cache, meta, ref, ref_cache


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        ([5, 5, 3, 1], [40, 5, 17, 30]),  # a verification step: last token + drafts, a decode
        ([16, 2, 1], [16, 50, 9]),  # a whole short prompt, the longest short query
    ],
)
def test_short_queries_run_the_kernel_and_match_the_reference(monkeypatch, window, query_lens, seq_lens):
    q, k, v, cache, meta, ref, ref_cache = _step(query_lens, seq_lens, window, seed=len(seq_lens))

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(kernel_attention, "reference_attention", refuse)
    monkeypatch.setattr(kernel_attention.ref, "_prefill", refuse)
    out = kernel_attention.decode_attention(q, k, v, cache, meta, 0.2, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache, ref_cache)


def test_a_long_chunk_beside_short_queries_runs_the_reference() -> None:
    query_lens, seq_lens = [4, 17, 1], [20, 40, 8]  # 17 > SHORT_QUERY
    assert query_lens[1] > kernel_attention.SHORT_QUERY >= query_lens[0]
    q, k, v, cache, meta, ref, _ = _step(query_lens, seq_lens, None, seed=9)
    out = kernel_attention.decode_attention(q, k, v, cache, meta, 0.2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
