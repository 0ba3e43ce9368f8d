"""EPD disaggregation: TTFT of an image request with a fresh image vs the same image again, per strategy.

``PYTHONPATH=. .venv/bin/python -m benchmarks.epd_ttft [--model DIR] [--strategies E+P+D,EP+D,ED+P]
[--image-px 448] [--repeats 8]`` prints one JSON line per strategy (``docs/multimodal.md``).

Each strategy runs ``xllm serve --config configs/cluster-epd.yaml`` with one instance per role (E+P+D:
encode, prefill, decode; EP+D: encode_prefill, decode; ED+P: encode_decode, prefill), real engine
processes and Mooncake over TCP. Per repeat: a chat with a fresh random image (streamed; TTFT = send
→ first chunk carrying a token), then the same image behind other text (TTFT again: the image is not encoded
anywhere; the prefill instance holds it). Also from ``/v1/admin/instances`` ``epd``: the mean time of
an encode-only request, of an embedding import, and of the whole encode stage before a prefill, and
the images each instance encoded (``/v1/admin/stats``). Default model: the tiny Qwen2-VL (generated).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.server_process import free_port, run_server  # noqa: E402
from benchmarks.smoke import add_smoke_flag, parse_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
INSTANCES = {
    "E+P+D": "encode-0:encode,prefill-0:prefill,decode-0:decode",
    "EP+D": "ep-0:encode_prefill,decode-0:decode",
    "ED+P": "ed-0:encode_decode,prefill-0:prefill",
}


def tiny_vl() -> str:
    out = Path(tempfile.gettempdir()) / "xllm-bench-qwen2_vl-tiny"
    if not (out / "config.json").is_file():
        cmd = [
            sys.executable,
            "-m",
            "xservice",
            "model",
            "make-tiny",
            "--arch",
            "qwen2_vl",
            "--out",
            str(out),
        ]
        subprocess.run([*cmd, "--quiet"], check=True)
    return str(out)


def image_url(px: int, seed: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (px, px, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ttft_ms(client, model: str, text_first: bool, url: str) -> float:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]
    messages = [{"role": "user", "content": parts[::-1] if text_first else parts}]
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        stream=True,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and (chunk.choices[0].model_extra or {}).get("token_ids"):
            first = time.perf_counter() - t0
    return 1000 * (first if first is not None else time.perf_counter() - t0)


def run(strategy: str, model: str, px: int, repeats: int) -> dict:
    import openai

    port = free_port()
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(ROOT / "configs/cluster-epd.yaml")]
    cmd += [
        "--model",
        model,
        "--port",
        str(port),
        "--epd-strategy",
        strategy,
        "--instances",
        INSTANCES[strategy],
    ]
    with run_server(cmd, port, name=f"epd-{strategy}") as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        ttft_ms(client, name, False, image_url(56, 999))  # warm-up: first transfers open connections
        fresh, again = [], []
        for i in range(repeats):
            url = image_url(px, 1000 + i)
            fresh.append(ttft_ms(client, name, False, url))
            again.append(ttft_ms(client, name, True, url))
        admin = base_url.removesuffix("/v1")
        epd = httpx.get(f"{admin}/v1/admin/instances").json()["epd"]
        per = httpx.get(f"{admin}/v1/admin/stats").json()["instances"]
    return {
        "strategy": strategy,
        "image_px": px,
        "repeats": repeats,
        "ttft_fresh_ms_median": round(statistics.median(fresh), 1),
        "ttft_repeat_ms_median": round(statistics.median(again), 1),
        "encode_only_ms_mean": round(1000 * epd["encode_s"] / max(1, epd["num_encodes"]), 2),
        "embed_import_ms_mean": round(1000 * epd["embed_transfer_s"] / max(1, epd["num_embed_imports"]), 2),
        "encode_stage_ms_mean": round(1000 * epd["encode_stage_s"] / max(1, epd["num_encodes"]), 2),
        "embed_bytes_per_import": epd["num_embed_bytes"] // max(1, epd["num_embed_imports"]),
        "image_encodes": {n: s["num_image_encodes"] for n, s in per.items()},
    }


SMOKE = dict(strategies="EP+D", image_px=56, repeats=1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a Qwen2-VL / Qwen2.5-VL folder (default: tiny Qwen2-VL)")
    p.add_argument("--strategies", default=",".join(INSTANCES))
    p.add_argument("--image-px", type=int, default=448)
    p.add_argument("--repeats", type=int, default=8)
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv, SMOKE)
    model = args.model or tiny_vl()
    for strategy in args.strategies.split(","):
        print(json.dumps(run(strategy, model, args.image_px, args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
