"""Speculative decoding with a draft head under PD disaggregation, end to end: ``xllm serve`` with one
prefill and one decode instance, both running an EAGLE head (``speculative_config`` in the YAML); the
prefill instance's head reads the prompt and its blocks move over Mooncake with the prompt's KV, so the
decode instance's head drafts from the whole prompt. Greedy texts equal one colocated engine's without
speculation; the admin API counts the head's blocks imported."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.xservice.cluster.helpers import ClusterServer, colocated_texts, complete
from xengine.tools.eagle_checkpoint import make_eagle_head

pytest.importorskip("mooncake.engine")

PROMPTS = [
    f"Request {i}: " + "The quick brown fox jumps over the lazy dog near the river bank. " * (i + 2)
    for i in range(3)
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory) -> Iterator[ClusterServer]:
    head = make_eagle_head(model_dir, tmp_path_factory.mktemp("eagle-cluster"), "eagle")
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(head)}
    server = ClusterServer(
        model_dir,
        {"instances": "prefill-0:prefill,decode-0:decode", "metadata_store": "embedded"},
        engine={"speculative_config": spec},
    )
    yield server
    server.stop()


def test_the_decode_instance_gets_the_heads_prompt_blocks(cluster: ClusterServer, model_dir: Path) -> None:
    expected = colocated_texts(model_dir, [(p, MAX_TOKENS) for p in PROMPTS])
    client = cluster.openai()
    for prompt in PROMPTS:
        out = complete(client, prompt, MAX_TOKENS)
        assert out.choices[0].text == expected[prompt], f"{prompt!r} differs"
    admin = cluster.admin()
    assert admin["pd"]["num_requests"] == len(PROMPTS) and admin["pd"]["num_fallbacks"] == 0
    imported = cluster.instances()["decode-0"]["kv_imported"]
    assert imported["blocks"] > 0 and imported["head_blocks"] == imported["blocks"]
