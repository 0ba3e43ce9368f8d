"""The gated delta rule (the facade: the C kernel on CPU where it builds, the reference
``ops/torch_ref/gated_delta_rule.py`` elsewhere; the reference's own two forms too) against HF transformers'
torch fallbacks of Qwen3-Next (``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``),
and its exactness across segment cuts with the state carried (what the per-sequence driver relies on)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from ops.gated_delta import gated_delta_rule
from ops.torch_ref import gated_delta_rule as ref_gdn
from ops.torch_ref.gated_delta_rule import (
    MAX_RECURRENT_TOKENS,
    chunked_gated_delta_rule,
    recurrent_gated_delta_rule,
)

ATOL = 2e-5


def _inputs(batch: int, length: int, hk: int, hv: int, dk: int, dv: int, seed: int, decay: float = 2.0):
    """Random q, k, v, g (log decay in ``[-decay, 0]``), beta in (0, 1) and a non-zero start state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, hk, dk, generator=gen)
    k = torch.randn(batch, length, hk, dk, generator=gen)
    v = torch.randn(batch, length, hv, dv, generator=gen)
    g = -torch.rand(batch, length, hv, generator=gen) * decay
    beta = torch.rand(batch, length, hv, generator=gen)
    state = torch.randn(batch, hv, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


def _hf(fn, q, k, v, g, beta, state, **kw):
    return fn(q, k, v, g=g, beta=beta, initial_state=state.clone(), output_final_state=True,
              use_qk_l2norm_in_kernel=True, **kw)  # fmt: skip


def _close(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    diff = (ours.float() - ref.float()).abs().max().item()
    assert diff <= atol, f"max abs diff {diff:.2e} > {atol}"


@pytest.mark.parametrize("hk,hv", [(2, 4), (3, 3)], ids=["gqa", "mha"])
@pytest.mark.parametrize("length", [1, 5, 64, 150], ids=lambda n: f"T{n}")
def test_matches_hf_chunked_and_recurrent(hk: int, hv: int, length: int) -> None:
    q, k, v, g, beta, state = _inputs(2, length, hk, hv, 16, 24, seed=length)
    ref_chunk, ref_chunk_state = _hf(torch_chunk_gated_delta_rule, q, k, v, g, beta, state)
    ref_rec, ref_rec_state = _hf(torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    for fn in (gated_delta_rule, chunked_gated_delta_rule, recurrent_gated_delta_rule):
        out, new_state = fn(q, k, v, g, beta, state)
        assert out.shape == (2, length, hv, 24) and new_state.shape == (2, hv, 16, 24)
        assert new_state.dtype == torch.float32
        for ref, ref_state in ((ref_chunk, ref_chunk_state), (ref_rec, ref_rec_state)):
            _close(out, ref)
            _close(new_state, ref_state)


def test_short_segments_run_the_recurrence_and_long_ones_the_chunks() -> None:
    """The reference's dispatch threshold: the two forms differ in rounding only, so tell them apart
    by bits."""
    for length in (MAX_RECURRENT_TOKENS, MAX_RECURRENT_TOKENS + 1):
        args = _inputs(1, length, 2, 4, 16, 16, seed=3)
        out = ref_gdn.gated_delta_rule(*args)[0]
        expected = recurrent_gated_delta_rule if length <= MAX_RECURRENT_TOKENS else chunked_gated_delta_rule
        assert torch.equal(out, expected(*args)[0])


@pytest.mark.parametrize("cuts", [[1, 2, 3], [7, 64, 65, 130], [63, 128]], ids=str)
def test_cuts_with_the_state_carried_equal_one_run(cuts: list[int]) -> None:
    q, k, v, g, beta, state = _inputs(2, 150, 2, 4, 16, 16, seed=7)
    whole, whole_state = gated_delta_rule(q, k, v, g, beta, state)
    outs, carried = [], state
    for lo, hi in zip([0, *cuts], [*cuts, 150]):
        out, carried = gated_delta_rule(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], carried
        )
        outs.append(out)
    _close(torch.cat(outs, dim=1), whole)
    _close(carried, whole_state)


def test_decode_steps_continue_a_prefill() -> None:
    """A chunked prefill then one-token steps, as the engine runs a sequence, equal HF over the whole."""
    q, k, v, g, beta, state = _inputs(1, 90, 2, 4, 16, 16, seed=9)
    ref, ref_state = _hf(torch_chunk_gated_delta_rule, q, k, v, g, beta, state)
    out, carried = gated_delta_rule(q[:, :80], k[:, :80], v[:, :80], g[:, :80], beta[:, :80], state)
    outs = [out]
    for t in range(80, 90):
        out, carried = gated_delta_rule(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                        beta[:, t : t + 1], carried)  # fmt: skip
        outs.append(out)
    _close(torch.cat(outs, dim=1), ref)
    _close(carried, ref_state)


def test_scale_and_no_l2norm_match_hf_without_normalisation() -> None:
    """``use_qk_l2norm=False`` and an explicit scale: HF always scales by ``Dk ** -0.5``."""
    q, k, v, g, beta, state = _inputs(1, 20, 2, 2, 16, 8, seed=11)
    k = torch.nn.functional.normalize(k, dim=-1)  # unnormalised keys make the delta rule diverge
    ref, ref_state = torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state.clone(),
                                                      output_final_state=True)  # fmt: skip
    for fn in (chunked_gated_delta_rule, recurrent_gated_delta_rule):
        out, new_state = fn(q, k, v, g, beta, state, scale=16**-0.5, use_qk_l2norm=False)
        _close(out, ref)
        _close(new_state, ref_state)
    doubled = chunked_gated_delta_rule(q, k, v, g, beta, state, scale=2 * 16**-0.5, use_qk_l2norm=False)[0]
    _close(doubled, 2 * ref)  # the output is linear in q


def test_strong_decay_stays_finite() -> None:
    """Log decays down to -60 per token: the chunked form masks before ``exp``, so nothing overflows."""
    q, k, v, g, beta, state = _inputs(1, 130, 2, 4, 16, 16, seed=13, decay=60.0)
    out, new_state = chunked_gated_delta_rule(q, k, v, g, beta, state)
    assert torch.isfinite(out).all() and torch.isfinite(new_state).all()
    ref, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    _close(out, ref)
    _close(new_state, ref_state)


def test_half_precision_inputs_keep_a_float32_state() -> None:
    q, k, v, g, beta, state = _inputs(1, 40, 2, 4, 16, 16, seed=17)
    out, new_state = gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), state)
    assert out.dtype == torch.bfloat16 and new_state.dtype == torch.float32
    ref, ref_state = gated_delta_rule(q, k, v, g, beta, state)
    _close(out, ref, atol=0.1)
    _close(new_state, ref_state, atol=0.1)
