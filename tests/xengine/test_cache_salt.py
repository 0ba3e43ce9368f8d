"""vLLM's ``cache_salt``: requests share prefix-cache blocks only with requests of the same salt (and
the same LoRA adapter); unsalted requests never hit salted blocks."""

from __future__ import annotations

from xengine.api.image_keys import cache_token_ids, salted_key
from xengine.api.messages import AddRequest
from xengine.api.sampling_params import SamplingParams
from xengine.engine import Engine
from xengine.llm import engine_config

PROMPT = [5 + (i * 37) % 1900 for i in range(40)]  # two whole blocks of 16 reusable


def _cached(engine: Engine, req_id: str, salt: str | None) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=2, cache_salt=salt)
    engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=PROMPT, params=params))
    cached = 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            cached = max(cached, d.num_cached_tokens)
    return cached


def test_salts_keep_prefixes_apart(tiny_qwen3) -> None:
    engine = Engine(engine_config(str(tiny_qwen3), num_blocks=64, block_size=16, async_scheduling="off"))
    try:
        assert _cached(engine, "a1", "tenant-a") == 0
        assert _cached(engine, "b1", "tenant-b") == 0  # another salt: nothing shared
        assert _cached(engine, "n1", None) == 0  # unsalted: nothing shared with the salted ones
        assert _cached(engine, "a2", "tenant-a") == 32  # the same salt: its own blocks
        assert _cached(engine, "n2", None) == 32
    finally:
        engine.shutdown()


def test_the_service_keys_prompts_as_the_engine() -> None:
    keyed = cache_token_ids(PROMPT, None, "adapter", "salt")
    assert keyed[1:] == PROMPT[1:] and keyed[0] == salted_key(PROMPT[0], "adapter", "salt") < -(2**62)
    assert cache_token_ids(PROMPT, None) == PROMPT
    assert len({salted_key(5, a, s) for a in (None, "x") for s in (None, "", "y")}) == 6
