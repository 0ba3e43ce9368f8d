"""A real cluster KV store for tests: ``python -m xengine.process.kv_store_server`` (``mooncake_master``
and its memory) on free loopback ports, stopped by ``stop``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from tests.xservice.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


class StoreServer:
    def __init__(self, restart_delay_s: float = 1.0) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "xengine.process.kv_store_server", "--port", str(self.port)]
        cmd += [
            "--metrics-port",
            str(free_port()),
            "--memory-gb",
            "0.25",
            "--restart-delay-s",
            str(restart_delay_s),
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        line = self.proc.stdout.readline()
        assert line, "the KV store server exited before it was ready"
        self.master = json.loads(line)["store_master"]

    def master_pid(self) -> int:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid), "mooncake_master"], capture_output=True, text=True
        )
        return int(out.stdout.split()[0])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
