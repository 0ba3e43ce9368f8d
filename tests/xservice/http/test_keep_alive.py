"""HTTP keep-alive outlives the clients' idle expiry (``service.keep_alive_s``, 30 s by default).

httpx and the ``openai`` client drop an idle pooled connection after 5 s. Were the server to close
idle connections at that same moment (uvicorn's default), a client could send a request on a
connection the server was closing and get a connection reset. With the server waiting longer, the
client always gives up on the connection first.
"""

from __future__ import annotations

import http.client
import time

import pytest

from xservice.config import ServiceConfig

CLIENT_IDLE_EXPIRY_S = 5.0  # httpx.Limits().keepalive_expiry, used by the openai client too


def test_idle_connection_survives_the_client_expiry(server) -> None:
    assert server.config["service"].get("keep_alive_s", ServiceConfig.keep_alive_s) > CLIENT_IDLE_EXPIRY_S
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", "/health/live")
        assert conn.getresponse().read() and conn.sock is not None
        sock = conn.sock
        time.sleep(CLIENT_IDLE_EXPIRY_S + 1.0)
        conn.request("GET", "/health/live")  # on a closed socket: RemoteDisconnected / reset
        assert conn.getresponse().status == 200
        assert conn.sock is sock  # the same connection, still open
    finally:
        conn.close()


def test_keep_alive_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep_alive_s"):
        ServiceConfig(keep_alive_s=0).validate()
