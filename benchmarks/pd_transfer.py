"""PD KV transfer: bytes moved, transfer time, GB/s and transfer time / prefill time; PD vs colocated TTFT.

``PYTHONPATH=. .venv/bin/python -m benchmarks.pd_transfer [--size small] [--lengths 256,1024,2048]
[--repeats 3]`` prints JSON (``docs/cluster.md``, "PD disaggregation").

Part 1 runs two engine processes (prefill P, decode D; ``EngineClient``). Per prompt length, with
both prefix caches reset: P prefills the prompt (``max_tokens=1``; ``prefill_s`` is send → first
token), ``kv_export`` pins its blocks, D's ``kv_import`` pulls them with one batched Mooncake read
over TCP on loopback (``transfer_s`` is measured inside D around the read). Medians of ``repeats``.

Part 2 serves a few prompts through the real service-side PD path (``InstancePool`` over a
prefill + a decode instance registered in the embedded store) and, for comparison, through one
colocated (``mixed``) instance: TTFT and time to the second token (which includes the transfer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint  # noqa: E402
from benchmarks.cluster_common import LocalCluster  # noqa: E402
from benchmarks.smoke import add_smoke_flag, parse_args  # noqa: E402
from xengine.api.messages import AddRequest, SamplingParams  # noqa: E402
from xservice.config import load_config  # noqa: E402
from xservice.engine.client import EngineClient  # noqa: E402

FIRST_PLAIN_ID = 3


def engine_overrides(model: str, max_len: int) -> dict:
    return {
        "model": {"model": model, "max_model_len": max_len + 64, "seed": 0},
        "cache": {"block_size": 16, "num_blocks": (max_len + 64) // 16 * 2},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": max_len + 64},
        "device": {"device": "cpu", "num_threads": 1},
    }


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_PLAIN_ID, vocab) for _ in range(n)]


async def first_token_s(client, req: AddRequest) -> tuple[float, float | None]:
    """(time to the first token, time to the second token or None)."""
    t0 = time.perf_counter()
    ttft = second = None
    count = 0
    async for delta in client.generate(req):
        count += len(delta.new_token_ids)
        if ttft is None and count >= 1:
            ttft = time.perf_counter() - t0
        if second is None and count >= 2:
            second = time.perf_counter() - t0
    return ttft or 0.0, second


async def transfer_part(model: str, lengths: list[int], repeats: int) -> list[dict]:
    cfg = load_config(None, engine_overrides(model, max(lengths))).engine
    p, d = await asyncio.gather(EngineClient.start(cfg), EngineClient.start(cfg))
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    try:
        for n in lengths:
            runs = []
            for r in range(repeats + 1):  # the first run warms up (and creates the Mooncake agents)
                await asyncio.gather(p.reset_prefix_cache(), d.reset_prefix_cache())
                ids = prompt(n, p.info.vocab_size, seed=n * 100 + r)
                prefill_s, _ = await first_token_s(
                    p, AddRequest(req_id=f"p{n}-{r}", prompt_token_ids=ids, params=greedy)
                )
                info = await p.kv_export(f"x{n}-{r}", ids)
                t0 = time.perf_counter()
                res = await d.kv_import(info, ids, f"d{n}-{r}")
                call_s = time.perf_counter() - t0
                await asyncio.gather(p.kv_release(f"x{n}-{r}"), d.kv_release(f"d{n}-{r}"))
                if r:
                    runs.append(
                        (prefill_s, res.transfer_s, call_s, res.num_bytes, res.num_transferred_blocks)
                    )
            prefill_s = statistics.median(x[0] for x in runs)
            transfer_s = statistics.median(x[1] for x in runs)
            rows.append(
                {
                    "prompt_tokens": n,
                    "blocks": runs[0][4],
                    "kv_bytes": runs[0][3],
                    "prefill_s": round(prefill_s, 4),
                    "transfer_s": round(transfer_s, 5),
                    "import_call_s": round(statistics.median(x[2] for x in runs), 5),
                    "transfer_gb_per_s": round(runs[0][3] / transfer_s / 1e9, 3),
                    "transfer_over_prefill": round(transfer_s / prefill_s, 4),
                }
            )
    finally:
        await asyncio.gather(p.close(2.0), d.close(2.0))
    return rows


async def ttft_part(model: str, lengths: list[int], max_tokens: int = 8) -> dict:
    out: dict[str, list[dict]] = {}
    for mode, roles in (
        ("pd", [("prefill-0", "prefill"), ("decode-0", "decode")]),
        ("colocated", [("mixed-0", "mixed")]),
    ):
        cluster = LocalCluster(
            model, num_blocks=(max(lengths) + 64) // 16 * 2, max_model_len=max(lengths) + 64
        )
        async with cluster:
            await cluster.launch([n for n, _ in roles], roles=dict(roles))
            warm = AddRequest(
                req_id=f"{mode}-warmup",
                prompt_token_ids=[FIRST_PLAIN_ID] * 64,
                params=SamplingParams(max_tokens=2),
            )
            await first_token_s(cluster.pool, warm)  # first forward passes are slower
            rows = []
            for n in lengths:
                ids = prompt(n, cluster.pool.info.vocab_size, seed=n * 7)
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                ttft, second = await first_token_s(
                    cluster.pool, AddRequest(req_id=f"{mode}{n}", prompt_token_ids=ids, params=params)
                )
                rows.append(
                    {"prompt_tokens": n, "ttft_s": round(ttft, 4), "second_token_s": round(second or 0.0, 4)}
                )
            out[mode] = rows
    return out


SMOKE = dict(size="tiny", lengths="32", repeats=1, ttft_lengths="32")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_checkpoint_args(p)
    p.set_defaults(size="small")
    p.add_argument("--lengths", default="256,1024,2048", help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ttft-lengths", default="256,1024", help="prompt lengths of the TTFT comparison")
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv, SMOKE)
    model = resolve_checkpoint(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    result = {
        "model": Path(model).name,
        "transport": "mooncake tcp, loopback, P2PHANDSHAKE",
        "transfer": asyncio.run(transfer_part(model, lengths, args.repeats)),
        "ttft": asyncio.run(ttft_part(model, [int(x) for x in args.ttft_lengths.split(",")])),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
