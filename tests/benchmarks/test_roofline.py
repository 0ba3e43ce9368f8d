"""The roofline floor and model FLOPs behind ``engine_modes``' fractions, against hand counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import roofline
from benchmarks.model_flops import model_dims, model_flops_per_token, offline_flops, prefill_flops


@pytest.fixture
def model_dir(tiny_qwen3: Path) -> str:
    return str(tiny_qwen3)


def _config(model_dir: str) -> tuple[int, int, int, int, int, int]:
    """(hidden, intermediate, layers, heads x head_dim, KV heads x head_dim, vocab) from config.json."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    dim = c["head_dim"]
    return (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
            c["num_attention_heads"] * dim, c["num_key_value_heads"] * dim, c["vocab_size"])  # fmt: skip


def test_dims_and_flops_match_a_hand_count(model_dir: str) -> None:
    H, I, L, Q, KV, V = _config(model_dir)  # noqa: E741
    d = model_dims(model_dir)
    body = L * (H * (Q + 2 * KV) + Q * H + 3 * H * I)
    assert (d.body, d.head, d.layers, d.q_width, d.kv_width) == (body, H * V, L, Q, KV)
    assert model_flops_per_token(model_dir, 10) == 2 * (body + H * V) + 4 * L * 10 * Q
    prompt = 5 * 2 * body + 2 * H * V + 4 * L * Q * (5 * 6 / 2)  # causal: contexts 1..5
    assert prefill_flops(model_dir, 3, 5) == 3 * prompt
    decode = sum(model_flops_per_token(model_dir, 5 + i) for i in (1, 2))
    assert offline_flops(model_dir, 3, 5, 3) == 3 * (prompt + decode)


def test_floor_takes_each_phase_at_its_own_bound(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, L, Q, KV, _ = _config(model_dir)
    d = model_dims(model_dir)
    peak_gflop_s, gb_s = 100.0, 2.0
    measured: list[tuple[int, int]] = []
    monkeypatch.setattr(
        roofline, "read_gb_s", lambda num_bytes, threads: measured.append((num_bytes, threads)) or gb_s
    )
    floor = roofline.offline_floor(model_dir, 4, 8, 3, peak_gflop_s, 1)
    # the bandwidth is measured once, on a buffer as big as the mid-run decode step's weights and KV
    assert measured == [(4 * (d.body + d.head) + 4 * 4 * (8 + 3 // 2) * 2 * L * KV, 1)]
    peak, bw = peak_gflop_s * 1e9, gb_s * 1e9
    expected_decode = 0.0
    for ctx in (9, 10):  # output_len - 1 decode steps
        linear = max(2 * 4 * (d.body + d.head) / peak, 4 * (d.body + d.head) / bw)
        attention = max(4 * 4 * L * ctx * Q / peak, 4 * 4 * ctx * 2 * L * KV / bw)
        expected_decode += linear + attention
    assert floor["prefill_s"] == pytest.approx(prefill_flops(model_dir, 4, 8) / peak, abs=1e-4)
    assert floor["decode_s"] == pytest.approx(expected_decode, abs=1e-4)
    assert floor["decode_steps_bound_by_bytes"] == 2  # a few rows: weights cost more to read than to use
    fraction = offline_flops(model_dir, 4, 8, 3) / (floor["prefill_s"] + floor["decode_s"]) / peak
    assert floor["floor_fraction_of_peak"] == pytest.approx(fraction, rel=1e-2)
    assert floor["floor_fraction_of_peak"] < 1
