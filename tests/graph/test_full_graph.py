"""Full graph mode (``graph/full.py``): whole decode steps replayed as device graphs, attention included.

On this CPU box the runner drives ``ReplayGraphs`` (``test_piecewise_graph.py``): a capture's outputs
hold NaN until a replay, and a replay re-runs what was captured, on the tensors it was captured
with. The captured step runs in the static forward context, so attention reads only the runner's
device buffers: a runner that forgot to copy a step's lengths, block tables, slots, token ids or
positions into them, or to mark padding rows, gives wrong tokens here as it would on a GPU. The
static attention is the torch reference on CPU; its Triton kernels (CUDA's) are checked against it
in ``tests/ops/test_triton_decode_attention.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from graph.base import create_graph_runner
from graph.full import FullGraphRunner
from ops.attention_metadata import build_attention_metadata
from ops.torch_ref.attention import attention as paged_attention
from ops.torch_ref.attention_static import attention_static
from tests.graph.test_piecewise_graph import ReplayGraphs, _outputs, cuda_tokens_against_eager
from tests.xengine.conftest import make_engine, random_prompts
from xengine.api.messages import SamplingParams

KW: dict[str, Any] = dict(max_model_len=256, max_num_batched_tokens=64, num_blocks=128)


def _full_engine(model: Path, **kw: Any) -> tuple[Any, FullGraphRunner, ReplayGraphs]:
    engine = make_engine(model, **{**KW, **kw})
    graphs = ReplayGraphs()
    runner = FullGraphRunner(engine.runner._forward_tokens, graphs)
    engine.runner.graph = runner
    engine.runner.capture_graphs([1, 4, 8])
    return engine, runner, graphs


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_full_decode_graphs_match_eager(make_model_dir: Callable[..., Path], arch: str) -> None:
    """Against the eager engine (itself held to HF greedy tokens by the parity matrix)."""
    model = make_model_dir(arch)
    prompts = random_prompts([1, 5, 9, 30, 2, 70], seed=4)  # 6 decodes: the 8-bucket, padded
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    want = _outputs(make_engine(model, **KW), prompts, params)
    engine, runner, graphs = _full_engine(model)
    num_layers = len(engine.runner.attn_caches)
    full = graphs.graphs[-3:]  # captured after the pieces: buckets 8, 4, 1
    assert len(graphs.graphs) == 3 * (num_layers + 1) + 3
    got = _outputs(engine, prompts, params)
    alone = random_prompts([7, 3], seed=9)  # 2 decodes in the 4-bucket, then 1 alone... the 1-bucket
    want.update({f"b-{r}": v for r, v in _outputs(make_engine(model, **KW), alone, params).items()})
    got.update({f"b-{r}": v for r, v in _outputs(engine, alone, params).items()})
    stats = runner.stats
    assert stats.mode == "full" and stats.decode_graph_buckets == [1, 4, 8]
    assert set(stats.decode_graph_capture_s) == {1, 4, 8}
    assert stats.num_decode_graph_replays > 0 and stats.num_recompiles_after_warmup == 0
    assert all(g.num_replays > 0 for g in full)  # every bucket's whole-step graph replayed
    for r, (toks, lps) in want.items():
        assert got[r][0] == toks, r
        torch.testing.assert_close(torch.tensor(got[r][1]), torch.tensor(lps), rtol=1e-5, atol=1e-5)
    msg = engine.get_stats().graph
    assert msg.decode_graph_buckets == [1, 4, 8] and msg.num_decode_graph_replays > 0


def test_full_graphs_with_prefix_caching_and_sampling(tiny_qwen3: Path) -> None:
    """Shared prefixes (block tables pointing at the same blocks), seeded sampling with penalties."""
    shared = random_prompts([40], seed=1)[0]
    prompts = [shared + p for p in random_prompts([3, 8, 1], seed=2)]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, repetition_penalty=1.3, ignore_eos=True)
    want = _outputs(make_engine(tiny_qwen3, **KW, enable_prefix_caching=True), prompts, params)
    engine, runner, _ = _full_engine(tiny_qwen3, enable_prefix_caching=True)
    got = _outputs(engine, prompts, params)
    assert runner.stats.num_decode_graph_replays > 0
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in want.items()}


def test_static_attention_reads_only_device_tensors() -> None:
    """The op a full graph captures: its host fields cleared, padding rows (length 0, slot -1)
    neither read nor written, and the result that of the paged reference."""
    torch.manual_seed(0)
    cache = torch.randn(2, 16, 4, 2, 16)
    lens, tables = [5, 1, 12], [[3, 7], [0], [9, 2, 11]]
    meta = build_attention_metadata([1, 1, 1], lens, tables, 4)
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    for window in (None, 6):
        want_cache = cache.clone()
        want = paged_attention(q, k, v, want_cache, meta, 0.25, window)
        padded = dataclasses.replace(
            meta,
            seq_lens=torch.tensor(lens + [0], dtype=torch.int32),
            block_tables=torch.cat([meta.block_tables, torch.full((1, 3), 5, dtype=torch.int32)]),
            slot_mapping=torch.cat([meta.slot_mapping, torch.tensor([-1])]),
            query_lens_cpu=[],
            seq_lens_cpu=[],
            static=True,
        )
        got_cache = cache.clone()
        got = attention_static(
            torch.cat([q, q[:1]]),
            torch.cat([k, k[:1]]),
            torch.cat([v, v[:1]]),
            got_cache,
            padded,
            0.25,
            window,
        )
        torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[3], torch.zeros_like(got[3]))
        assert torch.equal(got_cache, want_cache)  # the padding row wrote nothing


def test_full_mode_is_registered_for_cuda_only() -> None:
    assert isinstance(create_graph_runner("full", "cuda", lambda ids, pos: ids), FullGraphRunner)
    for platform in ("cpu", "npu"):
        with pytest.raises(ValueError, match="full"):
            create_graph_runner("full", platform, lambda ids, pos: ids)


@pytest.mark.cuda
def test_cuda_full_graphs_match_eager(tiny_qwen3: Path) -> None:
    stats = cuda_tokens_against_eager(tiny_qwen3, "full").get_stats().graph
    assert stats.mode == "full" and stats.num_decode_graph_replays > 0
