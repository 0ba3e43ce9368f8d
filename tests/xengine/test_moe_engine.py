"""MoE models end to end: greedy tokens identical to HF ``transformers`` through the whole engine (prefix
caching, chunked prefill, preemption, async scheduling, xTensor, partial graphs), offline ``LLM`` text
generation, and ``xllm serve --model <moe folder>`` answering a chat request.

Checkpoints: ``make-tiny --arch qwen3_moe`` (32 experts, top-4, a dense first layer) and ``--arch
deepseek_v3`` (MLA latent cache, 32 grouped experts + a shared one). The default run covers a few
(configuration, mode) pairs per model; the whole matrix of ``test_engine_parity`` is ``slow``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.xengine.test_engine_parity import BLOCK_SIZE, CONFIGS, MAX_TOKENS, MODES, make_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

ARCHS = ("qwen3_moe", "deepseek_v3")
ROOT = Path(__file__).resolve().parents[2]
TINY_PRESET = ROOT / "configs" / "cpu-tiny-test.yaml"
# the default run: each model's caches and step loops, prefix caching off and whole-prompt prefill
# (qwen3_moe, ~1 s), and DeepSeek-V3's MLA latent cache under partial graphs (~5 s)
FAST = {
    "qwen3_moe": [
        ("prefix+chunked", "paged"),
        ("prefix+chunked", "paged+async"),
        ("preempt", "paged+async"),
        ("prefix+chunked", "xtensor+async+partial"),
        ("noprefix+whole", "paged"),
    ],
    "deepseek_v3": [
        ("prefix+chunked", "paged+async"),
        ("preempt", "paged"),
        ("prefix+chunked", "xtensor"),
        ("prefix+chunked", "paged+partial"),
    ],
}
CASES = [
    pytest.param(a, c, m, id=f"{a}-{c}-{m}", marks=() if (c, m) in FAST[a] else pytest.mark.slow)
    for a in ARCHS
    for c in CONFIGS
    for m in MODES
]


@pytest.fixture(scope="module")
def reference(make_model_dir, hf_oracle):
    """Factory ``arch -> (16 prompts, HF's greedy tokens for them)``: short, long, a shared 150-token prefix."""
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def _get(arch: str) -> tuple[list[list[int]], list[list[int]]]:
        if arch not in cache:
            prompts = make_prompts(seed=40 + ARCHS.index(arch))
            oracle = hf_oracle(arch)
            cache[arch] = prompts, [oracle.greedy(p, MAX_TOKENS) for p in prompts]
        return cache[arch]

    return _get


@pytest.mark.parametrize(("arch", "config", "mode"), CASES)
def test_greedy_tokens_match_hf(make_model_dir, reference, arch: str, config: str, mode: str) -> None:
    prompts, expected = reference(arch)
    # xTensor maps every block of every layer's K and V: a pool of 512 blocks (4096 mappings at most) keeps
    # clear of vm.max_map_count even late in a full run, whose earlier engines hold many mappings.
    pool = {"num_blocks": 512} if MODES[mode]["kv_layout"] == "xtensor" else {}
    kw = {**MODES[mode], **pool, **CONFIGS[config]}
    gc.collect()  # free the mappings of engines dropped by earlier tests
    llm = LLM(str(make_model_dir(arch)), block_size=BLOCK_SIZE, max_num_seqs=16, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for run in range(2):  # the second run meets a warm prefix cache
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for i, (out, tokens) in enumerate(zip(outputs, expected)):
            assert out.outputs[0].token_ids == tokens, f"run {run}, prompt {i} ({len(prompts[i])} tokens)"
    stats = llm.engine.get_stats()
    assert stats.async_scheduling == (MODES[mode]["async_scheduling"] == "on")
    if MODES[mode]["graph_mode"] == "partial":
        assert stats.graph.num_replays > 0 and stats.graph.num_recompiles_after_warmup == 0
    if "num_blocks" in CONFIGS[config]:
        assert stats.num_preemptions > 0
    if CONFIGS[config]["enable_prefix_caching"]:
        assert stats.prefix_cache_hits >= len(prompts) // 2 * BLOCK_SIZE


@pytest.mark.parametrize("arch", ARCHS)
def test_offline_llm_generates_text_like_hf(make_model_dir, hf_oracle, arch: str) -> None:
    llm = LLM(model=str(make_model_dir(arch)))
    texts = ["The capital of France is", "def main():", "Hello, how are you?"]
    outputs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    oracle = hf_oracle(arch)
    for text, out in zip(texts, outputs):
        ids = llm.tokenizer.encode(text)
        assert out.prompt_token_ids == ids
        got = out.outputs[0]
        assert got.token_ids == oracle.greedy(ids, 12, ignore_eos=False)
        assert got.text == llm.tokenizer.decode(got.token_ids, skip_special_tokens=True) and got.text


@contextlib.contextmanager
def serve_moe(moe_dir: Path, log_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``xllm serve --model <moe_dir> FLAGS`` on the tiny test preset: yields (process, base URL), then stops it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(TINY_PRESET), "--model", str(moe_dir)]
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [*cmd, *flags], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True
        )
        try:
            url = next(
                (ln.split(" at ", 1)[1].strip() for ln in server.stdout if ln.startswith("xllm serving")),
                None,
            )
            assert url, f"server exited with {server.wait()}:\n{log_path.read_text()[-3000:]}"
            yield server, url
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            server.stdout.close()


def hf_chat_answer(
    moe_dir: Path, hf_oracle, messages: list[dict], max_tokens: int
) -> tuple[int, list[int], str]:
    """(prompt tokens, HF's greedy answer tokens, its text) for a chat request to the tiny qwen3_moe."""
    from xengine.api.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(moe_dir)
    prompt = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
    )
    expected = hf_oracle("qwen3_moe").greedy(prompt, max_tokens, ignore_eos=False)
    return len(prompt), expected, tok.decode(expected, skip_special_tokens=True)


def test_serve_answers_a_chat_request(make_model_dir, hf_oracle, tmp_path: Path) -> None:
    """``xllm serve --model <moe folder>``; the openai client's greedy chat answer is HF's."""
    moe_dir = make_model_dir("qwen3_moe")
    messages = [{"role": "user", "content": "Name a color."}]
    with serve_moe(moe_dir, tmp_path / "serve.log") as (_, url):
        client = openai.OpenAI(base_url=url, api_key="unused", http_client=httpx.Client(timeout=120))
        reply = client.chat.completions.create(
            model=moe_dir.name, messages=messages, temperature=0.0, max_tokens=10
        )
    num_prompt, expected, text = hf_chat_answer(moe_dir, hf_oracle, messages, 10)
    assert reply.usage.prompt_tokens == num_prompt and reply.usage.completion_tokens == len(expected)
    assert reply.choices[0].message.content == text
