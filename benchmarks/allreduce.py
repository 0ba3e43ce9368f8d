"""Tensor-parallel all-reduce on one host: the shared-memory communicator (``xengine/parallel/
shm_comm.py``) against gloo's ``dist.all_reduce`` over loopback; prints one JSON document.

``--world-size`` rank processes (one torch thread each) join a gloo group; for every message size
(fp32) each does warm-up calls, then ``--iters`` timed calls (fewer for big messages: about
``--iters x 64 KB`` bytes per size, at least ``MIN_ITERS``) of each communicator, rank 0 timing every
call. Per size: median latency of each, the speedup, and bandwidth (message bytes / median seconds);
``small_message_speedup`` is the speedup at 16 KB (the hidden-state size of a decode step, where
gloo's fixed cost dominates). ``correct`` says the shm sum equalled gloo's on a non-trivial input.

With more ranks than idle cores the ranks take turns (``sched_yield``), and both numbers mean little.

    PYTHONPATH=. .venv/bin/python -m benchmarks.allreduce --world-size 2
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.machine import describe
from benchmarks.smoke import add_smoke_flag, parse_args
from xengine.parallel.shm_comm import ShmCommunicator

KB = 1 << 10
SIZES = [4 * KB, 16 * KB, 64 * KB, 256 * KB, KB * KB, 4 * KB * KB, 16 * KB * KB, 64 * KB * KB]
SMALL = 16 * KB
MIN_ITERS = 10
SMOKE = dict(sizes=[4 * KB, 64 * KB], iters=20, warmup=2)


def progress(msg: str) -> None:
    print(f"[allreduce] {msg}", file=sys.stderr, flush=True)


def iters_for(nbytes: int, iters: int) -> int:
    return max(MIN_ITERS, min(iters, iters * 64 * KB // nbytes))


def median_s(fn: Any, t: torch.Tensor, iters: int, warmup: int) -> float:
    """Median wall time of ``fn(t)`` over ``iters`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn(t)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gloo_all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def same_sum(comm: ShmCommunicator, rank: int, nbytes: int) -> bool:
    """The shm sum equals gloo's on rank-dependent random data (bit for bit: two ranks' fp32 sum does
    not depend on the order; with more ranks, within rounding)."""
    x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
    shm, ref = comm.all_reduce(x.clone()), gloo_all_reduce(x.clone())
    return bool(torch.equal(shm, ref) if dist.get_world_size() == 2 else torch.allclose(shm, ref))


def run_rank(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    comm = ShmCommunicator.create(None, rank, world_size, max_bytes=args.max_bytes)
    rows = []
    for nbytes in args.sizes:
        n = iters_for(nbytes, args.iters)
        t = torch.zeros(nbytes // 4)  # stays zero: the timing sees no inf / denormal values
        correct = same_sum(comm, rank, nbytes)
        dist.barrier()
        shm_s = median_s(comm.all_reduce, t, n, args.warmup)
        dist.barrier()
        gloo_s = median_s(gloo_all_reduce, t, n, args.warmup)
        dist.barrier()
        rows.append(
            {"bytes": nbytes, "iters": n, "shm_median_us": round(shm_s * 1e6, 2),
             "gloo_median_us": round(gloo_s * 1e6, 2), "speedup": round(gloo_s / shm_s, 2),
             "shm_gbps": round(nbytes / shm_s / 1e9, 3), "gloo_gbps": round(nbytes / gloo_s / 1e9, 3),
             "correct": correct}
        )  # fmt: skip
        if rank == 0:
            progress(f"{nbytes} B: shm {shm_s * 1e6:.1f} us, gloo {gloo_s * 1e6:.1f} us")
    comm.close()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=run_rank, args=(r, args.world_size, port, args, queue))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"rank processes failed (rank, exit code): {failed}")
    return queue.get()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_smoke_flag(p)
    p.add_argument("--world-size", type=int, default=2, help="rank processes, one torch thread each")
    p.add_argument("--iters", type=int, default=2000, help="timed calls per size up to 64 KB (fewer above)")
    p.add_argument("--warmup", type=int, default=50, help="untimed calls per size and communicator")
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="message sizes in bytes (fp32)")
    p.add_argument("--max-bytes", type=int, default=4 * KB * KB, help="shm slot size: larger goes in chunks")
    args = parse_args(p, argv, SMOKE)
    if args.world_size < 2:
        raise ValueError("--world-size must be at least 2")
    machine = describe(threads_per_process=1)
    progress(f"world size {args.world_size}, sizes {args.sizes}")
    rows = measure(args)
    small = next((r["speedup"] for r in rows if r["bytes"] == SMALL), None)
    report = {
        "benchmark": "allreduce", "machine": machine, "world_size": args.world_size, "threads_per_rank": 1,
        "max_bytes": args.max_bytes, "sizes": rows, "small_message_speedup": small,
    }  # fmt: skip
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
