"""The SSD scan (``ops/ssd.py``) against HF ``transformers``' pure-torch Mamba2 math (Nemotron-H's
``mamba2_chunk_scan`` for segments, ``mamba2_selective_state_update`` for one token), and against
itself across segment cuts: the state carried from one piece to the next must give the outputs and the
final state of one uncut run."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers.models.nemotron_h import modeling_nemotron_h as hf

from ops.ssd import ssd_scan

TOL = dict(rtol=1e-5, atol=1e-4)


def _inputs(
    batch: int, length: int, heads: int = 6, head_dim: int = 4, groups: int = 2, state: int = 5, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random operands; ``dt_raw`` before ``softplus(. + dt_bias)``, ``dt`` after."""
    g = torch.Generator().manual_seed(seed)
    out = dict(
        x=torch.randn(batch, length, heads, head_dim, generator=g),
        dt_raw=torch.randn(batch, length, heads, generator=g),
        dt_bias=torch.randn(heads, generator=g) * 0.5,
        A=-(torch.rand(heads, generator=g) * 2 + 0.1),
        B=torch.randn(batch, length, groups, state, generator=g),
        C=torch.randn(batch, length, groups, state, generator=g),
        D=torch.randn(heads, generator=g),
        state=torch.randn(batch, heads, head_dim, state, generator=g),
    )
    out["dt"] = F.softplus(out["dt_raw"] + out["dt_bias"])
    return out


def _ours(t: dict[str, torch.Tensor], lo: int, hi: int, state: torch.Tensor, chunk_size: int = 16):
    return ssd_scan(
        t["x"][:, lo:hi],
        t["dt"][:, lo:hi],
        t["A"],
        t["B"][:, lo:hi],
        t["C"][:, lo:hi],
        t["D"],
        state,
        chunk_size,
    )


@pytest.mark.parametrize("length,chunk_size", [(2, 16), (16, 16), (37, 8), (130, 64)])
def test_segment_matches_hf_chunk_scan(length: int, chunk_size: int) -> None:
    t = _inputs(2, length)
    y_ref, state_ref = hf.mamba2_chunk_scan(
        t["x"],
        t["dt_raw"],
        t["A"],
        t["B"],
        t["C"],
        chunk_size=8,
        D=t["D"],
        dt_bias=t["dt_bias"],
        initial_states=t["state"],
        dt_softplus=True,
        return_final_states=True,
    )
    y, state = _ours(t, 0, length, t["state"], chunk_size)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(state, state_ref, **TOL)
    assert state.dtype == torch.float32


def test_one_token_matches_hf_selective_state_update() -> None:
    t = _inputs(3, 1, seed=1)
    heads, head_dim, n = t["x"].shape[2], t["x"].shape[3], t["B"].shape[-1]
    state_ref = t["state"].clone()  # HF updates it in place
    y_ref = hf.mamba2_selective_state_update(
        state_ref,
        t["x"][:, 0],
        t["dt_raw"][:, 0, :, None].expand(-1, -1, head_dim),
        t["A"][:, None, None].expand(-1, head_dim, n),
        t["B"][:, 0],
        t["C"][:, 0],
        t["D"][:, None].expand(-1, head_dim),
        dt_bias=t["dt_bias"][:, None].expand(-1, head_dim),
        dt_softplus=True,
    )
    y, state = _ours(t, 0, 1, t["state"])
    assert y.shape == (3, 1, heads, head_dim)
    torch.testing.assert_close(y[:, 0], y_ref, **TOL)
    torch.testing.assert_close(state, state_ref, **TOL)


@pytest.mark.parametrize("seed", range(4))
def test_state_carried_across_cuts_at_any_position(seed: int) -> None:
    """Cut a 70-token segment at random positions (one-token pieces run the recurrent form, longer
    ones the chunked form, with chunk boundaries elsewhere than in the uncut run)."""
    length = 70
    t = _inputs(2, length, seed=seed)
    whole, whole_state = _ours(t, 0, length, t["state"])
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, length), 6) + [length])
    pieces, state, lo = [], t["state"], 0
    for hi in cuts:
        y, state = _ours(t, lo, hi, state)
        pieces.append(y)
        lo = hi
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, **TOL)
    torch.testing.assert_close(state, whole_state, **TOL)


def test_token_by_token_equals_the_chunked_form_from_zero_state() -> None:
    t = _inputs(1, 20, seed=7)
    zero = torch.zeros_like(t["state"])
    whole, whole_state = _ours(t, 0, 20, zero)
    state, outs = zero, []
    for i in range(20):
        y, state = _ours(t, i, i + 1, state)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, **TOL)
    torch.testing.assert_close(state, whole_state, **TOL)


def test_half_precision_inputs_keep_a_float32_state() -> None:
    t = _inputs(1, 9, seed=3)
    y, state = ssd_scan(
        t["x"].bfloat16(), t["dt"], t["A"], t["B"].bfloat16(), t["C"].bfloat16(), t["D"], t["state"]
    )
    y32, _ = _ours(t, 0, 9, t["state"])
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(y.float(), y32, rtol=0.05, atol=0.2)
