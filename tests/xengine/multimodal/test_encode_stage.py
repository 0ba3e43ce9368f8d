"""The encode stage (``xengine/multimodal/encode_stage.py``, HydraInfer's Algorithm 1) on a real
engine with a tiny Qwen2-VL checkpoint: the plans it schedules follow the stage-level rules, its
outputs equal the inline (FCFS) engine's (which equal HF's, ``test_vl_parity.py``), encode-only
requests leave the embeddings in the instance cache, and a request skips the stage when its images are
cached or its prompt is in the prefix cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.xengine.vl_oracle import random_image, user_turn
from xengine.api.messages import AddRequest, SamplingParams
from xengine.llm import LLM
from xengine.multimodal.image_cache import _pixels

SMALL = random_image(56, 56, seed=11)  # 4 image tokens
WIDE = random_image(84, 112, seed=12)  # 12 image tokens
OTHER = random_image(56, 84, seed=13)  # 6 image tokens
CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a long story about the sea and the mountains."}],
    [user_turn(WIDE, "What is in this picture?")],
    [user_turn("Compare", SMALL, "with", OTHER, "please.")],
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
]


@pytest.fixture(scope="module")
def vl_dir(make_model_dir):
    return make_model_dir("qwen2_vl")


@pytest.fixture(scope="module")
def expected(vl_dir):
    """The inline (FCFS) engine's greedy tokens: identical to HF's (``test_vl_parity.py``)."""
    llm = LLM(str(vl_dir), block_size=4, encode_scheduling="inline", enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.chat(CONVERSATIONS, PARAMS, use_tqdm=False)]


def _record_plans(llm: LLM) -> list[dict[str, Any]]:
    """Observe every plan the scheduler makes (what it scheduled, before the step runs)."""
    sched = llm.engine.scheduler
    schedule, plans = sched.schedule, []

    def recording():
        plan = schedule()
        plans.append(
            {
                "prefill": [
                    s.req.req_id
                    for s in plan.seqs
                    if s.num_new_tokens > 1 or s.req.num_computed_tokens < s.req.num_prompt_tokens
                ],
                "decode": [
                    s.req.req_id
                    for s in plan.seqs
                    if s.num_new_tokens == 1 and s.req.num_computed_tokens >= s.req.num_prompt_tokens
                ],
                "encodes": [(j.req.req_id, [im.content_hash for im in j.images]) for j in plan.encodes],
                "image_tokens": sum(im.length for j in plan.encodes for im in j.images),
            }
        )
        return plan

    sched.schedule = recording
    return plans


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stage_level_batching_rules(vl_dir, expected, async_scheduling):
    """Decodes ride every step; a step with a prefill chunk carries no encode; an encode step carries
    at most ``max_encode_images`` images within ``max_encode_tokens`` (a larger image alone); an image
    request prefills only once all its images are encoded; the tokens equal the inline engine's."""
    llm = LLM(
        str(vl_dir),
        block_size=4,
        max_num_batched_tokens=8,
        max_encode_images=1,
        max_encode_tokens=8,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
        encode_overlap="on",
    )
    plans = _record_plans(llm)
    outputs = llm.chat(CONVERSATIONS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    text_id, wide_id, pair_id = (o.request_id for o in outputs)
    encode_steps = [p for p in plans if p["encodes"]]
    assert len(encode_steps) == 3  # three images, one per step
    for p in encode_steps:
        assert not p["prefill"], p
        assert sum(len(h) for _, h in p["encodes"]) == 1
        assert p["image_tokens"] <= 8 or len(p["encodes"]) == 1  # the 12-token image runs alone
    assert any(p["encodes"] and text_id in p["decode"] for p in plans)  # decodes go on while encoding
    for req_id, num_images in ((wide_id, 1), (pair_id, 2)):
        first_prefill = next(i for i, p in enumerate(plans) if req_id in p["prefill"])
        encoded_at = [i for i, p in enumerate(plans) for r, h in p["encodes"] if r == req_id for _ in h]
        assert len(encoded_at) == num_images and max(encoded_at) < first_prefill
    stats = llm.engine.get_stats()
    assert stats.num_encode_steps == 3 and stats.num_image_encodes == 3
    assert llm.engine.runner.images.num_held == 0


def test_encode_only_requests_fill_the_instance_cache(vl_dir):
    """EPD's encode instance: ``encode_only`` finishes "encoded" with no tokens and leaves the
    embeddings (equal to the vision tower's own output) cached; a repeat encodes nothing; a normal
    request for that image then skips the stage."""
    llm = LLM(str(vl_dir), block_size=4, enable_prefix_caching=False)
    engine = llm.engine
    prompt = llm._images.build(llm.tokenizer, [user_turn(WIDE, "Describe.")])
    req = dict(prompt_token_ids=prompt.token_ids, params=SamplingParams(max_tokens=0), images=prompt.images)
    engine.add_request(AddRequest(req_id="e1", encode_only=True, **req))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [(d.req_id, d.finish_reason, d.new_token_ids) for d in deltas if d.finish_reason] == [
        ("e1", "encoded", [])
    ]
    image = prompt.images[0]
    cached = engine.runner.images.get(image.content_hash)
    direct = engine.model.encode_images(_pixels(image), [tuple(image.grid_thw)])
    assert cached is not None and torch.equal(cached, direct)
    stats = engine.get_stats()
    assert (stats.num_image_encodes, stats.num_encode_steps) == (1, 1)

    engine.add_request(AddRequest(req_id="e2", encode_only=True, **req))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert (stats.num_image_encodes, stats.num_image_cache_hits) == (1, 1)

    out = llm.chat(
        [user_turn(WIDE, "Describe.")], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4
    stats = engine.get_stats()
    assert (stats.num_image_encodes, stats.num_encode_steps) == (1, 2)  # no stage for it
    assert engine.runner.images.num_held == 0


def test_prefix_cache_hit_skips_the_stage(vl_dir):
    """A prompt whose image pads are all in the prefix cache needs no embeddings: even with the
    image cache emptied, the repeat encodes nothing and gives the same tokens."""
    llm = LLM(str(vl_dir), block_size=4)
    conv = [user_turn(SMALL, "What is this? Tell me in a few words please.")]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.chat(conv, params, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.runner.images.clear()
    before = llm.engine.get_stats()
    again = llm.chat(conv, params, use_tqdm=False)[0].outputs[0].token_ids
    after = llm.engine.get_stats()
    assert again == first
    assert (after.num_image_encodes, after.num_encode_steps) == (
        before.num_image_encodes,
        before.num_encode_steps,
    )


def test_abort_in_the_encode_stage_leaves_nothing(vl_dir):
    llm = LLM(str(vl_dir), block_size=4, max_encode_images=1)
    engine = llm.engine
    prompt = llm._images.build(llm.tokenizer, [user_turn(SMALL, "and", OTHER, "?")])
    engine.add_request(
        AddRequest(
            req_id="a",
            prompt_token_ids=prompt.token_ids,
            params=SamplingParams(max_tokens=4),
            images=prompt.images,
        )
    )
    engine.step()  # encodes the first image
    engine.abort_requests(["a"])
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [(d.req_id, d.finish_reason) for d in deltas if d.finish_reason] == [("a", "abort")]
    assert engine.runner.images.num_held == 0 and not engine.scheduler.waiting
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_a_failing_encode_fails_only_its_request(vl_dir):
    """The encoder raising for one image fails that request (finish_reason "error"); the others in
    the step go on."""
    llm = LLM(str(vl_dir), block_size=4, max_encode_images=4)
    images = llm.engine.runner.images
    encode = images.encode

    def flaky(patches, grids):
        if any(tuple(g) == (1, 4, 6) for g in grids):  # OTHER's grid
            raise RuntimeError("injected encoder failure")
        return encode(patches, grids)

    images.encode = flaky
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.chat([[user_turn(SMALL, "?")], [user_turn(OTHER, "?")]], params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4 and outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "error"
    assert images.num_held == 0


def test_encode_only_validation(vl_dir, make_model_dir):
    llm = LLM(str(vl_dir), block_size=4)
    prompt = llm._images.build(llm.tokenizer, [user_turn(SMALL, "?")])
    base = dict(prompt_token_ids=prompt.token_ids, images=prompt.images, encode_only=True)
    with pytest.raises(ValueError, match="invalid value for 'encode_only'.*max_tokens=0"):
        llm.engine.add_request(AddRequest(req_id="x", params=SamplingParams(max_tokens=3), **base))
    with pytest.raises(ValueError, match="invalid value for 'encode_only'.*images"):
        llm.engine.add_request(
            AddRequest(
                req_id="y", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=0), encode_only=True
            )
        )
    inline = LLM(str(vl_dir), block_size=4, encode_scheduling="inline")
    with pytest.raises(ValueError, match="encode_scheduling 'stage'"):
        inline.engine.add_request(AddRequest(req_id="z", params=SamplingParams(max_tokens=0), **base))
    assert not llm.engine.has_unfinished_requests()
