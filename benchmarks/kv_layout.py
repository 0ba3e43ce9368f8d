"""xTensor vs paged KV layout: decode step time and output tok/s, and map/unmap cost; prints one JSON.

For each checkpoint (``--sizes``), batch size B and context length, one engine per layout is set up
with B sequences whose first ``context`` tokens are already in the KV cache (random K/V written
straight into their blocks: no prefill compute, which at 32 x 4k tokens would take minutes), then
``--steps`` greedy decode steps run; the median step time (after ``--warmup`` steps) and
B / step time are reported, paged and xtensor side by side, with their ratio. Both layouts read the
same amount of KV per step. A second section times the xTensor VMM calls per page.

    PYTHONPATH=. .venv/bin/python -m benchmarks.kv_layout --sizes tiny small --num-threads 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.checkpoint import generated_checkpoint
from benchmarks.smoke import add_smoke_flag, parse_args

LAYOUTS = ("paged", "xtensor")


def _engine(model_dir: str, layout: str, batch: int, max_len: int, num_threads: int, block_size: int | None):
    from xengine.engine import Engine
    from xengine.llm import engine_config
    from xengine.models.info import read_model_info

    info = read_model_info(model_dir)
    token_bytes = 2 * info.num_layers * info.num_kv_heads * info.head_dim * 4  # float32 K and V
    # a pool of B sequences of max_len tokens, plus two of the largest blocks each (rounding, look-ahead)
    pool_gb = batch * (max_len + 2 * 128) * token_bytes / 2**30
    config = engine_config(
        model_dir,
        dtype="float32",
        kv_layout=layout,
        block_size=block_size,
        kv_cache_memory_gb=pool_gb,
        max_model_len=max_len,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch),
        num_threads=num_threads,
    )
    return Engine(config)


def _inject(engine: Any, batch: int, context: int, max_tokens: int, seed: int) -> None:
    """Add ``batch`` requests whose first ``context - 1`` tokens count as computed, their K/V random."""
    from xengine.api.messages import AddRequest, SamplingParams
    from xengine.request import RequestStatus

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
        engine.add_request(AddRequest(req_id=f"r{i}", prompt_token_ids=prompt, params=params))
    sched, kv, caches = engine.scheduler, engine.kv, engine.runner.kv_caches
    for req in list(sched.waiting):
        assert kv.allocate_slots(req.seq_id, context)
        blocks = torch.tensor(kv.block_tables[req.seq_id][: -(-context // kv.block_size)])
        for cache in caches:
            cache[:, blocks] = torch.randn(cache[:, blocks].shape, generator=gen, dtype=cache.dtype)
        req.num_computed_tokens = context - 1  # the last prompt token is computed by the first step
        req.admitted_once = True
        req.status = RequestStatus.RUNNING
        sched.running.append(req)
    sched.waiting.clear()


def decode_case(model_dir: str, layout: str, batch: int, context: int, args: argparse.Namespace) -> dict:
    steps = args.warmup + args.steps
    engine = _engine(model_dir, layout, batch, context + steps + 8, args.num_threads, args.block_size)
    try:
        _inject(engine, batch, context, steps + 2, args.seed)
        times, forward = [], []
        for _ in range(steps):
            engine.step()
            t = engine.last_step_timing
            times.append(t.total_s)
            forward.append(t.forward_s)
        step = statistics.median(times[args.warmup :])
        return {
            "step_ms": round(step * 1e3, 3),
            "forward_ms": round(statistics.median(forward[args.warmup :]) * 1e3, 3),
            "output_tok_s": round(batch / step, 1),
            "block_size": engine.kv.block_size,
        }
    finally:
        engine.kv_setup.layout.close()
        del engine
        gc.collect()


def decode_section(model_dir: str, args: argparse.Namespace) -> list[dict]:
    rows = []
    for context in args.contexts:
        for batch in args.batch_sizes:
            row: dict[str, Any] = {"batch": batch, "context": context}
            for layout in LAYOUTS:
                print(f"[decode] {layout} B={batch} context={context}", file=sys.stderr)
                row[layout] = decode_case(model_dir, layout, batch, context, args)
            row["xtensor_speedup"] = round(row["paged"]["step_ms"] / row["xtensor"]["step_ms"], 3)
            rows.append(row)
    return rows


def map_section(num_pages: int) -> dict:
    """Time of one VMM map / unmap of a 4 KiB .. 64 KiB page into a reserved range (CPU)."""
    from ops.platforms import resolve_platform

    vmm = resolve_platform("cpu").vmm()
    out = {}
    for page_kib in (4, 16, 64):
        page = page_kib * 1024
        vrange = vmm.reserve(2 * num_pages * page)
        pages = vmm.create_pages(num_pages, page)
        t0 = time.perf_counter()
        for i in range(num_pages):
            vmm.map(vrange, 2 * i * page, pages, i)  # every other page: no two mappings merge
        t1 = time.perf_counter()
        for i in range(num_pages):
            vmm.unmap(vrange, 2 * i * page, page)
        t2 = time.perf_counter()
        vmm.release(vrange)
        vmm.free_pages(pages)
        out[f"{page_kib}KiB"] = {
            "map_us_per_page": round((t1 - t0) / num_pages * 1e6, 2),
            "unmap_us_per_page": round((t2 - t1) / num_pages * 1e6, 2),
        }
    return out


SMOKE = dict(sizes=["tiny"], batch_sizes=[1], contexts=[16], steps=1, warmup=1, map_pages=16)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[160, 1024, 4000])  # 4k: inside 4096 positions
    p.add_argument("--steps", type=int, default=10, help="decode steps measured (median)")
    p.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
    p.add_argument("--block-size", type=int, default=None, help="default: each layout's own default")
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads of the engine")
    p.add_argument("--map-pages", type=int, default=2000, help="pages mapped in the map/unmap section")
    p.add_argument("--seed", type=int, default=0)
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv, SMOKE)
    torch.set_num_threads(args.num_threads)
    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items()},
        "host": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "num_threads": args.num_threads},
        "map_unmap": map_section(args.map_pages),
    }
    for size in args.sizes:
        model_dir = str(generated_checkpoint(args.arch, size))
        report[size] = decode_section(model_dir, args)
    speedups = [r["xtensor_speedup"] for size in args.sizes for r in report[size]]
    report["xtensor_speedup_median"] = statistics.median(speedups)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
