"""EPD's image-embedding transfer between two real engines over a real Mooncake transfer engine (TCP).

The encode engine's image cache holds an image's embeddings; ``export`` pins a copy in its registered
staging buffer, the prefill engine's ``import_`` pulls it with one-sided reads into its own image
cache, and its prefill of the same chat then encodes nothing and gives the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.xengine.vl_oracle import random_image, user_turn
from xengine.api.image_keys import cache_token_ids, image_cache_key
from xengine.api.messages import SamplingParams
from xengine.disagg.embed_transfer import ALIGN, EmbedTransferManager, StagingAllocator
from xengine.llm import LLM
from xengine.multimodal import request_images

pytest.importorskip("mooncake.engine")

SMALL = random_image(56, 56, seed=1)
WIDE = random_image(84, 112, seed=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(make_model_dir):
    model = str(make_model_dir("qwen2_vl"))
    encode, prefill = LLM(model, block_size=4), LLM(model, block_size=4)
    managers = [
        EmbedTransferManager(llm.engine.runner.images, llm.engine.kv_transfer.start, staging_bytes=1 << 20)
        for llm in (encode, prefill)
    ]
    return encode, prefill, managers[0], managers[1]


def test_imported_embeddings_spare_the_prefill_its_encodes(pair) -> None:
    encode, prefill, exporter, importer = pair
    messages = [user_turn("Compare", SMALL, "with", WIDE)]
    on_encoder = encode.chat(messages, GREEDY, use_tqdm=False)[0]
    assert encode.engine.get_stats().num_image_encodes == 2
    hashes = sorted(encode.engine.runner.images.hashes())
    info = exporter.export("x1", [*hashes, "0" * 64])
    assert [e.content_hash for e in info.entries] == hashes and info.missing == ["0" * 64]
    result = importer.import_(info)
    assert result.num_images == 2 and result.num_hit_images == 0
    assert result.num_bytes == sum(e.num_bytes for e in info.entries) > 0
    for h in hashes:
        assert torch.equal(prefill.engine.runner.images.get(h), encode.engine.runner.images.get(h))
    assert exporter.release("x1") and not exporter.release("x1")
    assert importer.import_(info).num_hit_images == 2  # already cached: nothing pulled
    on_prefill = prefill.chat(messages, GREEDY, use_tqdm=False)[0]
    stats = prefill.engine.get_stats()
    assert stats.num_image_encodes == 0 and stats.num_image_cache_hits == 2
    assert on_prefill.outputs[0].token_ids == on_encoder.outputs[0].token_ids
    assert exporter.num_pins == 0 and exporter._alloc.num_free_bytes == exporter.staging_bytes  # noqa: SLF001


def test_staging_full_is_an_error_and_frees_what_it_took(pair) -> None:
    encode, _, exporter, _ = pair
    encode.chat([user_turn("Compare", SMALL, "with", WIDE)], GREEDY, use_tqdm=False)  # (or cached)
    hashes = sorted(exporter.images.hashes())
    assert hashes
    small = EmbedTransferManager(exporter.images, exporter._agent_fn, staging_bytes=ALIGN)  # noqa: SLF001
    with pytest.raises(RuntimeError, match="staging buffer full"):
        small.export("x2", hashes)
    assert small.num_pins == 0 and small._alloc.num_free_bytes == ALIGN  # noqa: SLF001


def test_staging_allocator_reuses_and_merges_ranges() -> None:
    alloc = StagingAllocator(4 * ALIGN)
    a, b, c = alloc.allocate(ALIGN), alloc.allocate(2 * ALIGN - 1), alloc.allocate(1)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and alloc.allocate(1) is None
    alloc.free(a, ALIGN)
    alloc.free(b, 2 * ALIGN - 1)
    assert alloc.allocate(3 * ALIGN) == 0  # the two freed neighbours merged into one range


def test_service_side_cache_keys_equal_the_engines() -> None:
    h = "ab" * 32
    assert image_cache_key(h) == request_images.image_cache_key(h) < 0

    class _Im:  # what cache_token_ids reads of an ImageInput
        content_hash, offset, length = h, 1, 2

    assert cache_token_ids([5, 9, 9, 6], [_Im()]) == [5, image_cache_key(h), image_cache_key(h), 6]
