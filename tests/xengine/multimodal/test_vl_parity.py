"""Vision-language models (Qwen2-VL, Qwen2.5-VL) through ``LLM.chat``: greedy tokens identical to HF.

Conversations with 0, 1 and 2 images of different sizes (56x56: 4 image tokens; 84x112: 12), under
prefix caching on/off, chunked prefill whose 8-token budget splits an image across steps, async
scheduling, partial graphs (the text path; image steps run eagerly) and a KV pool small enough to
force preemption (recompute rebuilds the image embeddings and M-RoPE positions). The image-embedding
cache and the prefix cache key on image content: a repeated image is encoded once and hits the
prefix cache; another image of the same size behind the same text never does.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.xengine.vl_oracle import VL_ARCHS, VLOracle, random_image, user_turn
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

MAX_TOKENS = 12
SMALL = random_image(56, 56, seed=1)
WIDE = random_image(84, 112, seed=2)
WIDE_OTHER = random_image(84, 112, seed=3)

# (messages, images in order): 0, 1 and 2 images; a multi-turn one with the wide image again
CONVERSATIONS: list[tuple[list[dict[str, Any]], list[Any]]] = [
    ([{"role": "user", "content": "Tell me about the weather in the mountains."}], []),
    ([user_turn(WIDE, "What is in this picture?")], [WIDE]),
    ([user_turn("Compare", SMALL, "with", WIDE, "please.")], [SMALL, WIDE]),
    (
        [
            {"role": "system", "content": "You describe images."},
            user_turn(SMALL, "Describe it."),
            {"role": "assistant", "content": "A square of noise."},
            user_turn("And this one?", WIDE),
        ],
        [SMALL, WIDE],
    ),
]
CONFIGS: dict[str, dict[str, Any]] = {
    "prefix+chunked": dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=8),
    "noprefix+whole": dict(
        enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=512
    ),
    "async+prefix+chunked": dict(async_scheduling=True, max_num_batched_tokens=8),
    "async+partial": dict(async_scheduling=True, graph_mode="partial", graph_batch_sizes="4"),
    # 32 blocks of 4 tokens; the four prompts (25-79 tokens) with their outputs need about 55
    "preempt": dict(num_blocks=32, max_num_batched_tokens=16),
    # the encode stage (``xengine/multimodal/encode_stage.py``): one image per encode step, encodes on a
    # second thread beside decodes, with async scheduling; and the inline (FCFS) baseline
    "stage-one-image+overlap": dict(max_encode_images=1, max_encode_tokens=1, encode_overlap="on"),
    "async+stage-one-image": dict(async_scheduling=True, max_encode_images=1, encode_overlap="on"),
    "inline+chunked": dict(encode_scheduling="inline", max_num_batched_tokens=8),
}
CASES = [(arch, name) for arch in VL_ARCHS for name in CONFIGS]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def oracle(make_model_dir):
    cache: dict[str, VLOracle] = {}

    def _get(arch: str) -> VLOracle:
        if arch not in cache:
            cache[arch] = VLOracle(make_model_dir(arch))
        return cache[arch]

    return _get


@pytest.fixture(scope="module")
def reference(oracle):
    """Per arch: HF's greedy tokens for ``CONVERSATIONS``."""
    cache: dict[str, list[list[int]]] = {}

    def _get(arch: str) -> list[list[int]]:
        if arch not in cache:
            cache[arch] = [oracle(arch).greedy(m, images, MAX_TOKENS) for m, images in CONVERSATIONS]
        return cache[arch]

    return _get


@pytest.mark.parametrize(("arch", "config"), CASES, ids=[f"{a}-{c}" for a, c in CASES])
def test_chat_with_images_matches_hf(make_model_dir, reference, arch, config):
    expected = reference(arch)
    kw = CONFIGS[config]
    llm = LLM(str(make_model_dir(arch)), block_size=4, **kw)
    for run in range(2):  # the second meets warm prefix and image-embedding caches
        outputs = llm.chat([m for m, _ in CONVERSATIONS], GREEDY, use_tqdm=False)
        for i, (out, tokens) in enumerate(zip(outputs, expected)):
            assert out.outputs[0].token_ids == tokens, f"run {run}, conversation {i}"
    stats = llm.engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_image_encodes == 2  # two distinct images, each encoded once for all 12 uses
    assert stats.async_scheduling == bool(kw.get("async_scheduling"))
    if kw.get("enable_prefix_caching", True):
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == 0
    if config == "preempt":
        assert stats.num_preemptions > 0
    if kw.get("graph_mode") == "partial":  # the text-only decode steps ran through the graph
        assert stats.graph.num_replays > 0 and stats.graph.num_recompiles_after_warmup == 0
    assert llm.engine.runner.images.num_held == 0  # nothing kept past the requests' prefills


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_repeated_image_is_encoded_once_and_hits_the_prefix_cache(make_model_dir, oracle, arch):
    llm = LLM(str(make_model_dir(arch)), block_size=4, enable_prefix_caching=True)
    messages = [user_turn(WIDE, "What is in this picture?")]
    first = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    second = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    stats = llm.engine.get_stats()
    assert stats.num_image_encodes == 1
    assert (
        first.outputs[0].token_ids
        == second.outputs[0].token_ids
        == oracle(arch).greedy(messages, [WIDE], MAX_TOKENS)
    )
    image_end = first.prompt_token_ids.index(llm._images.image_token_id) + 12  # the wide image's 12 pads
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= image_end // 4 * 4  # every whole block through the image


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_different_images_of_one_size_never_share_cache(make_model_dir, oracle, arch):
    """Same text, same pad tokens, other pixels: no prefix hit past the text before the image, no
    image-cache hit, and each output is HF's for its own image."""
    llm = LLM(str(make_model_dir(arch)), block_size=4, enable_prefix_caching=True)
    convs = [[user_turn("Look:", image, "What is it?")] for image in (WIDE, WIDE_OTHER)]
    outs = [llm.chat(c, GREEDY, use_tqdm=False)[0] for c in convs]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids  # identical token ids ...
    image_start = outs[0].prompt_token_ids.index(llm._images.image_token_id)
    assert outs[1].num_cached_tokens <= image_start  # ... but the image blocks did not match
    stats = llm.engine.get_stats()
    assert stats.num_image_encodes == 2 and stats.num_image_cache_hits == 0
    for out, conv, image in zip(outs, convs, (WIDE, WIDE_OTHER)):
        assert out.outputs[0].token_ids == oracle(arch).greedy(conv, [image], MAX_TOKENS)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_same_image_in_two_requests_of_one_batch(make_model_dir, oracle):
    """Two requests with the same image scheduled together: one encode, the other a cache hit."""
    llm = LLM(str(make_model_dir("qwen2_vl")), block_size=4, enable_prefix_caching=False)
    convs = [[user_turn(SMALL, "First question?")], [user_turn("Second:", SMALL)]]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.num_image_encodes == 1 and stats.num_image_cache_hits == 1
    for out, conv in zip(outs, convs):
        assert out.outputs[0].token_ids == oracle("qwen2_vl").greedy(conv, [SMALL], MAX_TOKENS)
