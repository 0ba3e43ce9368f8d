"""Expert parallelism: one engine instance as two processes on gloo, experts sharded, tokens moved by
all-to-all. Greedy tokens identical to HF ``transformers`` for both MoE architectures, with dual-batch
overlap off and on, prefix caching and chunked prefill, async scheduling and partial graphs; EPLB swapping
expert placements mid-generation without changing a token; a worker killed with SIGKILL takes the instance
down with a clear error instead of a hang; configurations that cannot work are refused at start-up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.xengine.test_engine_parity import BLOCK_SIZE, MAX_TOKENS, make_prompts
from tests.xengine.test_moe_engine import hf_chat_answer, serve_moe
from xengine.api.messages import AddRequest, SamplingParams
from xengine.llm import LLM
from xengine.step.execute import EngineBrokenError

ARCHS = ("qwen3_moe", "deepseek_v3")
CHUNKED = dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64)
# (arch, mode name, LLM kwargs); DBO: dual-batch overlap
MODES = {
    "eager": dict(async_scheduling="off", graph_mode="eager"),
    "dbo+async": dict(enable_dual_batch_overlap=True, async_scheduling="on", graph_mode="eager"),
    "dbo+async+partial": dict(
        enable_dual_batch_overlap=True, async_scheduling="on", graph_mode="partial", graph_batch_sizes="16"
    ),
}
CASES = [
    ("qwen3_moe", "eager"),
    ("qwen3_moe", "dbo+async+partial"),
    ("deepseek_v3", "eager"),
    ("deepseek_v3", "dbo+async"),
]


@pytest.fixture(scope="module")
def reference(make_model_dir, hf_oracle):
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def _get(arch: str) -> tuple[list[list[int]], list[list[int]]]:
        if arch not in cache:
            prompts = make_prompts(seed=40 + ARCHS.index(arch))  # the prompts test_moe_engine uses
            oracle = hf_oracle(arch)
            cache[arch] = prompts, [oracle.greedy(p, MAX_TOKENS) for p in prompts]
        return cache[arch]

    return _get


@pytest.mark.parametrize(("arch", "mode"), CASES, ids=[f"{a}-{m}" for a, m in CASES])
def test_ep2_greedy_tokens_match_hf(make_model_dir, reference, arch: str, mode: str) -> None:
    prompts, expected = reference(arch)
    kw = {**CHUNKED, **MODES[mode]}
    with LLM(
        str(make_model_dir(arch)),
        expert_parallel_size=2,
        num_threads=1,
        block_size=BLOCK_SIZE,
        max_num_seqs=16,
        **kw,
    ) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for run in range(2):  # the second run meets a warm prefix cache
            outputs = llm.generate(prompts, params, use_tqdm=False)
            for i, (out, tokens) in enumerate(zip(outputs, expected)):
                assert out.outputs[0].token_ids == tokens, f"run {run}, prompt {i} ({len(prompts[i])} tokens)"
        stats = llm.engine.get_stats()
        moe = stats.moe
        assert moe is not None and moe.expert_parallel_size == 2
        assert moe.dual_batch_overlap == bool(kw.get("enable_dual_batch_overlap"))
        assert moe.num_moe_layers > 0 and moe.num_steps == stats.num_steps and moe.comm_bytes_sent > 0
        assert stats.prefix_cache_hits >= len(prompts) // 2 * BLOCK_SIZE
        if kw["graph_mode"] == "partial":
            assert stats.graph.num_replays > 0 and stats.graph.num_recompiles_after_warmup == 0


def _skewed_prompts() -> list[list[int]]:
    """Prompts of one repeated token: every position routes to the same few experts (skewed load)."""
    return [[7 + (i % 3)] * 30 for i in range(12)]


def test_eplb_swaps_placements_mid_generation_without_changing_a_token(make_model_dir) -> None:
    model = str(make_model_dir("qwen3_moe"))
    prompts = _skewed_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with LLM(model, num_threads=1, max_num_seqs=16) as single:
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    with LLM(
        model,
        expert_parallel_size=2,
        num_threads=1,
        max_num_seqs=16,
        enable_eplb=True,
        num_redundant_experts=2,
        eplb_interval=16,
        eplb_window=16,
    ) as llm:
        swaps_at: list[int] = []
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(AddRequest(req_id=f"r{i}", prompt_token_ids=prompt, params=params))
        tokens: dict[str, list[int]] = {}
        while llm.engine.has_unfinished_requests():
            before = llm.engine.get_stats().moe.num_swaps
            for delta in llm.engine.step():
                tokens.setdefault(delta.req_id, []).extend(delta.new_token_ids)
            if llm.engine.get_stats().moe.num_swaps > before:
                swaps_at.append(llm.engine.num_steps)
        moe = llm.engine.get_stats().moe
    # the swap happened while every sequence was still generating, and changed nothing they produced
    assert swaps_at and swaps_at[0] < params.max_tokens, swaps_at
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert moe.eplb and moe.num_redundant_experts == 2 and moe.num_swaps == len(swaps_at)
    assert len(moe.balancedness) == moe.num_moe_layers and len(moe.balancedness_before) == moe.num_moe_layers
    assert all(0.0 < b <= 1.0 for b in moe.balancedness + moe.balancedness_before)


def test_a_killed_worker_takes_the_instance_down_without_a_hang(make_model_dir) -> None:
    llm = LLM(str(make_model_dir("qwen3_moe")), expert_parallel_size=2, num_threads=1)
    try:
        (worker,) = llm.engine.parallel.procs
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        llm.engine.add_request(AddRequest(req_id="r", prompt_token_ids=[5, 6, 7], params=params))
        llm.engine.step()
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineBrokenError, match="worker rank 1 .* exited"):
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        assert time.monotonic() - t0 < 60  # a hang guard, not a timing claim
        worker.wait(5)
        with pytest.raises(EngineBrokenError, match="worker rank 1"):
            llm.engine.step()
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("arch", "kw", "match"),
    [
        ("qwen3", dict(expert_parallel_size=2), "mixture-of-experts"),
        ("qwen3_moe", dict(expert_parallel_size=2, kv_layout="xtensor"), "xtensor"),
        ("qwen3_moe", dict(tensor_parallel_size=2, expert_parallel_size=4), "tensor_parallel_size"),
        ("qwen3_moe", dict(enable_dual_batch_overlap=True), "expert_parallel_size > 1"),
        ("qwen3_moe", dict(expert_parallel_size=2, num_redundant_experts=2), "enable_eplb"),
        (
            "qwen3_moe",
            dict(expert_parallel_size=2, enable_eplb=True, num_redundant_experts=1),
            "multiple of 2",
        ),
    ],
)
def test_configurations_that_cannot_work_are_refused(make_model_dir, arch: str, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(make_model_dir(arch)), num_threads=1, **kw)


def test_serve_with_expert_parallel_answers_then_survives_a_killed_worker(
    make_model_dir, hf_oracle, tmp_path: Path
) -> None:
    """``xllm serve --model <moe> --expert-parallel-size 2``: HF's greedy chat answer through the openai
    client; EP metrics in /metrics; a worker killed mid-stream ends that stream with an error event (no
    hang), the supervisor relaunches the instance and it answers again."""
    moe_dir = make_model_dir("qwen3_moe")
    messages = [{"role": "user", "content": "Name a color."}]
    flags = ("--expert-parallel-size", "2", "--engine-restart-backoff-s", "0.5")
    with serve_moe(moe_dir, tmp_path / "serve.log", *flags) as (server, url):
        client = openai.OpenAI(
            base_url=url, api_key="unused", max_retries=0, http_client=httpx.Client(timeout=120)
        )
        reply = client.chat.completions.create(
            model=moe_dir.name, messages=messages, temperature=0.0, max_tokens=10
        )
        assert "xllm_moe_comm_exposed_seconds" in httpx.get(url.removesuffix("/v1") + "/metrics").text
        again = kill_a_worker_mid_stream_then_chat(client, moe_dir.name, server.pid, messages)
    _, _, expected = hf_chat_answer(moe_dir, hf_oracle, messages, 10)
    assert reply.choices[0].message.content == expected == again.choices[0].message.content


def kill_a_worker_mid_stream_then_chat(
    client: openai.OpenAI, model: str, service_pid: int, messages: list[dict]
) -> openai.types.chat.ChatCompletion:
    """SIGKILL rank 1 under ``xllm serve`` mid-stream: the stream ends with an error naming it (no hang);
    then the greedy chat reply once the relaunched instance answers (503 until then)."""
    stream = client.completions.create(
        model=model, prompt="once upon a time", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    with pytest.raises(openai.APIError, match="worker rank 1"):
        for i, _ in enumerate(stream):
            if i == 3:
                os.kill(_worker_of(service_pid), signal.SIGKILL)
    deadline = time.monotonic() + 120  # a hang guard, not a timing claim
    while True:
        try:
            return client.chat.completions.create(
                model=model, messages=messages, temperature=0.0, max_tokens=10
            )
        except openai.APIStatusError as e:
            assert e.status_code == 503 and time.monotonic() < deadline, str(e)
            time.sleep(0.5)


def _worker_of(service_pid: int) -> int:
    """The expert-parallel worker under ``xllm serve`` (its watchdog, API server and engine process)."""
    out = subprocess.run(["pgrep", "-f", "xengine.parallel.worker"], capture_output=True, text=True)
    for pid in (int(x) for x in out.stdout.split()):
        if service_pid in _ancestors(pid):
            return pid
    raise AssertionError(f"no expert-parallel worker under service {service_pid}")


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        out.append(pid)
    return out


def test_ep2_with_an_8bit_kv_cache_gives_the_single_process_tokens(make_model_dir) -> None:
    """Every rank stores its KV in the engine's ``kv_cache_dtype``: EP = 2 with an int8 cache gives the
    tokens of one process with the same cache (a worker left on full-precision KV would not)."""
    prompts = make_prompts(seed=40)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    kw = dict(num_threads=1, block_size=BLOCK_SIZE, max_num_seqs=16, kv_cache_dtype="int8", **MODES["eager"])
    outputs = {}
    for ep in (1, 2):
        with LLM(str(make_model_dir("qwen3_moe")), expert_parallel_size=ep, **kw) as llm:
            outputs[ep] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[2] == outputs[1]
