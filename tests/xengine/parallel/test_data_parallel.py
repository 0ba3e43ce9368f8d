"""Data-parallel attention for MoE models: D engine processes, each with its own requests, KV cache and
attention, the MoE layers' experts split over all of them and their tokens exchanged by all-to-all.

Greedy tokens identical to HF ``transformers`` for deepseek_v3 (MLA), qwen3_moe and the hybrid MoE models
mimo_v2_flash (sliding-window pool) and qwen3_next (recurrent-state pool) at D = 2 and 4 under
prefix caching, chunked prefill, preemption, async scheduling and partial graphs, with requests spread
over the ranks; a rank with nothing to run serving the others' tokens; a killed rank taking the whole
instance down at once (no hang); what cannot work refused by name; ``xllm serve
--data-parallel-size 2`` answering like HF through the openai client, then relaunching every rank
after one is killed mid-stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.xengine.parallel.test_moe_expert_parallel import _ancestors
from tests.xengine.parallel.test_tensor_parallel import MODES
from tests.xengine.test_engine_parity import (
    BLOCK_SIZE,
    CONFIGS,
    MAX_TOKENS,
    case_params,
    greedy_reference,
)
from tests.xengine.test_moe_engine import ROOT, TINY_PRESET, serve_moe
from tests.xservice.batch.helpers import completion_line, write_jsonl
from xengine.api.config import EngineConfig
from xengine.api.messages import AddRequest, SamplingParams
from xengine.api.text.tokenizer import Tokenizer
from xengine.llm import LLM, engine_config
from xservice.engine.client import EngineClient
from xservice.engine.data_parallel import DataParallelClient
from xservice.engine.errors import EngineDeadError, EngineStartupError

ARCHS = ("deepseek_v3", "qwen3_moe", "mimo_v2_flash", "qwen3_next")
# (arch, data-parallel size, configuration of test_engine_parity, mode)
CASES = [
    ("deepseek_v3", 2, "prefix+chunked", "async+partial"),
    ("deepseek_v3", 4, "preempt", "eager"),
    ("qwen3_moe", 2, "prefix+chunked", "async"),
    # the hybrid MoE models: each rank keeps its own sliding-window pool / recurrent-state pool
    ("mimo_v2_flash", 2, "prefix+chunked", "eager"),
    ("qwen3_next", 2, "preempt", "async"),
]
SLOW_CASES = [
    ("deepseek_v3", 2, "prefix+chunked", "eager"),
    ("deepseek_v3", 2, "preempt", "async"),
    ("deepseek_v3", 4, "prefix+chunked", "async"),
    ("qwen3_moe", 2, "prefix+chunked", "async+partial"),
    ("qwen3_moe", 2, "preempt", "async"),
    ("qwen3_moe", 4, "noprefix+whole", "eager"),
    ("mimo_v2_flash", 2, "preempt", "async+partial"),
]
PARAMS = case_params(CASES, SLOW_CASES)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(hf_oracle):
    return greedy_reference(hf_oracle, ARCHS, seed=80)


def dp_config(model_dir: Path, dp: int, **fields: object) -> EngineConfig:
    config = engine_config(str(model_dir), num_threads=1, **fields)
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_size=dp))


async def generate(client: DataParallelClient, prompts: list[list[int]], params: SamplingParams) -> list:
    """Every prompt at once (the client spreads them over the ranks); each one's tokens."""

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        req = AddRequest(req_id=f"r{i}", prompt_token_ids=prompt, params=params)
        async for delta in client.generate(req):
            tokens += delta.new_token_ids
        return tokens

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.mark.parametrize(("arch", "dp", "config", "mode"), PARAMS)
def test_dp_greedy_tokens_match_hf(
    make_model_dir, reference, arch: str, dp: int, config: str, mode: str
) -> None:
    prompts, expected = reference(arch)
    kw = {**CONFIGS[config], **MODES[mode], "block_size": BLOCK_SIZE, "max_num_seqs": 16}

    async def run() -> tuple[list, list, list]:
        client = await DataParallelClient.start(dp_config(make_model_dir(arch), dp, **kw), 300)
        try:
            got = await generate(client, prompts, GREEDY)
            stats = [await c.stats() for c in client.ranks] + [await client.stats()]
        finally:
            await client.close()
        return got, stats, [c.process.exit_code for c in client.ranks]

    got, stats, exit_codes = asyncio.run(run())
    assert exit_codes == [0] * dp  # the ranks left together: none broke waiting for another
    for i, (tokens, want) in enumerate(zip(got, expected)):
        assert tokens == want, f"prompt {i} ({len(prompts[i])} tokens)"
    *ranks, total = stats
    moe = total.moe
    assert moe is not None and moe.data_parallel_size == dp and moe.expert_parallel_size == dp
    assert moe.comm_bytes_sent > 0 and moe.num_moe_layers > 0
    assert all(s.num_computed_prompt_tokens > 0 for s in ranks)  # every rank ran requests of its own
    if config.startswith("prefix"):
        assert total.prefix_cache_hits > 0
    if config.startswith("preempt"):
        assert total.num_preemptions > 0
    if mode.endswith("partial"):
        assert total.graph.num_replays > 0 and total.graph.num_recompiles_after_warmup == 0
    if arch == "mimo_v2_flash":
        assert all(s.window_pool is not None and s.window_pool.num_layers > 0 for s in ranks)
    if arch == "qwen3_next":
        assert all(s.state_pool is not None and s.state_pool.num_layers > 0 for s in ranks)


def test_an_idle_rank_serves_the_others_tokens_and_a_killed_rank_downs_the_instance(make_model_dir) -> None:
    """One request: it runs on one rank while the other, with nothing of its own, runs its share of every
    MoE layer's exchange (the tokens are those of one process). Then a rank killed mid-request: the
    other's next round fails at once and the instance reports which rank died first."""
    model_dir = make_model_dir("deepseek_v3")
    prompt = [5, 6, 7, 8]
    with LLM(str(model_dir), num_threads=1) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        single = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    async def run() -> tuple[list, list, int, str | None, float]:
        client = await DataParallelClient.start(dp_config(model_dir, 2, block_size=16), 300)
        try:
            (got,) = await generate(
                client, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            )
            per_rank = [(await c.stats()).moe for c in client.ranks]
            # one after another, three prompts sharing their first 64 tokens: all go to the rank that
            # cached that start (round-robin would have computed it once per rank)
            shared = list(range(100, 164))
            short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            before = sum([(await c.stats()).prefix_cache_hits for c in client.ranks])
            for i in range(3):
                await generate(client, [shared + [7 + i, 8]], short)
            hits = sum([(await c.stats()).prefix_cache_hits for c in client.ranks]) - before
            long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            seen, t0 = 0, 0.0
            with pytest.raises(EngineDeadError, match="peer rank is gone"):
                async for _ in client.generate(
                    AddRequest(req_id="long", prompt_token_ids=prompt, params=long)
                ):
                    seen += 1
                    if seen == 3:
                        victim = [r for r in range(2) if client.ranks[r].num_inflight == 0][0]
                        os.kill(client.ranks[victim].pid, signal.SIGKILL)
                        t0 = time.monotonic()
            return got, per_rank, hits, client.dead_reason, time.monotonic() - t0
        finally:
            await client.close()

    got, per_rank, hits, reason, took = asyncio.run(run())
    assert hits >= 2 * 48, hits  # the 2nd and 3rd found the start (whole blocks of it) cached
    assert got == single
    assert sorted(m.num_idle_exchanges > 0 for m in per_rank) == [False, True], per_rank
    assert (
        reason is not None and reason.startswith("data-parallel rank") and "code -9" in reason.split(";")[0]
    )
    assert took < 60  # a hang guard, not a timing claim


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(data_parallel_size=2), "xllm serve"),
        (dict(data_parallel_size=2, expert_parallel_size=4), "must be 1 or equal"),
        (dict(data_parallel_size=2, tensor_parallel_size=2), "tensor_parallel_size > 1"),
        (dict(data_parallel_size=2, enable_eplb=True), "enable_eplb"),
        (dict(data_parallel_size=2, data_parallel_rank=2), "data_parallel_rank"),
    ],
)
def test_what_cannot_run_data_parallel_is_refused(make_model_dir, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(make_model_dir("deepseek_v3")), num_threads=1, **kw)


def test_a_dense_model_is_refused_by_every_rank(make_model_dir) -> None:
    async def run() -> None:
        await DataParallelClient.start(dp_config(make_model_dir("qwen3"), 2), 300)

    with pytest.raises(EngineStartupError, match="mixture-of-experts"):
        asyncio.run(run())


def test_a_rank_that_cannot_start_stops_the_others_at_once(make_model_dir, monkeypatch) -> None:
    """Rank 1 fails to start (injected): rank 0, a real engine process waiting for it to join, is
    stopped at once instead of waiting out its start-up timeout, and no engine process is left."""
    real_start = EngineClient.start

    async def start(config: EngineConfig, timeout_s: float) -> EngineClient:
        if config.parallel.data_parallel_rank == 1:
            await asyncio.sleep(1.0)
            raise EngineStartupError("rank 1 could not start (injected)")
        return await real_start(config, timeout_s)

    monkeypatch.setattr(EngineClient, "start", staticmethod(start))
    t0 = time.monotonic()
    with pytest.raises(EngineStartupError, match="injected"):
        asyncio.run(DataParallelClient.start(dp_config(make_model_dir("deepseek_v3"), 2), 300))
    assert time.monotonic() - t0 < 60  # a hang guard, not a timing claim
    assert _engines_of(os.getpid()) == []


def test_serve_with_data_parallel_answers_like_hf_then_relaunches_every_rank(
    make_model_dir, hf_oracle, tmp_path: Path
) -> None:
    """``xllm serve --model <deepseek_v3> --data-parallel-size 2``: HF's greedy chat answer through the
    openai client; a rank killed mid-stream ends that stream with an error, the
    supervisor relaunches both ranks and the instance answers again."""
    model_dir = make_model_dir("deepseek_v3")
    messages = [{"role": "user", "content": "Name a color."}]
    flags = ("--data-parallel-size", "2", "--engine-restart-backoff-s", "0.5")
    with serve_moe(model_dir, tmp_path / "serve.log", *flags) as (server, url):
        client = openai.OpenAI(
            base_url=url, api_key="unused", max_retries=0, http_client=httpx.Client(timeout=120)
        )
        ranks = _engines_of(server.pid)
        assert len(ranks) == 2, ranks
        replies = [
            client.chat.completions.create(
                model=model_dir.name, messages=messages, temperature=0.0, max_tokens=10
            )
            for _ in range(2)
        ]
        stream = client.completions.create(
            model=model_dir.name,
            prompt="once upon a time",
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        with pytest.raises(openai.APIError, match="data-parallel rank"):
            for i, _ in enumerate(stream):
                if i == 3:
                    os.kill(ranks[1], signal.SIGKILL)
        deadline = time.monotonic() + 120  # a hang guard, not a timing claim
        while True:
            try:
                again = client.chat.completions.create(
                    model=model_dir.name, messages=messages, temperature=0.0, max_tokens=10
                )
                break
            except openai.APIStatusError as e:
                assert e.status_code == 503 and time.monotonic() < deadline, str(e)
                time.sleep(0.5)
        relaunched = _engines_of(server.pid)
    assert len(relaunched) == 2 and not set(relaunched) & set(ranks), (ranks, relaunched)
    tok = Tokenizer.from_dir(model_dir)
    prompt = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
    )
    expected = tok.decode(
        hf_oracle("deepseek_v3").greedy(prompt, 10, ignore_eos=False), skip_special_tokens=True
    )
    assert [r.choices[0].message.content for r in replies] == [expected, expected]
    assert again.choices[0].message.content == expected


def _engines_of(service_pid: int) -> list[int]:
    """The engine processes under ``xllm serve``, oldest first."""
    out = subprocess.run(["pgrep", "-f", "xengine.process.engine_proc"], capture_output=True, text=True)
    return sorted(pid for pid in (int(x) for x in out.stdout.split()) if service_pid in _ancestors(pid))


def test_run_batch_with_data_parallel_gives_the_single_process_results(
    make_model_dir, tmp_path: Path
) -> None:
    """``xllm run-batch --data-parallel-size 2`` starts both ranks the same way and writes the texts one
    engine process writes (greedy)."""
    model_dir = make_model_dir("qwen3_moe")
    lines = [completion_line(f"c{i}", f"story number {i} begins", 8) for i in range(6)]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    texts = {}
    for dp in (1, 2):
        out = tmp_path / f"out-{dp}.jsonl"
        cmd = [sys.executable, "-m", "xservice", "run-batch", "--config", str(TINY_PRESET), "-i", str(path)]
        cmd += [
            "-o",
            str(out),
            "--model",
            str(model_dir),
            "--num-threads",
            "1",
            "--data-parallel-size",
            str(dp),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads(x) for x in out.read_text().splitlines()]
        texts[dp] = [r["response"]["body"]["choices"][0]["text"] for r in records]
    assert texts[2] == texts[1] and all(texts[1])
