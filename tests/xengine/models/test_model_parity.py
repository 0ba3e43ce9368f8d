"""Logits parity with HF transformers on the same tiny weights, through paged attention.

Tolerance: max abs logit difference <= 1e-4 in float32, identical greedy argmax.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.xengine.models.helpers import VARIANTS, PagedKV
from xengine.models.loader import load_model

ATOL_FP32 = 1e-4


@pytest.fixture(scope="module")
def models(checkpoint):
    """Factory ``(variant, dtype) -> (ours, hf)``, cached per module."""
    cache = {}

    def _get(name: str, dtype: torch.dtype = torch.float32):
        if (name, dtype) not in cache:
            path = checkpoint(name)
            ours = load_model(str(path), dtype, torch.device("cpu"))
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            cache[(name, dtype)] = (ours, hf)
        return cache[(name, dtype)]

    return _get


def _tokens(lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


@torch.no_grad()
def _step(model, kv: PagedKV, chunks: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
    """Run one step; ``chunks``: (seq_id, new tokens, position of the first). Returns logits per chunk."""
    meta = kv.step([c[0] for c in chunks], [len(c[1]) for c in chunks], [c[2] + len(c[1]) for c in chunks])
    input_ids = torch.tensor([t for c in chunks for t in c[1]], dtype=torch.int64)
    positions = torch.tensor([p for c in chunks for p in range(c[2], c[2] + len(c[1]))], dtype=torch.int64)
    logits = model.compute_logits(model(input_ids, positions, kv.caches, meta))
    assert logits.dtype == torch.float32
    return list(logits.split([len(c[1]) for c in chunks]))


def _new_kv(model, dtype: torch.dtype = torch.float32) -> PagedKV:
    cfg = model.config
    return PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL_FP32, f"max abs logit diff {diff:.2e} > {ATOL_FP32}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_prefill_matches_hf(models, variant: str) -> None:
    ours, hf = models(variant)
    seqs = _tokens([5, 11, 17])
    outs = _step(ours, _new_kv(ours), [(i, toks, 0) for i, toks in enumerate(seqs)])
    for toks, out in zip(seqs, outs):
        _assert_close(out, _hf_logits(hf, toks))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_mixed_with_decode_matches_hf(models, variant: str) -> None:
    ours, hf = models(variant)
    seq_a, seq_b = _tokens([17, 10], seed=2)
    ref_a, ref_b = _hf_logits(hf, seq_a), _hf_logits(hf, seq_b)
    kv = _new_kv(ours)
    out_a, out_b = _step(ours, kv, [(0, seq_a[:7], 0), (1, seq_b[:9], 0)])
    _assert_close(out_a, ref_a[:7])
    _assert_close(out_b, ref_b[:9])
    # decode first, then the second chunk that attends to the cached first chunk
    out_b, out_a = _step(ours, kv, [(1, seq_b[9:], 9), (0, seq_a[7:], 7)])
    _assert_close(out_b, ref_b[9:])
    _assert_close(out_a, ref_a[7:])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_greedy_decode_matches_hf(models, variant: str) -> None:
    ours, hf = models(variant)
    seqs = _tokens([3, 9, 14], seed=3)
    kv = _new_kv(ours)
    outs = _step(ours, kv, [(i, toks, 0) for i, toks in enumerate(seqs)])
    for step in range(6):
        for i, out in enumerate(outs):
            seqs[i].append(int(out[-1].argmax()))
        order = list(range(len(seqs)))[:: -1 if step % 2 else 1]  # batch order changes between steps
        step_outs = _step(ours, kv, [(i, seqs[i][-1:], len(seqs[i]) - 1) for i in order])
        outs = [step_outs[order.index(i)] for i in range(len(seqs))]
        for i, out in enumerate(outs):
            _assert_close(out[-1], _hf_logits(hf, seqs[i])[-1])


@pytest.mark.parametrize("variant", ["qwen3", "llama_llama3"])
def test_bfloat16_loads_and_mostly_agrees(models, variant: str) -> None:
    ours, hf = models(variant, torch.bfloat16)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    seqs = _tokens([6, 13], seed=4)
    kv = _new_kv(ours, torch.bfloat16)
    outs = _step(ours, kv, [(i, toks, 0) for i, toks in enumerate(seqs)])
    agree = total = 0
    for toks, out in zip(seqs, outs):
        ref = _hf_logits(hf, toks)
        assert torch.isfinite(out).all()
        assert (out - ref).abs().max().item() < 0.5
        agree += int((out.argmax(-1) == ref.argmax(-1)).sum())
        total += len(toks)
    assert agree >= 0.8 * total
