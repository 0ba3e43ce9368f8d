"""What a launcher starts (``InstanceSpec``) and the handle it returns (``InstanceHandle``).

An instance is one ``python -m xengine.process.engine_server`` process: it binds its sockets and registers
in the metadata store itself, so the service finds it through the registry whatever launched it.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import subprocess
from dataclasses import dataclass

from xengine.api.config import EngineConfig
from xengine.api.security import ClusterKey, env_with_key


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    role: str
    engine: EngineConfig
    store_url: str
    key_prefix: str = "/xllm"
    host: str = "127.0.0.1"
    lease_ttl_s: float = 3.0
    heartbeat_interval_s: float = 0.5
    key: ClusterKey | None = None  # handed to the engine in its environment; None: --no-auth
    replaces: str | None = None  # a relaunch: the dead incarnation it may take the name over from
    nice: int = 0  # the engine process sets every thread to this nice value at start (0: unchanged)
    netns: str = ""  # a Linux network namespace to run it in (``ip netns exec``; local launcher only)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """The engine process's environment: ``base`` plus the cluster key."""
        return env_with_key(base, self.key)

    def command_args(self, parent_pid: int | None) -> list[str]:
        """Arguments after ``python -m xengine.process.engine_server``."""
        args = [
            "--config-json", json.dumps(dataclasses.asdict(self.engine)),
            "--name", self.name,
            "--role", self.role,
            "--store", self.store_url,
            "--key-prefix", self.key_prefix,
            "--host", self.host,
            "--lease-ttl-s", str(self.lease_ttl_s),
            "--heartbeat-interval-s", str(self.heartbeat_interval_s),
        ]  # fmt: skip
        args += ["--no-auth"] if self.key is None else []
        args += ["--replaces", self.replaces] if self.replaces else []
        args += ["--nice", str(self.nice)] if self.nice else []
        return args + (["--parent-pid", str(parent_pid)] if parent_pid is not None else [])


class InstanceHandle(abc.ABC):
    name: str

    @abc.abstractmethod
    def exit_code(self) -> int | None:
        """None while the engine process runs."""

    @abc.abstractmethod
    def kill(self) -> None:
        """SIGKILL the engine process (tests, benchmarks)."""

    @abc.abstractmethod
    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (drain), then SIGKILL after ``timeout_s``."""


class BaseLauncher(abc.ABC):
    def __init__(self) -> None:
        self.handles: dict[str, InstanceHandle] = {}

    @abc.abstractmethod
    def launch(self, spec: InstanceSpec) -> InstanceHandle: ...

    def stop_all(self, timeout_s: float = 10.0) -> None:
        for handle in self.handles.values():
            handle.stop(timeout_s)
        self.handles.clear()


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (the engine drains), then SIGKILL if it has not exited within ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
