"""LoRA adapters against HF + PEFT (fp32, the adapter applied unmerged): greedy tokens identical for
three adapters of different ranks and target modules on Qwen3 and Llama, in one batch with base-model
requests, in every engine mode a user combines with LoRA (async or not, chunked prefill, preemption,
prefix caching, adapters evicted and reloaded, partial graphs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xengine.api.messages import AddRequest
from xengine.api.sampling_params import SamplingParams
from xengine.engine import Engine
from xengine.llm import engine_config
from xengine.tools.make_lora import make_lora

MAX_TOKENS = 10
# (name, rank, targets, rslora): ranks 8 / 4 / 16, attention only, MLP only, both
ADAPTERS = (
    ("attn8", 8, ("q_proj", "k_proj", "v_proj", "o_proj"), False),
    ("mlp4", 4, ("gate_proj", "up_proj", "down_proj"), True),
    ("mixed16", 16, ("q_proj", "v_proj", "o_proj", "down_proj"), False),
)
# the mixed batch: base-model requests among each adapter's
NAMES = (None, "attn8", "mlp4", "mixed16", "attn8", None, "mixed16")


def _prompts() -> list[list[int]]:
    return [[3 + (i * 131 + j * 17) % 1900 for j in range(18 + 5 * i)] for i in range(len(NAMES))]


class _Oracle:
    """HF + PEFT greedy tokens per (adapter, prompt), computed once."""

    def __init__(self, base: Path, adapters: dict[str, Path]) -> None:
        self.base, self.adapters, self.cache = base, adapters, {}

    @torch.no_grad()
    def greedy(self, name: str | None, prompt: list[int]) -> list[int]:
        key = (name, tuple(prompt))
        if key not in self.cache:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32)
            if name is not None:
                model = PeftModel.from_pretrained(model, self.adapters[name])
            model.eval()
            model.generation_config.eos_token_id = None
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS)
            self.cache[key] = out[0, len(prompt) :].tolist()
        return self.cache[key]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def setup(
    request: pytest.FixtureRequest, make_model_dir, tmp_path_factory
) -> tuple[Path, dict[str, Path], _Oracle]:
    base = make_model_dir(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = {
        name: make_lora(base, root / name, rank, targets, seed=i, rslora=rslora)
        for i, (name, rank, targets, rslora) in enumerate(ADAPTERS)
    }
    return base, adapters, _Oracle(base, adapters)


def _engine(base: Path, adapters: dict[str, Path], **fields) -> Engine:
    modules = tuple(f"{n}={p}" for n, p in adapters.items())
    fields = {"max_loras": 3, "num_blocks": 256, "block_size": 16, **fields}
    return Engine(engine_config(base, enable_lora=True, lora_modules=modules, **fields))


def _run(
    engine: Engine, prompts: list[list[int]], names: tuple[str | None, ...], tag: str = ""
) -> dict[int, list[int]]:
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, lora_name=name)
        engine.add_request(AddRequest(req_id=f"{tag}{i}", prompt_token_ids=prompt, params=params))
    out: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None, delta.error
            out.setdefault(int(delta.req_id.removeprefix(tag)), []).extend(delta.new_token_ids)
    return out


def _check(
    oracle: _Oracle, prompts: list[list[int]], names: tuple[str | None, ...], got: dict[int, list[int]]
) -> None:
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        assert got[i] == oracle.greedy(name, prompt), f"request {i} (adapter {name})"


MODES = {
    "sync": {"async_scheduling": "off"},
    "async": {"async_scheduling": "on"},
    "chunked": {"max_num_batched_tokens": 16, "async_scheduling": "off"},
    "preemption": {"num_blocks": 20, "block_size": 4, "async_scheduling": "on"},
    "xtensor": {"kv_layout": "xtensor", "num_blocks": None, "block_size": None, "kv_cache_memory_gb": 0.25},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_mixed_batch_matches_hf_peft(setup, mode: str) -> None:
    base, adapters, oracle = setup
    engine = _engine(base, adapters, **MODES[mode])
    try:
        prompts = _prompts()
        _check(oracle, prompts, NAMES, _run(engine, prompts, NAMES))
        if mode == "preemption":
            assert engine.get_stats().num_preemptions > 0
    finally:
        engine.shutdown()


def test_adapters_change_the_tokens(setup) -> None:
    """The oracle itself: each adapter's tokens differ from the base model's (else parity proves nothing)."""
    _, _, oracle = setup
    prompt = _prompts()[0]
    base_tokens = oracle.greedy(None, prompt)
    for name, *_ in ADAPTERS:
        assert oracle.greedy(name, prompt) != base_tokens, name


def test_prefix_cache_is_per_adapter(setup) -> None:
    """The same prompt under every adapter and the base model, twice: the second round hits each one's
    own cached blocks and never another's."""
    base, adapters, oracle = setup
    engine = _engine(base, adapters, async_scheduling="off")
    try:
        prompt = _prompts()[-1]
        names = (None, "attn8", "mlp4", "mixed16")
        first = _run(engine, [prompt] * 4, names, "a")
        hits = engine.get_stats().prefix_cache_hits
        assert hits == 0  # one prompt, four caches: nothing shared between adapters
        second = _run(engine, [prompt] * 4, names, "b")
        assert engine.get_stats().prefix_cache_hits - hits == 4 * ((len(prompt) - 1) // 16) * 16
        _check(oracle, [prompt] * 4, names, first)
        _check(oracle, [prompt] * 4, names, second)
    finally:
        engine.shutdown()


def test_adapters_evicted_and_reloaded(setup) -> None:
    """One device slot and one host copy for three adapters: each is evicted and read again from its
    folder mid-run, with the same tokens."""
    base, adapters, oracle = setup
    engine = _engine(base, adapters, max_loras=1, max_cpu_loras=1, async_scheduling="on")
    try:
        prompts = _prompts()
        for tag in "ab":  # the second round brings each adapter back
            _check(oracle, prompts, NAMES, _run(engine, prompts, NAMES, tag))
        assert engine.lora.num_slot_loads > 3  # an adapter came back into the slot after eviction
        assert engine.lora.num_disk_loads > 3  # and from disk after leaving the host cache
    finally:
        engine.shutdown()


def test_unknown_adapter_is_refused(setup) -> None:
    base, adapters, _ = setup
    engine = _engine(base, adapters)
    try:
        params = SamplingParams(max_tokens=2, lora_name="nope")
        with pytest.raises(ValueError, match="'model'.*'nope'"):
            engine.add_request(AddRequest(req_id="x", prompt_token_ids=[5, 6], params=params))
    finally:
        engine.shutdown()


def test_partial_graphs(make_model_dir, tmp_path) -> None:
    """Compiled partial graphs read the slots as they are when a step runs (adapters load after capture)."""
    base = make_model_dir("qwen3")
    adapters = {
        name: make_lora(base, tmp_path / name, rank, targets, seed=i, rslora=rslora)
        for i, (name, rank, targets, rslora) in enumerate(ADAPTERS)
    }
    oracle = _Oracle(base, adapters)
    engine = _engine(base, adapters, graph_mode="partial")
    try:
        prompts = _prompts()
        _check(oracle, prompts, NAMES, _run(engine, prompts, NAMES))
        assert engine.runner.graph.stats.num_replays > 0
    finally:
        engine.shutdown()


def test_offline_llm_lora_request(setup) -> None:
    """vLLM's offline API: ``LLM(..., enable_lora=True).generate(prompts, params, lora_request=...)``,
    the adapter registered on first use, one per prompt or one for all."""
    from xengine import LLM, LoRARequest

    base, adapters, oracle = setup
    llm = LLM(str(base), enable_lora=True, max_loras=2, num_blocks=128, block_size=16)
    try:
        prompts = _prompts()[:3]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        one = LoRARequest("attn8", 1, str(adapters["attn8"]))
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=one)
        assert [list(o.outputs[0].token_ids) for o in outs] == [oracle.greedy("attn8", p) for p in prompts]
        each = [None, LoRARequest("mlp4", 2, str(adapters["mlp4"])), one]
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=each)
        want = [oracle.greedy(n, p) for n, p in zip((None, "mlp4", "attn8"), prompts)]
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert params.lora_name is None  # the caller's params are left as they were
    finally:
        llm.shutdown()


def test_moe_attention_projections(make_model_dir, tmp_path) -> None:
    """A MoE model (Qwen3-MoE): adapters on its attention projections, mixed with the base model."""
    base = make_model_dir("qwen3_moe")
    adapters = {"attn8": make_lora(base, tmp_path / "attn8", 8, ("q_proj", "k_proj", "v_proj", "o_proj"))}
    oracle = _Oracle(base, adapters)
    engine = _engine(base, adapters, max_loras=1)
    try:
        prompts, names = _prompts()[:4], (None, "attn8", None, "attn8")
        _check(oracle, prompts, names, _run(engine, prompts, names))
        assert oracle.greedy("attn8", prompts[1]) != oracle.greedy(None, prompts[1])
    finally:
        engine.shutdown()


def test_vanished_folder_never_stops_a_step(setup, tmp_path) -> None:
    """Adapters are read when their requests arrive and kept in host memory while any request of them
    is in the engine: their folders deleted mid-run, the running requests finish with the right tokens;
    a later request of an adapter no longer in memory is refused (a ValueError naming 'model')."""
    import shutil

    base, adapters, oracle = setup
    copies = {n: Path(shutil.copytree(adapters[n], tmp_path / n)) for n in ("attn8", "mlp4")}
    engine = _engine(base, copies, max_loras=1, max_cpu_loras=1, async_scheduling="on")
    try:
        prompts, names = _prompts()[:4], ("attn8", "mlp4", "attn8", "mlp4")
        for i, (prompt, name) in enumerate(zip(prompts, names)):
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, lora_name=name)
            engine.add_request(AddRequest(req_id=str(i), prompt_token_ids=prompt, params=params))
        for folder in copies.values():
            shutil.rmtree(folder)
        got: dict[int, list[int]] = {}
        while engine.has_unfinished_requests():
            for d in engine.step():
                assert d.error is None, d.error
                got.setdefault(int(d.req_id), []).extend(d.new_token_ids)
        _check(oracle, prompts, names, got)
        engine.lora.register("mixed16", str(adapters["mixed16"]))  # pushes the idle ones out of memory
        gone = next(n for n in copies if n not in engine.lora.host)
        with pytest.raises(ValueError, match="'model'.*not found"):
            params = SamplingParams(max_tokens=2, lora_name=gone)
            engine.add_request(AddRequest(req_id="late", prompt_token_ids=[5, 6], params=params))
    finally:
        engine.shutdown()


def test_beam_search_and_embeddings_under_an_adapter(make_model_dir, tmp_path) -> None:
    """Beam search equals HF + PEFT ``generate(num_beams=2)``; an embedding (last token, normalised)
    equals HF + PEFT's last hidden state: both run the adapter's layers."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from xengine.api.messages import PoolingParams

    base = make_model_dir("qwen3")
    path = make_lora(base, tmp_path / "a", 8, ("q_proj", "v_proj", "o_proj", "down_proj"), seed=5)
    prompt = _prompts()[2]
    hf = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), path
    ).eval()
    with torch.no_grad():
        beams = hf.generate(
            torch.tensor([prompt]), num_beams=2, num_return_sequences=2, do_sample=False, max_new_tokens=6,
            eos_token_id=None, pad_token_id=0,
        )[:, len(prompt) :].tolist()  # fmt: skip
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
    engine = _engine(base, {"a": path}, max_loras=1, async_scheduling="off")
    try:
        params = SamplingParams(
            n=2, use_beam_search=True, beam_width=2, max_tokens=6, ignore_eos=True, lora_name="a"
        )
        engine.add_request(AddRequest(req_id="beam", prompt_token_ids=prompt, params=params))
        embed = SamplingParams(max_tokens=0, lora_name="a")
        engine.add_request(
            AddRequest(req_id="emb", prompt_token_ids=prompt, params=embed, pooling=PoolingParams())
        )
        seqs: dict[int, list[int]] = {}
        vector = None
        while engine.has_unfinished_requests():
            for d in engine.step():
                assert d.error is None, d.error
                if d.req_id == "beam":
                    seqs.setdefault(d.index, []).extend(d.new_token_ids)
                elif d.embedding is not None:
                    vector = torch.tensor(d.embedding)
        assert [seqs[0], seqs[1]] == beams
        assert torch.allclose(vector, torch.nn.functional.normalize(hidden, dim=0), atol=1e-5)
    finally:
        engine.shutdown()
