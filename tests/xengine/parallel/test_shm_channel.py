"""The step channel: rank 0's step messages to the workers through shared memory (one host).

Messages arrive whole and in order through both parities, a payload too large for the channel is
announced for gloo instead, and a waiting worker gives up when the group is aborted or rank 0's
process is gone (never a hang).
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from xengine.parallel import shm_channel
from xengine.parallel.shm_channel import HEADER_WORDS, StepChannel
from xengine.parallel.shm_comm import CommAbortedError


def _pair(tmp_path: Path, capacity: int = 1024, owner: int | None = None, aborted=lambda: False):
    path = tmp_path / "channel"
    path.write_bytes(b"\0" * (2 * (8 * HEADER_WORDS + capacity)))
    owner = os.getpid() if owner is None else owner
    return StepChannel(str(path), 0, capacity, owner, aborted), StepChannel(
        str(path), 1, capacity, owner, aborted
    )


def test_messages_arrive_whole_and_in_order_and_oversized_payloads_go_to_gloo(tmp_path: Path) -> None:
    sender, receiver = _pair(tmp_path, capacity=1024)  # 128 int64
    sizes = [0, 1, 5, 128, 129, 7, 64, 300, 3] * 4
    got: list[tuple[list[int], torch.Tensor | None]] = []
    turn = threading.Semaphore(0)

    def read() -> None:
        for _ in sizes:
            got.append(receiver.receive())
            turn.release()  # the next message only after this one was read (as a step's all-reduce orders them)

    reader = threading.Thread(target=read)
    reader.start()
    sent = []
    for i, n in enumerate(sizes):
        header = [1, i, n, 0, 0, 16, i, 0, n, 0, 0]
        payload = torch.arange(n, dtype=torch.int64) * (i + 1)
        sent.append((header, payload, sender.send(header, payload)))
        turn.acquire()
    reader.join(30)
    assert not reader.is_alive()
    for (header, payload, inline), (got_header, got_payload) in zip(sent, got):
        assert got_header == header
        assert inline == (payload.numel() <= 128)
        if inline:
            assert torch.equal(got_payload, payload)
        else:
            assert got_payload is None  # the worker then takes the payload from gloo


def test_a_waiting_worker_gives_up_when_the_group_is_aborted(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(shm_channel, "LIVENESS_EVERY_S", 0.05)
    monkeypatch.setattr(shm_channel, "SPIN_S", 0.001)
    flag = {"aborted": False}
    _, receiver = _pair(tmp_path, aborted=lambda: flag["aborted"])
    threading.Timer(0.3, lambda: flag.update(aborted=True)).start()
    with pytest.raises(CommAbortedError, match="aborted"):
        receiver.receive()


def test_a_waiting_worker_gives_up_when_rank_0_is_gone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(shm_channel, "LIVENESS_EVERY_S", 0.05)
    monkeypatch.setattr(shm_channel, "SPIN_S", 0.001)
    gone = subprocess.Popen(["true"])
    gone.wait()
    _, receiver = _pair(tmp_path, owner=gone.pid)
    with pytest.raises(CommAbortedError, match=f"pid {gone.pid}"):
        receiver.receive()
