"""Tensor parallelism: one engine instance as 2 or 4 processes, attention heads, MLP columns, the
vocabulary and the KV cache split over them, partial sums put together by the shared-memory all-reduce.
Greedy tokens identical to HF ``transformers`` for qwen3, llama and qwen3_moe (TP x EP) under prefix
caching, chunked prefill, preemption, async scheduling and partial graphs; logprobs within 1e-4 of one
process; the KV pool holding N times the tokens at the same per-rank memory; a killed rank taking the
instance down without a hang; what cannot work refused by name.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.xengine.parallel.test_moe_expert_parallel import kill_a_worker_mid_stream_then_chat
from tests.xengine.test_engine_parity import (
    BLOCK_SIZE,
    CONFIGS,
    MAX_TOKENS,
    case_params,
    greedy_reference,
    make_prompts,
)
from tests.xengine.test_moe_engine import serve_moe
from xengine.api.messages import AddRequest, SamplingParams
from xengine.api.text.tokenizer import Tokenizer
from xengine.llm import LLM
from xengine.step.execute import EngineBrokenError

ARCHS = ("qwen3", "llama", "qwen3_moe", "deepseek_v3")
MODES = {
    "eager": dict(async_scheduling="off", graph_mode="eager"),
    "async": dict(async_scheduling="on", graph_mode="eager"),
    "async+partial": dict(async_scheduling="on", graph_mode="partial", graph_batch_sizes="16"),
    # dual-batch overlap keeps the expert-parallel all-to-all path inside the tensor-parallel group
    "dbo": dict(async_scheduling="off", graph_mode="eager", enable_dual_batch_overlap=True),
}
# (arch, tensor-parallel size, configuration of test_engine_parity, mode); the tiny models have 4 query
# heads and 2 KV heads, so TP = 4 also replicates each KV head on two ranks
CASES = [
    ("qwen3", 2, "prefix+chunked", "async+partial"),
    ("llama", 2, "preempt", "async"),
    ("qwen3_moe", 2, "prefix+chunked", "eager"),
    ("qwen3_moe", 4, "preempt", "async"),  # TP = 4: each KV head on two ranks
    ("deepseek_v3", 2, "prefix+chunked", "async"),
]
SLOW_CASES = [
    ("qwen3", 4, "preempt", "eager"),
    ("llama", 4, "prefix+chunked", "async"),
    ("deepseek_v3", 4, "preempt", "eager"),
    ("qwen3", 4, "prefix+chunked", "async+partial"),
    ("llama", 2, "noprefix+whole", "async+partial"),
    ("qwen3_moe", 2, "preempt", "async+partial"),
    ("qwen3_moe", 2, "prefix+chunked", "dbo"),
    ("deepseek_v3", 2, "prefix+chunked", "async+partial"),
]
PARAMS = case_params(CASES, SLOW_CASES)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(hf_oracle):
    return greedy_reference(hf_oracle, ARCHS, seed=60)


@pytest.mark.parametrize(("arch", "tp", "config", "mode"), PARAMS)
def test_tp_greedy_tokens_match_hf(
    make_model_dir, reference, arch: str, tp: int, config: str, mode: str
) -> None:
    prompts, expected = reference(arch)
    kw = {**CONFIGS[config], **MODES[mode]}
    with LLM(
        str(make_model_dir(arch)),
        tensor_parallel_size=tp,
        num_threads=1,
        block_size=BLOCK_SIZE,
        max_num_seqs=16,
        **kw,
    ) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for i, (out, tokens) in enumerate(zip(outputs, expected)):
            assert out.outputs[0].token_ids == tokens, f"prompt {i} ({len(prompts[i])} tokens)"
        stats = llm.engine.get_stats()
    par = stats.moe
    assert par is not None and par.tensor_parallel_size == tp
    assert par.num_all_reduces > 0  # the layers' partial sums went through the group's all-reduce
    if arch in (
        "qwen3_moe",
        "deepseek_v3",
    ):  # the experts split over the same ranks; partial outputs all-reduced
        assert par.expert_parallel_size == tp and par.num_moe_layers > 0 and par.all_reduce == "shared_memory"
        assert par.comm_bytes_sent == (0 if mode != "dbo" else par.comm_bytes_sent) and par.num_all_reduces
    if config.startswith("prefix"):
        assert stats.prefix_cache_hits > 0
    if config.startswith("preempt"):
        assert stats.num_preemptions > 0
    if mode.endswith("partial"):
        assert stats.graph.num_replays > 0 and stats.graph.num_recompiles_after_warmup == 0


def test_logprobs_match_one_process_and_the_kv_pool_grows_with_the_ranks(make_model_dir) -> None:
    """The same prompts' top-5 logprobs at TP = 1, 2, 4 agree within 1e-4; with the same KV memory per
    rank the pool holds twice the tokens at TP = 2 (each rank keeps one of the 2 KV heads) and at TP = 4
    too (a KV head cannot split further: it is replicated on two ranks)."""
    prompts = make_prompts(seed=70)[:8]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    results, blocks = {}, {}
    for tp in (1, 2, 4):
        with LLM(
            str(make_model_dir("qwen3")), tensor_parallel_size=tp, num_threads=1, kv_cache_memory_gb=0.002
        ) as llm:
            results[tp] = llm.generate(prompts, params, use_tqdm=False)
            blocks[tp] = llm.engine.kv.pool.num_blocks
    assert abs(blocks[2] - 2 * blocks[1]) <= 1 and blocks[4] == blocks[2], blocks  # floor(memory / block)
    for tp in (2, 4):
        for a, b in zip(results[1], results[tp]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert pa.keys() == pb.keys()
                for tok in pa:
                    assert abs(pa[tok] - pb[tok]) <= 1e-4, (tp, tok, pa[tok], pb[tok])


def test_a_killed_rank_takes_the_instance_down_without_a_hang(make_model_dir) -> None:
    """Rank 0 may be waiting in a shared-memory all-reduce for the dead rank: the supervisor aborts it."""
    llm = LLM(str(make_model_dir("qwen3")), tensor_parallel_size=2, num_threads=1)
    try:
        (worker,) = llm.engine.parallel.procs
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        llm.engine.add_request(AddRequest(req_id="r", prompt_token_ids=[5, 6, 7], params=params))
        llm.engine.step()
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineBrokenError, match="tensor-parallel worker rank 1 .* exited"):
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        assert time.monotonic() - t0 < 60  # a hang guard, not a timing claim
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("arch", "kw", "match"),
    [
        ("mimo_v2_flash", dict(tensor_parallel_size=2), "does not support tensor_parallel_size"),
        ("qwen3_moe", dict(tensor_parallel_size=2, expert_parallel_size=4), "must be 1 or equal"),
        ("qwen3", dict(tensor_parallel_size=3), "must divide the model's number of attention heads"),
        ("qwen3", dict(tensor_parallel_size=2, kv_layout="xtensor"), "xtensor"),
    ],
)
def test_what_cannot_split_is_refused(make_model_dir, arch: str, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(make_model_dir(arch)), num_threads=1, **kw)


def test_prompt_logprobs_under_tp_match_one_process(make_model_dir) -> None:
    """Every rank makes the prompt rows' LM-head calls rank 0 makes (its vocabulary columns, gathered):
    prompt logprobs and top-2 of TP = 2 within 1e-4 of one process, over a prompt longer than one
    LM-head slice (256 rows) and another that chunked prefill splits over two steps."""
    prompts = [list(range(3, 303)), [7, 8, 9, 10, 11] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    outs = {}
    for tp in (1, 2):
        with LLM(
            str(make_model_dir("qwen3")), tensor_parallel_size=tp, num_threads=1,
            enable_chunked_prefill=True, max_num_batched_tokens=320,  # 300 + 20: the second prompt splits
        ) as llm:  # fmt: skip
            outs[tp] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs[1], outs[2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t] - pb[t]) <= 1e-4 for t in pa), (pa, pb)


def test_serve_with_tensor_parallel_answers_like_hf_then_survives_a_killed_rank(
    make_model_dir, hf_oracle, tmp_path: Path
) -> None:
    """``xllm serve --model <qwen3> --tensor-parallel-size 2``: HF's greedy chat answer through the openai
    client; the all-reduce count in /metrics; a rank killed mid-stream ends that stream with an error
    event (no hang), the supervisor relaunches the whole group and it answers again."""
    model_dir = make_model_dir("qwen3")
    messages = [{"role": "user", "content": "Name a color."}]
    flags = ("--tensor-parallel-size", "2", "--engine-restart-backoff-s", "0.5")
    with serve_moe(model_dir, tmp_path / "serve.log", *flags) as (server, url):
        client = openai.OpenAI(
            base_url=url, api_key="unused", max_retries=0, http_client=httpx.Client(timeout=120)
        )
        reply = client.chat.completions.create(
            model=model_dir.name, messages=messages, temperature=0.0, max_tokens=10
        )
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
        assert 'xllm_tensor_parallel_all_reduces{tensor_parallel_size="2"}' in metrics
        again = kill_a_worker_mid_stream_then_chat(client, model_dir.name, server.pid, messages)
    tok = Tokenizer.from_dir(model_dir)
    prompt = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
    )
    expected = tok.decode(hf_oracle("qwen3").greedy(prompt, 10, ignore_eos=False), skip_special_tokens=True)
    assert reply.choices[0].message.content == expected == again.choices[0].message.content


def test_a_rank_loads_only_its_slices(make_model_dir, monkeypatch) -> None:
    """Rank 1 of 2 built in this process: every split parameter equals its slice of the checkpoint, and
    no split tensor was read whole from the file (the norms and the q/k norms are replicated)."""
    from safetensors.torch import load_file

    from xengine.layers import checkpoint_tensor
    from xengine.models.loader import load_model
    from xengine.parallel.tensor import TensorParallel, set_tensor_parallel

    model_dir = make_model_dir("llama")
    full = load_file(str(model_dir / "model.safetensors"))
    read_whole: list[str] = []
    real = checkpoint_tensor.LazyTensor.materialize
    monkeypatch.setattr(
        checkpoint_tensor.LazyTensor, "materialize", lambda self: read_whole.append(self.name) or real(self)
    )
    set_tensor_parallel(TensorParallel(rank=1, size=2, comm=None))
    try:
        model = load_model(str(model_dir), torch.float32, torch.device("cpu"), pack=False)
    finally:
        set_tensor_parallel(None)
    assert read_whole and all(n.endswith("norm.weight") for n in read_whole), read_whole
    layer = model.model.layers[0]
    q, k = full["model.layers.0.self_attn.q_proj.weight"], full["model.layers.0.self_attn.k_proj.weight"]
    q_rows, k_rows = q.shape[0] // 2, k.shape[0] // 2
    qkv = layer.self_attn.qkv_proj.weight
    assert torch.equal(qkv[:q_rows], q[q_rows:]) and torch.equal(qkv[q_rows : q_rows + k_rows], k[k_rows:])
    o = full["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(layer.self_attn.o_proj.weight, o[:, o.shape[1] // 2 :])
    down = full["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(layer.mlp.down_proj.weight, down[:, down.shape[1] // 2 :])
    emb = full["model.embed_tokens.weight"]
    rows = -(-emb.shape[0] // 2)
    assert torch.equal(model.model.embed_tokens.weight[: emb.shape[0] - rows], emb[rows:])


def test_seeded_sampling_beams_and_ngram_speculation_give_the_tp1_outputs(make_model_dir) -> None:
    """What samples from the gathered logits: seeded n > 1, beam search, and n-gram speculative
    decoding (every draft row's logits split over the ranks) give TP = 1's outputs at TP = 2."""
    prompts = make_prompts(seed=90)[:6]
    sampled = SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=16, ignore_eos=True)
    beams = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=8, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    repetitive = [[5, 6, 7, 8] * 12, [9, 10, 11] * 15]
    runs = []
    for tp in (1, 2):
        with LLM(str(make_model_dir("qwen3")), tensor_parallel_size=tp, num_threads=1) as llm:
            out = llm.generate(prompts, sampled, use_tqdm=False)
            beam = llm.generate(prompts[:2], beams, use_tqdm=False)
            runs.append(
                (
                    [[c.token_ids for c in o.outputs] for o in out],
                    [[c.token_ids for c in b.outputs] for b in beam],
                )
            )
        with LLM(
            str(make_model_dir("qwen3")), tensor_parallel_size=tp, num_threads=1, speculative_config=spec
        ) as llm:
            out = llm.generate(repetitive, GREEDY, use_tqdm=False)
            runs[-1] += ([o.outputs[0].token_ids for o in out],)
            assert llm.engine.get_stats().spec_decode.num_draft_tokens > 0
    assert runs[0] == runs[1]


def test_an_expert_parallel_rank_reads_only_its_experts(make_model_dir, monkeypatch) -> None:
    """Rank 1 of 2 of qwen3_moe built in this process: its expert slots hold its experts' checkpoint
    weights, and no other expert's weights (nor any whole stacked expert tensor) were read."""
    from safetensors import safe_open

    from xengine.layers import checkpoint_tensor
    from xengine.models.loader import load_model
    from xengine.parallel.state import ExpertParallel, set_expert_parallel
    from xengine.parallel.tensor import TensorParallel, set_tensor_parallel

    model_dir = make_model_dir("qwen3_moe")
    read: list[tuple[str, tuple]] = []
    real_narrow, real_whole = checkpoint_tensor.LazyTensor.narrow, checkpoint_tensor.LazyTensor.materialize
    monkeypatch.setattr(
        checkpoint_tensor.LazyTensor, "narrow",
        lambda self, dim, start, n: read.append((self.name, (dim, start, n))) or real_narrow(self, dim, start, n),
    )  # fmt: skip
    monkeypatch.setattr(
        checkpoint_tensor.LazyTensor,
        "materialize",
        lambda self: read.append((self.name, ())) or real_whole(self),
    )
    set_expert_parallel(ExpertParallel(rank=1, world_size=2, group=None, control_group=None))
    set_tensor_parallel(TensorParallel(rank=1, size=2, comm=None))
    try:
        model = load_model(str(model_dir), torch.float32, torch.device("cpu"), pack=False)
    finally:
        set_tensor_parallel(None)
        set_expert_parallel(None)
    moe = next(m for m in model.modules() if type(m).__name__ == "FusedExperts")
    local = moe.shard.local
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if ".experts." in n and n.startswith("model.layers.")]
        layer = sorted({n.split(".experts")[0] for n in names})[0]
        fused = f"{layer}.experts.down_proj"
        if fused in f.keys():
            full = f.get_tensor(fused)
            for slot, expert in enumerate(local):
                assert torch.equal(moe.down_proj[slot], full[expert])
        else:
            for slot, expert in enumerate(local):
                assert torch.equal(
                    moe.down_proj[slot], f.get_tensor(f"{layer}.experts.{expert}.down_proj.weight")
                )
    for name, how in read:
        if ".experts." not in name:
            continue
        if name.endswith(".weight"):  # one expert's tensor: read only where that expert lives
            assert int(name.split(".experts.")[1].split(".")[0]) in local, name
        else:  # every expert stacked: only the local experts' rows
            assert how and how[0] == 0 and how[1] in local, (name, how)
