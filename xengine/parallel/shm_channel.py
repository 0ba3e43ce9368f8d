"""Rank 0's step messages to the workers through shared memory, when every rank is on one host.

Over gloo a step costs two broadcasts (~0.3 ms each with a waiting peer); here rank 0 writes the
message and bumps a sequence word, and each worker, polling, copies it out. Two parities: message
``seq`` goes to parity ``seq % 2``. Rank 0 writes message ``seq + 2`` over ``seq`` only after step
``seq + 1``'s forward, whose first all-reduce every worker reaches after reading ``seq + 1`` (and so
``seq``): tensor parallelism, the only user, has collectives in every forward.

A worker spins (yielding) for ``SPIN_S`` after a message, which covers rank 0's host work between
two decode steps, then sleeps between polls, longer the longer the engine idles. It gives up when the
group's communicator was aborted (a rank died) or rank 0's process is gone.

Memory ordering: as ``shm_comm.py`` (x86 TSO: data stores, then the sequence word).
"""

from __future__ import annotations

import mmap
import os
import time

import torch
import torch.distributed as dist

from xengine.parallel.shm_comm import CommAbortedError, create_segment

HEADER_WORDS = 16  # seq, header length, payload length (-1: the payload follows over gloo), header
SPIN_S = 0.005
MAX_SLEEP_S = 0.001
LIVENESS_EVERY_S = 1.0


class StepChannel:
    def __init__(self, path: str, rank: int, capacity: int, owner_pid: int, aborted: object) -> None:
        self.rank, self.capacity, self.owner_pid = rank, capacity, owner_pid
        self._aborted = aborted  # () -> bool: the communicator's abort word
        size = 2 * (8 * HEADER_WORDS + capacity)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        stride = HEADER_WORDS + capacity // 8
        self._words = torch.frombuffer(self._mm, dtype=torch.int64).view(2, stride)
        self._seq = 0

    @classmethod
    def create(cls, group: object, rank: int, capacity: int, aborted: object) -> StepChannel:
        """Collective over ``group``: rank 0 creates the segment, every rank maps it, rank 0 unlinks it
        (``ShmUnavailableError`` on every rank when ``/dev/shm`` cannot hold it)."""
        capacity = -(-capacity // 64) * 64
        path = create_segment(group, rank, "step", 2 * (8 * HEADER_WORDS + capacity))
        info: list[object] = [os.getpid()]
        try:
            dist.broadcast_object_list(info, src=0, group=group)
            channel = cls(path, rank, capacity, int(info[0]), aborted)  # type: ignore[arg-type]
            dist.barrier(group=group)
        finally:
            if rank == 0:
                os.unlink(path)
        return channel

    def send(self, header: list[int], payload: torch.Tensor) -> bool:
        """Rank 0: publish one message; False when the payload did not fit (send it over gloo next)."""
        self._seq += 1
        row = self._words[self._seq & 1]
        inline = payload.numel() * 8 <= self.capacity
        n = payload.numel() if inline else -1
        row[1] = len(header)
        row[2] = n
        row[3 : 3 + len(header)] = torch.tensor(header, dtype=torch.int64)
        if inline and n:
            row[HEADER_WORDS : HEADER_WORDS + n].copy_(payload)
        row[0] = self._seq  # last: readers see the message whole
        return inline

    def receive(self) -> tuple[list[int], torch.Tensor | None]:
        """A worker: the next message's header and payload (None: it follows over gloo)."""
        self._seq += 1
        row = self._words[self._seq & 1]
        self._wait(row)
        header = row[3 : 3 + int(row[1])].tolist()
        n = int(row[2])
        payload = row[HEADER_WORDS : HEADER_WORDS + n].clone() if n >= 0 else None
        return header, payload

    def _wait(self, row: torch.Tensor) -> None:
        seq = self._seq
        start = last_check = time.monotonic()
        while int(row[0]) != seq:
            now = time.monotonic()
            if now - start < SPIN_S:
                os.sched_yield()
                continue
            time.sleep(min(MAX_SLEEP_S, (now - start) / 50))
            if now - last_check >= LIVENESS_EVERY_S:
                last_check = now
                if self._aborted():
                    raise CommAbortedError("the tensor-parallel group was aborted (a rank died)")
                if not _alive(self.owner_pid):
                    raise CommAbortedError(f"rank 0 (pid {self.owner_pid}) is gone")

    def close(self) -> None:
        self._words = None
        try:
            self._mm.close()
        except BufferError:  # a view still alive: the mapping goes with the process
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
