"""MoE facade: routing like HF's Qwen3-MoE router, dispatch/grouped matmul/combine against a naive
per-token loop, and the fused op unchanged inside a compiled graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops import moe

NUM_EXPERTS, HIDDEN, INTER = 16, 24, 12


def _naive_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: float32 softmax, the k largest by a sort, divided by their sum when asked."""
    weights, ids = [], []
    for row in logits:
        probs = torch.softmax(row.float(), dim=-1)
        order = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[:top_k]
        w = probs[order]
        weights.append(w / w.sum() if renormalize else w)
        ids.append(order)
    return torch.stack(weights).to(logits.dtype), torch.tensor(ids)


def _naive_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13, w2) -> torch.Tensor:
    """One token, one expert at a time: ``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))``."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def _inputs(num_tokens: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=g).mul(3).to(dtype)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=g).mul(0.2).to(dtype)
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g).mul(0.2).to(dtype)
    return x, logits, w13, w2


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 4])
def test_route_matches_naive_topk(top_k: int, renormalize: bool) -> None:
    _, logits, _, _ = _inputs(9)
    weights, ids = moe.route(logits, top_k, renormalize)
    ref_w, ref_ids = _naive_route(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    else:
        assert (weights.sum(-1) < 1).all() or top_k == NUM_EXPERTS


def test_route_is_float32_softmax_then_cast() -> None:
    _, logits, _, _ = _inputs(5, torch.bfloat16)
    weights, ids = moe.route(logits, 2, True)
    assert weights.dtype == torch.bfloat16
    probs = torch.softmax(logits.float(), -1)
    top, ref_ids = probs.topk(2, dim=-1)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(weights, (top / top.sum(-1, keepdim=True)).to(torch.bfloat16))


def test_dispatch_groups_rows_by_expert_and_combine_inverts_it() -> None:
    x, logits, _, _ = _inputs(11)
    weights, ids = moe.route(logits, 3, True)
    d = moe.dispatch(x, ids, NUM_EXPERTS)
    assert sum(d.tokens_per_expert) == 11 * 3 and len(d.tokens_per_expert) == NUM_EXPERTS
    row_experts = ids.reshape(-1)[d.order]
    assert torch.equal(row_experts, torch.sort(ids.reshape(-1)).values)  # grouped, ascending
    assert torch.equal(
        row_experts, torch.repeat_interleave(torch.arange(NUM_EXPERTS), torch.tensor(d.tokens_per_expert))
    )
    assert torch.equal(d.hidden, x[d.order // 3])
    # combine of the unchanged rows: each token back, scaled by its weights summed (1 after renormalising)
    torch.testing.assert_close(moe.combine(d.hidden, d, weights), x)


def test_grouped_matmul_is_one_matmul_per_expert() -> None:
    x, logits, w13, _ = _inputs(7)
    _, ids = moe.route(logits, 2, False)
    d = moe.dispatch(x, ids, NUM_EXPERTS)
    out = moe.grouped_matmul(d.hidden, d.tokens_per_expert, w13)
    experts = ids.reshape(-1)[d.order]
    expected = torch.stack([w13[int(e)] @ row for e, row in zip(experts, d.hidden)])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_experts_matches_per_token_loop(num_tokens: int, renormalize: bool) -> None:
    x, logits, w13, w2 = _inputs(num_tokens, seed=num_tokens)
    weights, ids = moe.route(logits, 4, renormalize)
    ref = _naive_experts(x, weights, ids, w13, w2)
    torch.testing.assert_close(moe.fused_experts(x, weights, ids, w13, w2), ref, rtol=1e-5, atol=1e-5)
    # the split steps compose to the same thing (an expert-parallel dispatch/combine slots in between)
    d = moe.dispatch(x, ids, NUM_EXPERTS)
    split = moe.combine(moe.expert_swiglu(d.hidden, d.tokens_per_expert, w13, w2), d, weights)
    torch.testing.assert_close(split, ref, rtol=1e-5, atol=1e-5)


def test_fused_experts_with_unused_experts_and_no_tokens() -> None:
    x, _, w13, w2 = _inputs(6)
    ids = torch.tensor([[3, 5]] * 6)  # 14 of 16 experts get no rows
    weights = torch.full((6, 2), 0.5)
    out = moe.fused_experts(x, weights, ids, w13, w2)
    torch.testing.assert_close(out, _naive_experts(x, weights, ids, w13, w2), rtol=1e-5, atol=1e-5)
    empty = moe.fused_experts(x[:0], weights[:0], ids[:0], w13, w2)
    assert empty.shape == (0, HIDDEN)


def test_fused_experts_in_a_compiled_graph() -> None:
    """Under ``torch.compile(fullgraph=True)`` the data-dependent expert loop is one opaque op."""
    x, logits, w13, w2 = _inputs(8)

    def layer(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights, ids = moe.route(logits, 4, True)
        return moe.fused_experts(x * 2, weights, ids, w13, w2) + 1

    compiled = torch.compile(layer, backend="eager", fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x, logits), layer(x, logits))


def _hf_router(kind: str, **kw):
    """HF ``transformers``' own router module (the oracle), weights seeded."""
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, **kw))
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        router = DeepseekV3TopkRouter(
            DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=NUM_EXPERTS, **kw)
        )
        router.e_score_correction_bias.copy_(
            torch.randn(NUM_EXPERTS, generator=torch.Generator().manual_seed(5)) * 0.1
        )
    with torch.no_grad():
        router.weight.copy_(
            torch.randn(NUM_EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(6)) * 0.3
        )
    return router


@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_hf_qwen3_moe_router(norm: bool) -> None:
    router = _hf_router("qwen3_moe", num_experts_per_tok=4, norm_topk_prob=norm)
    x, _, _, _ = _inputs(13)
    logits, ref_w, ref_ids = router(x)
    weights, ids = moe.route(logits, 4, norm)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)


@pytest.mark.parametrize(("groups", "topk_groups", "norm"), [(4, 2, True), (8, 3, False), (1, 1, True)])
def test_route_grouped_matches_hf_deepseek_v3_router(groups: int, topk_groups: int, norm: bool) -> None:
    kw = dict(num_experts_per_tok=4, n_group=groups, topk_group=topk_groups, norm_topk_prob=norm)
    router = _hf_router("deepseek_v3", routed_scaling_factor=2.5, **kw)
    x, _, _, _ = _inputs(17, seed=2)
    logits, ref_w, ref_ids = router(x)
    bias = router.e_score_correction_bias
    weights, ids = moe.route_grouped(logits, 4, groups, topk_groups, bias, norm, 2.5)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w) and weights.dtype == torch.float32
    # the choice is bias-corrected and confined to the chosen groups; the weights are not biased
    per_group = NUM_EXPERTS // groups
    for t in range(17):
        assert len({int(e) // per_group for e in ids[t]}) <= topk_groups
    scores = logits.sigmoid().gather(1, ids)
    expected = scores / (scores.sum(-1, keepdim=True) + 1e-20) if norm else scores
    torch.testing.assert_close(weights, expected * 2.5)
