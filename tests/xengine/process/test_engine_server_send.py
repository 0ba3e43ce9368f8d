"""An engine server's reply to a service whose output connection is not up yet waits for it
(real zmq sockets over TCP); step outputs to nobody are dropped at once."""

from __future__ import annotations

import threading

import zmq

from xengine.process.engine_server import send_or_drop


def _bound_push(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 0)
    out.bind("tcp://127.0.0.1:0")
    return out, out.getsockopt(zmq.LAST_ENDPOINT).decode()


def test_reply_waits_for_the_late_peer() -> None:
    ctx = zmq.Context()
    out, addr = _bound_push(ctx)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    late = threading.Timer(0.3, pull.connect, args=(addr,))
    late.start()
    try:
        assert send_or_drop(out, b"reply", wait_ms=5000)
        assert pull.poll(5000, zmq.POLLIN)
        assert pull.recv() == b"reply"
    finally:
        late.cancel()
        pull.close()
        out.close()
        ctx.term()


def test_nobody_connected_drops() -> None:
    ctx = zmq.Context()
    out, _ = _bound_push(ctx)
    try:
        assert not send_or_drop(out, b"step", wait_ms=0)
        assert not send_or_drop(out, b"reply", wait_ms=50)
    finally:
        out.close()
        ctx.term()
