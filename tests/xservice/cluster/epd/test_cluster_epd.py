"""EPD disaggregation end to end: ``xllm serve`` of a tiny Qwen2-VL over real engine processes, the
image embeddings (E→P) and prompt KV (P→D) moving over a real Mooncake transfer engine (TCP, loopback),
driven by the ``openai`` client and checked against HF ``transformers`` on the same weights.

One cluster per strategy and model (module-scoped, in turn; Qwen2-VL and Qwen2.5-VL): E+P+D (2 encode,
1 prefill, 1 decode; real etcd), EP+D (2 encode_prefill, 1 decode) and ED+P (1 encode_decode, 1
prefill). In each, in file order:
chats with 0, 1 and 2 images of different sizes, streamed and not, give HF's greedy tokens, and only
the instances of the encode stage ever encode (``/v1/admin/stats`` per instance); a fresh image is
encoded once and its repeat is encoded nowhere, routed to the instance holding it (the TTFT of both
is printed); under E+P+D with both encode instances killed, the prefill instance encodes itself.
Bad ``cluster.epd_strategy`` / role combinations fail ``xllm serve`` with a message naming the fix.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.xengine.vl_oracle import VLOracle, random_image, user_turn
from tests.xservice.cluster.helpers import ROOT, ClusterServer, EtcdServer, wait_until
from xengine.api.cluster import keys

pytest.importorskip("mooncake.engine")
openai = pytest.importorskip("openai")

MAX_TOKENS = 8
SMALL = random_image(56, 56, seed=1)  # 4 image tokens
WIDE = random_image(84, 112, seed=2)  # 12 image tokens
GREEDY: dict[str, Any] = {
    "temperature": 0,
    "max_tokens": MAX_TOKENS,
    "extra_body": {"ignore_eos": True, "return_token_ids": True},
}
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[Any]]] = {
    "0-images": ([{"role": "user", "content": "Tell me about the weather in the mountains."}], []),
    "1-image": ([user_turn(WIDE, "What is in this picture?")], [WIDE]),
    "2-images": (
        [{"role": "system", "content": "You describe images."}, user_turn("Compare", SMALL, "with", WIDE)],
        [SMALL, WIDE],
    ),
}
# strategy -> (instances, the instances that may encode, store)
STRATEGIES: dict[str, tuple[str, set[str], str]] = {
    "E+P+D": ("encode-0:encode,encode-1:encode,prefill-0:prefill,decode-0:decode", {"encode-0", "encode-1"}, "etcd"),
    "EP+D": ("ep-0:encode_prefill,ep-1:encode_prefill,decode-0:decode", {"ep-0", "ep-1"}, "embedded"),
    "ED+P": ("ed-0:encode_decode,prefill-0:prefill", {"ed-0"}, "embedded"),
}  # fmt: skip
ARCHS = ("qwen2_vl", "qwen2_5_vl")
# 16-token blocks: some prompts end an image inside their partial last block, which the decode
# instance recomputes (it then gets those embeddings from P); 4-token blocks: none does
BLOCK_SIZE = {"E+P+D": 16, "EP+D": 16, "ED+P": 4}
CLUSTERS = [(strategy, arch) for arch in ARCHS for strategy in STRATEGIES]


@dataclass
class EPDCluster:
    strategy: str
    arch: str
    server: ClusterServer
    oracle: VLOracle
    expected: dict[str, list[int]]  # HF's greedy tokens of each of CONVERSATIONS
    key_prefix: str


@pytest.fixture(scope="module", params=CLUSTERS, ids=["-".join(c) for c in CLUSTERS])
def cluster(request: pytest.FixtureRequest, make_model_dir) -> Iterator[EPDCluster]:
    strategy, arch = request.param
    vl_dir = make_model_dir(arch)
    oracle = VLOracle(vl_dir)
    expected = {name: oracle.greedy(m, images, MAX_TOKENS) for name, (m, images) in CONVERSATIONS.items()}
    instances, _, store = STRATEGIES[strategy]
    prefix = f"/xllm-epd-{os.getpid()}-{arch}"
    cluster_cfg: dict[str, Any] = {"instances": instances, "epd_strategy": strategy, "metadata_store": store}
    if store == "etcd":
        cluster_cfg.update(etcd_endpoint=request.getfixturevalue("etcd").endpoint, key_prefix=prefix)
    first_port = 23500 + 50 * CLUSTERS.index((strategy, arch))  # each cluster's transfer engines: own ports
    server = ClusterServer(
        vl_dir,
        cluster_cfg,
        {"engine_max_restarts": 0, "max_body_bytes": 16 << 20},
        engine={
            "model": {"max_model_len": 512, "served_model_name": "xllm-tiny-vl"},
            "cache": {"block_size": BLOCK_SIZE[strategy], "num_blocks": 512, "kv_transfer_port_range": f"{first_port}-{first_port + 49}"},
        },
    )  # fmt: skip
    yield EPDCluster(strategy, arch, server, oracle, expected, prefix)
    server.stop()


def _chat(server: ClusterServer, messages: list[dict[str, Any]], stream: bool) -> tuple[list[int], float]:
    """Greedy token ids of one chat and its time to first token (s)."""
    client = server.openai()
    t0 = time.perf_counter()
    if not stream:
        out = client.chat.completions.create(model="xllm-tiny-vl", messages=messages, **GREEDY)
        return out.choices[0].model_extra["token_ids"], time.perf_counter() - t0
    tokens: list[int] = []
    ttft = None
    for chunk in client.chat.completions.create(
        model="xllm-tiny-vl", messages=messages, stream=True, **GREEDY
    ):
        ids = chunk.choices[0].model_extra.get("token_ids") if chunk.choices else None
        if ids:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            tokens.extend(ids)
    assert ttft is not None
    return tokens, ttft


def _encodes(server: ClusterServer) -> dict[str, int]:
    stats = server.http.get("/v1/admin/stats").json()["instances"]
    return {name: s["num_image_encodes"] for name, s in stats.items()}


def test_chats_match_hf_and_only_the_encode_stage_encodes(cluster: EPDCluster) -> None:
    strategy, server, expected = cluster.strategy, cluster.server, cluster.expected
    _, encoders, _ = STRATEGIES[strategy]
    for name, (messages, _) in CONVERSATIONS.items():
        for stream in (False, True):
            tokens, _ = _chat(server, messages, stream)
            assert tokens == expected[name], f"{strategy} {name} stream={stream}"
    encodes = _encodes(server)
    assert sum(encodes.values()) >= 2  # SMALL and WIDE were encoded ...
    assert all(n == 0 for name, n in encodes.items() if name not in encoders), encodes  # ... on encoders only
    view = server.admin()
    assert view["epd"]["strategy"] == strategy and view["epd"]["num_image_requests"] == 4
    assert view["epd"]["num_encode_fallbacks"] == 0
    assert view["pd"]["num_requests"] == 6 and view["pd"]["num_fallbacks"] == 0  # KV moved for each
    if strategy != "EP+D":  # embeddings moved to the prefill instance
        assert view["epd"]["num_encodes"] >= 1 and view["epd"]["num_embed_bytes"] > 0


def test_repeated_image_is_not_encoded_again_and_goes_to_its_holder(cluster: EPDCluster) -> None:
    strategy, server, oracle = cluster.strategy, cluster.server, cluster.oracle
    _, encoders, _ = STRATEGIES[strategy]
    image = random_image(224, 196, seed=7)  # a larger one: 64 image tokens
    first, again = [user_turn(image, "Describe it.")], [user_turn("And now this:", image)]
    before, routed_before = _encodes(server), _routed(server)
    tokens, ttft_fresh = _chat(server, first, stream=True)
    assert tokens == oracle.greedy(first, [image], MAX_TOKENS)
    mid, routed_mid = _encodes(server), _routed(server)
    grew = {n for n in mid if mid[n] != before.get(n, 0)}
    assert len(grew) == 1 and grew <= encoders and sum(mid.values()) == sum(before.values()) + 1
    tokens, ttft_repeat = _chat(server, again, stream=True)
    assert tokens == oracle.greedy(again, [image], MAX_TOKENS)
    after, routed_after = _encodes(server), _routed(server)
    assert after == mid  # encoded nowhere
    (holder,) = grew
    if strategy == "EP+D":  # the prefill went to the encode_prefill instance holding the image
        assert routed_after[holder] == routed_mid[holder] + 1
        assert all(routed_after[n] == routed_mid[n] for n in encoders - {holder})
    else:  # the prefill instance holds it since the import: the encode stage is skipped entirely
        assert server.admin()["epd"]["num_prefill_hits"] >= 1
        assert all(routed_after[n] == routed_mid[n] for n in encoders if n != "ed-0")
    print(
        f"\nEPD {strategy} {cluster.arch}: TTFT fresh image {ttft_fresh * 1000:.1f} ms, repeated {ttft_repeat * 1000:.1f} ms"
    )
    del routed_before


def _routed(server: ClusterServer) -> dict[str, int]:
    return {name: i["num_routed"] for name, i in server.instances().items()}


def _image_sets(etcd_server: EtcdServer, prefix: str) -> dict[str, set[str]]:
    """``<prefix>/images/<name>`` as etcd holds them: each instance's published image-cache hashes."""
    from xengine.api.cluster.store.etcd import EtcdStore

    async def main() -> dict[str, bytes]:
        store = EtcdStore("127.0.0.1", etcd_server.port)
        try:
            return (await store.get_prefix(f"{prefix}/images/"))[0]
        finally:
            await store.close()

    return {
        k.rsplit("/", 1)[1]: set(keys.decode(v, keys.ImageSet).hashes) for k, v in asyncio.run(main()).items()
    }


def test_dead_encoders_leave_the_encoding_to_the_prefill_instance(cluster: EPDCluster, request) -> None:
    server, oracle = cluster.server, cluster.oracle
    etcd_server = request.getfixturevalue("etcd")

    # every image an encoder holds, the prefill instance imported (all published in etcd, leased)
    # (each instance publishes its set on its own heartbeat: wait for both sides to be published)
    def encoders_and_prefill() -> bool:
        sets = _image_sets(etcd_server, cluster.key_prefix)
        held = set().union(*(sets.get(n, set()) for n in ("encode-0", "encode-1")))
        return len(held) >= 3 and held <= sets.get("prefill-0", set())

    wait_until(encoders_and_prefill, what="the encoders' images published, each also on prefill-0")
    for name in ("encode-0", "encode-1"):
        os.kill(server.instances()[name]["pid"], signal.SIGKILL)
    wait_until(lambda: not any(i["healthy"] for n, i in server.instances().items() if n.startswith("encode")))
    wait_until(
        lambda: not {"encode-0", "encode-1"} & set(_image_sets(etcd_server, cluster.key_prefix)),
        what="leases to expire",
    )
    image = random_image(70, 84, seed=9)
    messages = [user_turn(image, "What now?")]
    before = _encodes(server)
    assert _chat(server, messages, stream=False)[0] == oracle.greedy(messages, [image], MAX_TOKENS)
    after = _encodes(server)
    assert after["prefill-0"] == before["prefill-0"] + 1 and after["decode-0"] == 0
    assert server.admin()["epd"]["num_encode_fallbacks"] >= 1


@pytest.mark.parametrize(
    ("instances", "strategy", "message"),
    [
        ("e:encode,p:prefill,d:decode", "none", "set cluster.epd.strategy"),
        ("p:prefill,d:decode", "E+P+D", "has no encode instance"),
        ("ep:encode_prefill,p:prefill,d:decode", "EP+D", "roles prefill do not belong to it"),
        ("ed:encode_decode,p:prefill", "E+D", "cluster.epd.strategy must be one of none, E+P+D, EP+D, ED+P"),
        ("e:encode,p:prefill,d:decode", "E+P+D --pd-mode dynamic", "needs cluster.pd.mode: static"),
    ],
)
def test_bad_epd_config_is_a_clear_error(make_model_dir, instances: str, strategy: str, message: str) -> None:
    strategy, *extra = strategy.split()
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(ROOT / "configs/cluster-epd.yaml")]
    cmd += [
        "--model",
        str(make_model_dir("qwen2_vl")),
        "--instances",
        instances,
        "--epd-strategy",
        strategy,
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
