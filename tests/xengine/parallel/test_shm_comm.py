"""The shared-memory collectives between real rank processes joined in a gloo group: all-reduce equal
(bit for bit) to the fixed-order sum ``x0 + x1 + ...`` on every rank, for any size and many calls in a
row; all-gather equal to ``torch.cat`` in rank order; all-to-all delivering each rank's rows for every
other, in rounds when they overflow a slot; a dead peer or ``abort`` ends a wait with
``CommAbortedError`` instead of a hang; nothing left in /dev/shm afterwards.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xengine.parallel.shm_comm import CommAbortedError, ShmCommunicator, ShmUnavailableError

MAX_BYTES = 64 << 10  # small slots, so that modest tensors already go in chunks
# (numel, dtype): one element, odd counts, one slot exactly, over a slot (chunked)
REDUCE_CASES = [(1, torch.float32), (1023, torch.float32), (MAX_BYTES // 4, torch.float32),
                (3 * MAX_BYTES // 4 + 7, torch.float32), (4097, torch.bfloat16), (MAX_BYTES + 3, torch.bfloat16),
                (777, torch.float16)]  # fmt: skip
NUM_REPEATED_CALLS = 240


def _run_ranks(target: Callable[..., None], world_size: int, out_dir: Path) -> list[int | None]:
    """Run ``target(rank, world_size, port, out_dir)`` in one fresh process per rank; exit codes."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, str(out_dir))) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            for q in procs:
                q.kill()
            pytest.fail(f"{target.__name__}: a rank hung")
    return [p.exitcode for p in procs]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(case: int, world_size: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input of one case: each rank can compute the others' (and so the expected sum)."""
    g = torch.Generator().manual_seed(1000 * case + world_size)
    return [torch.randn(numel, generator=g).to(dtype) for _ in range(world_size)]


def _fixed_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    out = xs[0] + xs[1]
    for x in xs[2:]:
        out = out + x
    return out


def _join(rank: int, world_size: int, port: int, timeout_s: float = 60.0) -> ShmCommunicator:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    return ShmCommunicator.create(None, rank, world_size, max_bytes=MAX_BYTES, timeout_s=timeout_s)


def _correctness_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    comm = _join(rank, world_size, port)
    results: dict[str, torch.Tensor | str] = {"path": comm.path}
    for case, (numel, dtype) in enumerate(REDUCE_CASES):
        xs = _inputs(case, world_size, numel, dtype)
        got = comm.all_reduce(xs[rank].clone())
        assert torch.equal(got, _fixed_order_sum(xs)), f"case {case}: {numel} x {dtype}"
        results[f"reduce{case}"] = got
    for i in range(NUM_REPEATED_CALLS):  # both parities many times over, shapes alternating
        xs = _inputs(100 + i, world_size, 33 + i % 3, torch.float32)
        assert torch.equal(comm.all_reduce(xs[rank].clone()), _fixed_order_sum(xs)), f"call {i}"
    for case, shape in enumerate([(3, 5), (2, MAX_BYTES // 4 + 1), (1, 0)]):  # the second is chunked
        xs = [x.view(shape) for x in _inputs(200 + case, world_size, shape[0] * shape[1], torch.float32)]
        for dim in (-1, 0):
            got = comm.all_gather(xs[rank], dim=dim)
            assert torch.equal(got, torch.cat(xs, dim=dim)), f"gather {shape} dim {dim}"
        results[f"gather{case}"] = got
    for case, (width, dtype, most) in enumerate(A2A_CASES):
        sends, splits = _a2a_inputs(case, world_size, width, dtype, most)
        got = comm.all_to_all(sends[rank], splits[rank], [splits[r][rank] for r in range(world_size)])
        expected = torch.cat([_rows_for(sends[r], splits[r], rank) for r in range(world_size)])
        assert torch.equal(got, expected), f"all_to_all case {case}"
    comm.close()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


# all_to_all: (row width, dtype, most rows one rank sends one peer); the last case's rows overflow a
# slot (several rounds), width 0 means 1-D rows (the routing counts)
A2A_CASES = [(8, torch.float32, 5), (0, torch.int64, 4), (300, torch.float32, 40), (64, torch.bfloat16, 0)]


def _a2a_inputs(case: int, world_size: int, width: int, dtype: torch.dtype, most: int) -> tuple[list, list]:
    """Every rank's send rows and splits (random counts, zeros included): each rank can compute all."""
    g = torch.Generator().manual_seed(500 + case)
    splits = [[int(torch.randint(0, most + 1, (1,), generator=g)) for _ in range(world_size)]
              for _ in range(world_size)]  # fmt: skip
    shape = (lambda n: (n,)) if width == 0 else (lambda n: (n, width))
    sends = [(torch.randn(shape(sum(sp)), generator=g) * 100).to(dtype) for sp in splits]
    return sends, splits


def _rows_for(send: torch.Tensor, splits: list[int], dest: int) -> torch.Tensor:
    start = sum(splits[:dest])
    return send[start : start + splits[dest]]


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_and_all_gather_match_fixed_order_on_every_rank(tmp_path: Path, world_size: int) -> None:
    assert _run_ranks(_correctness_rank, world_size, tmp_path) == [0] * world_size
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    for key, value in results[0].items():
        for r in range(1, world_size):
            assert value == results[r][key] if key == "path" else torch.equal(value, results[r][key]), key
    assert not os.path.exists(results[0]["path"])


def _dead_peer_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    comm = _join(rank, world_size, port, timeout_s=300.0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a worker gone without a word, before the collective
    error = ""
    try:
        comm.all_reduce(torch.ones(16))
    except CommAbortedError as e:
        error = str(e)
    try:  # the communicator stays aborted: later calls fail at once
        comm.all_gather(torch.ones(4))
    except CommAbortedError as e:
        error += "\n" + str(e)
    Path(out_dir, "error.txt").write_text(f"{comm.path}\n{error}")


def test_a_dead_peer_raises_at_once_instead_of_hanging(tmp_path: Path) -> None:
    """The waiting rank sees the peer's process gone (a zombie counts as gone) long before its 300 s."""
    assert _run_ranks(_dead_peer_rank, 2, tmp_path) == [0, -signal.SIGKILL]
    path, error, later = (tmp_path / "error.txt").read_text().splitlines()
    assert "rank(s) [1] exited" in error
    assert "aborted" in later
    assert not os.path.exists(path)


def _stuck_peer_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    comm = _join(rank, world_size, port, timeout_s=2.0)
    if rank == 1:  # alive but never arrives: the waiting rank gives up after its timeout
        time.sleep(3.5)
        return
    try:
        comm.all_reduce(torch.ones(16))
    except CommAbortedError as e:
        Path(out_dir, "error.txt").write_text(str(e))


def test_a_stuck_peer_raises_after_the_timeout(tmp_path: Path) -> None:
    assert _run_ranks(_stuck_peer_rank, 2, tmp_path) == [0, 0]
    error = (tmp_path / "error.txt").read_text()
    assert "ranks [1] did not reach" in error and "2s" in error


def _abort_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    comm = _join(rank, world_size, port, timeout_s=300.0)
    errors = []
    if rank == 0:  # the supervisor thread saw a worker die while rank 0 waits in a collective
        threading.Timer(0.3, comm.abort, args=("worker 1 exited",)).start()
        try:
            comm.all_reduce(torch.ones(8))
        except CommAbortedError as e:
            errors.append(str(e))
    dist.barrier()  # rank 1 never joined the collective: it only sees the abort afterwards
    try:
        comm.all_reduce(torch.ones(8))
    except CommAbortedError as e:
        errors.append(str(e))
    comm.close()
    Path(out_dir, f"rank{rank}.txt").write_text("\n".join(errors))
    dist.destroy_process_group()


def test_abort_from_another_thread_unblocks_every_rank(tmp_path: Path) -> None:
    assert _run_ranks(_abort_rank, 2, tmp_path) == [0, 0]  # a missed abort: a 300 s wait, then a hang
    rank0 = (tmp_path / "rank0.txt").read_text().splitlines()
    rank1 = (tmp_path / "rank1.txt").read_text().splitlines()
    assert len(rank0) == 2 and len(rank1) == 1
    assert all("rank 0: worker 1 exited" in e for e in rank0 + rank1)


def _no_room_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    if rank == 0:  # /dev/shm full (a container's 64 MB default): reserving the pages fails

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate = full
    try:
        ShmCommunicator.create(None, rank, world_size, max_bytes=MAX_BYTES)
        outcome = "created"
    except ShmUnavailableError as e:
        outcome = str(e)
    Path(out_dir, f"rank{rank}.txt").write_text(outcome)
    dist.destroy_process_group()


def test_no_room_in_dev_shm_is_refused_on_every_rank_without_leftovers(tmp_path: Path) -> None:
    """Every rank learns the segment could not be reserved (so all fall back to gloo together); none
    maps a segment that would SIGBUS on its first large write."""
    before = set(os.listdir("/dev/shm"))
    assert _run_ranks(_no_room_rank, 2, tmp_path) == [0, 0]
    for r in range(2):
        assert "No space left on device" in (tmp_path / f"rank{r}.txt").read_text()
    assert not {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("xllm-")}
