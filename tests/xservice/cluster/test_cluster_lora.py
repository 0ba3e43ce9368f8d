"""LoRA under PD disaggregation, end to end: ``xllm serve`` with one prefill and one decode instance,
both serving the configured adapters; a request naming an adapter is prefilled under it, its KV (keyed
per adapter) moves over Mooncake and the decode instance continues under the same adapter: greedy texts
equal one colocated engine's with the adapter. An adapter loaded at run time reaches both instances."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.xservice.cluster.helpers import ENGINE, ClusterServer, wait_until
from xengine.tools.make_lora import make_lora

pytest.importorskip("mooncake.engine")

PROMPTS = [
    f"Tenant request {i}: " + "The quick brown fox jumps over the lazy dog. " * (i + 3) for i in range(2)
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cluster-lora")
    return {
        "attn": make_lora(model_dir, root / "attn", 8, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=1),
        "mlp": make_lora(model_dir, root / "mlp", 4, ("gate_proj", "up_proj", "down_proj"), seed=2),
        "late": make_lora(model_dir, root / "late", 8, ("q_proj", "v_proj"), seed=3),
    }


@pytest.fixture(scope="module")
def cluster(model_dir: Path, adapters: dict[str, Path]) -> Iterator[ClusterServer]:
    lora = {
        "enable_lora": True,
        "lora_modules": [f"attn={adapters['attn']}", f"mlp={adapters['mlp']}"],
        "max_loras": 2,
        "allow_runtime_lora_updating": True,
    }
    server = ClusterServer(
        model_dir,
        {"instances": "prefill-0:prefill,decode-0:decode", "metadata_store": "embedded"},
        engine={"lora": lora},
    )
    yield server
    server.stop()


def _colocated(model_dir: Path, adapters: dict[str, Path]) -> dict[tuple[str | None, str], str]:
    """Greedy texts of one colocated offline engine with the instances' settings and the adapters."""
    import gc

    from xengine import LLM, LoRARequest, SamplingParams

    llm = LLM(
        str(model_dir), max_model_len=ENGINE["model"]["max_model_len"], seed=ENGINE["model"]["seed"],
        block_size=ENGINE["cache"]["block_size"], num_blocks=ENGINE["cache"]["num_blocks"], device="cpu",
        num_threads=1, enable_lora=True, max_loras=2,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for name in (None, *adapters):
        lora = LoRARequest(name, 1, str(adapters[name])) if name else None
        for prompt, result in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)):
            out[(name, prompt)] = result.outputs[0].text
    del llm
    gc.collect()
    return out


def _complete(cluster: ClusterServer, model: str, prompt: str) -> str:
    resp = cluster.openai().completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.model == model
    return resp.choices[0].text


def test_pd_serves_adapters(cluster: ClusterServer, model_dir: Path, adapters: dict[str, Path]) -> None:
    expected = _colocated(model_dir, adapters)
    assert expected[("attn", PROMPTS[0])] != expected[(None, PROMPTS[0])]
    for name in ("attn", "mlp"):
        for prompt in PROMPTS:
            assert _complete(cluster, name, prompt) == expected[(name, prompt)], (name, prompt)
    for prompt in PROMPTS:
        assert _complete(cluster, "xllm-tiny", prompt) == expected[(None, prompt)]
    admin = cluster.admin()
    assert admin["pd"]["num_fallbacks"] == 0 and admin["pd"]["num_requests"] >= 3 * len(PROMPTS)
    assert cluster.instances()["decode-0"]["kv_imported"]["blocks"] > 0
    # a runtime load reaches both instances: the prefill and the decode one serve it
    r = cluster.http.post(
        "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])}
    )
    assert r.status_code == 200, r.text
    assert _complete(cluster, "late", PROMPTS[0]) == expected[("late", PROMPTS[0])]
    assert cluster.admin()["pd"]["num_fallbacks"] == 0
    # the registry knows which adapters each instance holds in its device slots (what routing prefers)
    held = lambda: (cluster.instances()["decode-0"].get("load") or {}).get("lora_adapters", [])  # noqa: E731
    wait_until(lambda: "late" in held(), 30.0, "the decode instance's heartbeat to list the adapter")
