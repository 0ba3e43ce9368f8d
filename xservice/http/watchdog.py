"""The watchdog around ``xllm serve``: restarts the API server after a crash it could not survive.

The service survives what Python can catch; a native crash (a fault in a C extension, the OOM
killer, ``kill -9``) ends its process, and its engines die with it. So ``xllm serve`` runs the real
server as a child and stays a small parent that holds the listening socket (clients queue on it
while a new child starts instead of being refused) and restarts the child after an abnormal exit,
with the engine restart policy's backoff and budget. Batch jobs resume in the new child from their
store, and lines that were in flight when it crashed count an attempt (poison lines end quarantined).
SIGINT / SIGTERM go to the child, whose exit code the watchdog returns; a clean exit (0, or 1 once
the engine supervisor gave up) is not restarted. ``--no-watchdog`` runs the server directly, for
process managers that restart it themselves (``docs/operations.md``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from xengine.api.envs import SERVE_LISTEN_FD, WATCHDOG_PID
from xengine.api.lifetime import die_with_parent
from xservice.policies.restart import RestartPolicy

LISTEN_FD_ENV = SERVE_LISTEN_FD.name  # set in the child: the inherited listening socket's fd
WATCHDOG_ENV = WATCHDOG_PID.name  # set in the child: the watchdog's pid (the child dies with it)
CLEAN_EXIT_CODES = (0, 1, 2, 130)  # served and stopped, gave up, usage error, interrupted


def inherited_socket() -> socket.socket | None:
    """In a watchdog's child: the listening socket it handed down (None when run directly)."""
    fd = SERVE_LISTEN_FD.pop()
    if not fd:
        return None
    parent = WATCHDOG_PID.pop()
    if parent:  # a killed watchdog leaves no server behind
        die_with_parent(int(parent))
    return socket.socket(fileno=int(fd))


def run_watchdog(argv: list[str], sock: socket.socket, policy: RestartPolicy) -> int:
    """Run ``xllm <argv>`` as a child serving on ``sock`` until it exits cleanly or the restart budget
    is spent; returns the exit code for ``xllm serve``."""
    watchdog = _Watchdog(argv, sock)
    watchdog.install_signals()
    restarts: list[float] = []
    try:
        while True:
            code = watchdog.run_child()
            if watchdog.stopping or code in CLEAN_EXIT_CODES:
                return code if code >= 0 else 128 - code
            delay = policy.delay(restarts, time.monotonic())
            if delay is None:
                _say(
                    f"error: the API server crashed {policy.max_restarts + 1} times within "
                    f"{policy.window_s:.0f}s; giving up"
                )
                return 1
            _say(f"the API server {_how(code)}; restarting it in {delay:.1f}s")
            if watchdog.sleep(delay):
                return 128 + signal.SIGTERM
            restarts.append(time.monotonic())
    finally:
        watchdog.restore_signals()


class _Watchdog:
    def __init__(self, argv: list[str], sock: socket.socket) -> None:
        self.argv = [sys.executable, "-m", "xservice", *argv]
        self.sock = sock
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self._saved: dict[int, Any] = {}

    def run_child(self) -> int:
        env = {**os.environ, LISTEN_FD_ENV: str(self.sock.fileno()), WATCHDOG_ENV: str(os.getpid())}
        # its own process group: a terminal's Ctrl-C reaches the watchdog only, which forwards it once
        self.child = subprocess.Popen(self.argv, env=env, pass_fds=(self.sock.fileno(),), process_group=0)
        return self.child.wait()

    def install_signals(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._saved[sig] = signal.signal(sig, self._forward)

    def restore_signals(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _forward(self, signum: int, frame: Any) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def sleep(self, seconds: float) -> bool:
        """Back off before a restart; True when a stop signal came meanwhile."""
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.1, deadline - time.monotonic()))
        return self.stopping


def _how(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _say(message: str) -> None:
    print(f"xllm watchdog: {message}", file=sys.stderr, flush=True)
