"""``xllm serve`` with an 8-bit KV cache (``--kv-cache-dtype int8``): it serves, and the pool its
``kv_cache_memory_gb`` buys holds the 8-bit rows (``/v1/admin/stats``: about 3.5x the float32 blocks on
the tiny model, whose 32-value rows take 36 bytes instead of 128)."""

from __future__ import annotations

from pathlib import Path

from tests.xservice.conftest import start_server

POOL_GB = 0.001
BLOCK_SIZE = 16  # ENGINE_SETTINGS
# tiny checkpoint: 4 layers x K and V x 2 KV heads x (32 int8 values + a float32 scale) per token
BYTES_PER_TOKEN_INT8 = 4 * 2 * 2 * (32 + 4)
BYTES_PER_TOKEN_FP32 = 4 * 2 * 2 * 32 * 4


def test_server_with_an_int8_kv_cache_serves(model_dir: Path) -> None:
    cache = {"num_blocks": None, "kv_cache_memory_gb": POOL_GB, "kv_cache_dtype": "int8"}
    server = start_server(model_dir, engine={"cache": cache})
    try:
        with server.client() as http:
            stats = http.get("/v1/admin/stats").json()
            budget = int(POOL_GB * (1 << 30))
            assert stats["num_total_blocks"] == budget // (BLOCK_SIZE * BYTES_PER_TOKEN_INT8)
            assert stats["num_total_blocks"] > 3 * budget // (BLOCK_SIZE * BYTES_PER_TOKEN_FP32)
            body = {"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 12}
            resp = http.post("/v1/completions", json={**body, "temperature": 0.0, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 12
            chat = {
                "model": server.model_name,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            }
            resp = http.post("/v1/chat/completions", json={**chat, "stream": True})
            assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]"), resp.text
    finally:
        server.stop()
