"""Piecewise device graphs (``graph/piecewise.py``): the traced forward split at every attention call,
the pieces between captured per bucket, attention eager.

On this CPU box the runner drives ``ReplayGraphs``: device-graph semantics without a device. A capture
returns output tensors that hold garbage (NaN) until the graph replays, and a replay recomputes the
piece from the tensors it was captured with, writing into the same outputs. A runner that forgot to
refresh an input, to replay after capture, or read an output after the next replay gives wrong
tokens here as it would on a GPU. The CUDA test runs the real thing where a GPU is at hand.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from graph.base import create_graph_runner
from graph.forward_context import forward_context
from graph.piecewise import PiecewiseGraphRunner, is_attention, split_at_attention
from ops.platforms.device_graph import DeviceGraphs
from tests.xengine.conftest import make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams


class _Replay:
    def __init__(self, fn: Callable[[], Any], out: Any) -> None:
        self.fn, self.out = fn, out
        self.num_replays = 0

    def replay(self) -> None:
        self.num_replays += 1
        for dst, src in zip(_tensors(self.out), _tensors(self.fn()), strict=True):
            dst.copy_(src)


class ReplayGraphs(DeviceGraphs):
    compiles_pieces = False

    def __init__(self) -> None:
        self.graphs: list[_Replay] = []

    def new_pool(self) -> Any:
        return object()

    def capture(self, fn: Callable[[], Any], pool: Any) -> tuple[_Replay, Any]:
        out = fn()
        for t in _tensors(out):  # recorded, not run: nothing is in the outputs yet
            if t.is_floating_point():
                t.fill_(float("nan"))
        self.graphs.append(_Replay(fn, out))
        return self.graphs[-1], out


def _tensors(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]


def _outputs(engine: Any, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    for i, p in enumerate(prompts):
        engine.add_request(AddRequest(req_id=f"r{i}", prompt_token_ids=p, params=params))
    deltas = run_to_completion(engine)
    return {
        r: ([t for d in deltas if d.req_id == r for t in d.new_token_ids],
            [lp for d in deltas if d.req_id == r for lp in (d.new_logprobs or [])])
        for r in {d.req_id for d in deltas}
    }  # fmt: skip


def test_split_puts_each_attention_call_alone(tiny_qwen3: Path) -> None:
    engine = make_engine(tiny_qwen3, max_model_len=128, num_blocks=32)
    num_layers = len(engine.runner.attn_caches)
    seen: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        seen["split"] = split_at_attention(gm)
        return gm.forward

    compiled = torch.compile(engine.runner._forward_tokens, backend=backend, dynamic=False, fullgraph=True)
    with forward_context(None, [], 4), torch.inference_mode():
        ids = torch.zeros(4, dtype=torch.long)
        compiled(ids, ids.clone())
    split, pieces, attentions = seen["split"]
    assert len(attentions) == num_layers and len(pieces) == num_layers + 1
    for name in attentions:
        nodes = [n for n in getattr(split, name).graph.nodes if n.op == "call_function"]
        assert len(nodes) == 1 and is_attention(nodes[0])
    for name in pieces:
        assert not any(is_attention(n) for n in getattr(split, name).graph.nodes)


def test_piecewise_replays_match_eager(tiny_qwen3: Path) -> None:
    prompts = random_prompts([1, 5, 9, 30, 2, 70], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    kw: dict[str, Any] = dict(max_model_len=256, max_num_batched_tokens=64, num_blocks=128)
    want = _outputs(make_engine(tiny_qwen3, **kw), prompts, params)
    engine = make_engine(tiny_qwen3, **kw)
    graphs = ReplayGraphs()
    runner = PiecewiseGraphRunner(engine.runner._forward_tokens, graphs)
    engine.runner.graph = runner
    engine.runner.capture_graphs([1, 8])  # 6 decodes padded to 8; one alone: 1
    num_layers = len(engine.runner.attn_caches)
    assert runner.num_pieces == 2 * (num_layers + 1) == len(graphs.graphs)
    got = _outputs(engine, prompts, params)
    alone = random_prompts([7], seed=9)  # decodes of one sequence: the 1-token bucket
    want.update({f"alone-{r}": v for r, v in _outputs(make_engine(tiny_qwen3, **kw), alone, params).items()})
    got.update({f"alone-{r}": v for r, v in _outputs(engine, alone, params).items()})
    stats = runner.stats
    assert stats.buckets == [1, 8] and set(stats.capture_s) == {1, 8}
    assert stats.num_compiles == 2 and stats.num_recompiles_after_warmup == 0
    assert stats.num_replays > 0 and stats.num_eager_steps > 0
    assert all(g.num_replays > 1 for g in graphs.graphs)  # every piece replayed past its capture
    for r, (toks, lps) in want.items():
        assert got[r][0] == toks
        torch.testing.assert_close(torch.tensor(got[r][1]), torch.tensor(lps), rtol=1e-5, atol=1e-5)


def test_partial_mode_on_graph_platforms_is_piecewise() -> None:
    for platform in ("cuda", "npu"):  # importable, constructed without a device
        runner = create_graph_runner("partial", platform, lambda ids, pos: ids)
        assert isinstance(runner, PiecewiseGraphRunner)
    assert not isinstance(create_graph_runner("partial", "cpu", lambda ids, pos: ids), PiecewiseGraphRunner)


def cuda_tokens_against_eager(model: Path, graph_mode: str) -> Any:
    """Greedy tokens of a CUDA engine in ``graph_mode`` equal to an eager one's (skips without a
    GPU); returns the graph engine for the caller's own checks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompts = random_prompts([1, 5, 9, 30, 2, 70], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw: dict[str, Any] = dict(device="cuda", max_model_len=256, max_num_batched_tokens=64, num_blocks=128)
    want = _outputs(make_engine(model, graph_mode="eager", **kw), prompts, params)
    engine = make_engine(model, graph_mode=graph_mode, graph_batch_sizes="1,4,8", **kw)
    got = _outputs(engine, prompts, params)
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in want.items()}
    return engine


@pytest.mark.cuda
def test_cuda_piecewise_graphs_match_eager(tiny_qwen3: Path) -> None:
    engine = cuda_tokens_against_eager(tiny_qwen3, "partial")
    stats = engine.get_stats().graph
    assert isinstance(engine.runner.graph, PiecewiseGraphRunner) and stats.num_replays > 0
    assert stats.num_recompiles_after_warmup == 0
