"""The emulated accelerator (``--device emulated``): a real engine whose forward is a stand-in model of
one small KV layer (``xengine/models/emulated.py``) and whose steps take the time the device profile
predicts. Its pseudo tokens are deterministic and read the KV cache back (a prefix hit, a PD import
and a corrupted cache show in the tokens); sampling, stops and ``max_tokens`` run as on a real device;
what it cannot stand in for is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.xengine.conftest import assert_engine_idle, make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams

BASE_MS = 20.0
PROFILE = {"name": "test", "base_ms": BASE_MS, "tokens_ms": [[1, 0.0], [1024, 40.0]], "attention_ns": 50.0}


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("profile") / "p.json"
    path.write_text(json.dumps({**PROFILE, "kv_capacity_tokens": 4096}))
    return str(path)


@pytest.fixture(scope="module")
def model(make_model_dir) -> Path:
    return make_model_dir("qwen3")


def _emulated(model: Path, profile: str, **kw):
    return make_engine(model, device="emulated", device_profile=profile, block_size=16, seed=0, **kw)


def _generate(engine, req_id: str, prompt: list[int], **params) -> list[int]:
    p = SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **params})
    engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=p))
    return [t for d in run_to_completion(engine) if d.req_id == req_id for t in d.new_token_ids]


def test_each_step_is_given_the_profiles_prediction_of_its_shape(model, profile) -> None:
    """The runner hands the platform each step's shape; the platform predicts (and waits out) exactly
    the profile's time of that shape. How closely real steps follow it: benchmarks/cluster_sim/validate."""
    engine = _emulated(model, profile)
    assert engine.kv.pool.num_blocks == 4096 // 16  # the profile's capacity
    for i, prompt in enumerate(random_prompts([300, 40, 5], seed=1)):
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        engine.add_request(AddRequest(req_id=f"r{i}", prompt_token_ids=prompt, params=params))
    seen = []
    platform = engine.platform
    original = platform.emulate_step

    def record(query_lens, seq_lens, started):
        seen.append((list(query_lens), list(seq_lens)))
        original(query_lens, seq_lens, started)
        assert platform.last_predicted_s == platform.profile.step_seconds(query_lens, seq_lens)

    platform.emulate_step = record
    while engine.has_unfinished_requests():
        engine.step()
    assert len(seen) == platform.num_steps >= 8
    assert seen[0] == ([300, 40, 5], [300, 40, 5])  # the three prompts in one step
    assert ([1, 1, 1], [301, 41, 6]) in seen  # then one token each on their contexts


def test_pseudo_tokens_are_deterministic_and_read_the_kv_back(model, profile) -> None:
    a, b = _emulated(model, profile), _emulated(model, profile)
    prompt = random_prompts([70], seed=2)[0]
    first = _generate(a, "a1", prompt)
    assert first == _generate(b, "b1", prompt)  # another instance, the same tokens
    assert len(set(first)) > 3  # not one token over and over
    free = a.kv.num_free_blocks
    again = _generate(a, "a2", prompt)  # the prompt's blocks from the prefix cache
    assert again == first and a.get_stats().prefix_cache_hits >= 64
    for cache in a.kv_setup.kv_caches:  # the cached blocks now hold garbage: the hit reads it
        cache.fill_(7.0)
    assert _generate(a, "a3", prompt) != first
    sampled = [_generate(a, f"s{i}", prompt, temperature=1.0, seed=i) for i in range(4)]
    assert len({tuple(s) for s in sampled}) > 1 and sampled[0] == _generate(
        a, "s0b", prompt, temperature=1.0, seed=0
    )
    stop = first[5]
    assert _generate(b, "stop", prompt, stop_token_ids=[stop], ignore_eos=False) == first[:6]
    assert_engine_idle(a, free)


def test_pd_between_emulated_instances_moves_the_blocks_the_tokens_read(model, profile) -> None:
    pytest.importorskip("mooncake.engine")
    prefill, decode, colocated = (_emulated(model, profile) for _ in range(3))
    prompt = random_prompts([100], seed=3)[0]
    expected = _generate(colocated, "c", prompt)
    first = _generate(prefill, "p", prompt, max_tokens=1)
    source = prefill.kv_export("x", prompt, first[0])
    result = decode.kv_import(source, prompt, "d", first[0])
    assert result.num_transferred_blocks == 100 // 16 and result.num_bytes > 0
    assert prefill.kv_release("x")
    assert first + _generate(decode, "d", prompt + first, max_tokens=11) == expected


def test_what_it_cannot_stand_in_for_is_refused(model, profile, tmp_path) -> None:
    with pytest.raises(ValueError, match="needs a device profile"):
        make_engine(model, device="emulated")
    with pytest.raises(ValueError, match="does not emulate speculative_config.method eagle"):
        _emulated(
            model,
            profile,
            speculative_config={"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="does not emulate cache.kv_cache_dtype"):
        _emulated(model, profile, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="for --device emulated"):
        make_engine(model, device_profile=profile)
    assert _emulated(model, profile, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
