"""``RayLauncher``: each engine instance hosted by a Ray actor (which owns the engine process).

The actor starts ``python -m xengine.process.engine_server`` as its child (parent-death signal set, so the
engine exits with its actor); the engine registers in the metadata store like any other, so the
service connects to it the same way. Without a Ray cluster address, a local Ray runtime is
started (``ray.init(num_cpus=2, include_dashboard=False)``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from xengine.api.entrypoints import ENGINE_SERVER_MODULE
from xservice.cluster.launchers.base import BaseLauncher, InstanceHandle, InstanceSpec, stop_process
from xservice.engine.process import child_env

RAY_CALL_TIMEOUT_S = 30.0


class EngineHost:
    """The Ray actor body: owns one engine server process."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", ENGINE_SERVER_MODULE, *args, "--parent-pid", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout_s: float) -> None:
        stop_process(self.proc, timeout_s)


class RayHandle(InstanceHandle):
    def __init__(self, name: str, actor: Any) -> None:
        import ray

        self.name = name
        self.actor = actor
        self.pid = ray.get(actor.pid.remote(), timeout=RAY_CALL_TIMEOUT_S)

    def exit_code(self) -> int | None:
        import ray

        try:
            return ray.get(self.actor.poll.remote(), timeout=RAY_CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the actor itself is gone
            return -1

    def kill(self) -> None:
        import ray

        ray.get(self.actor.kill.remote(), timeout=RAY_CALL_TIMEOUT_S)

    def stop(self, timeout_s: float = 10.0) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(timeout_s), timeout=timeout_s + RAY_CALL_TIMEOUT_S)
        finally:
            ray.kill(self.actor)


class RayLauncher(BaseLauncher):
    def __init__(self, address: str | None = None) -> None:
        super().__init__()
        import ray

        if not ray.is_initialized():
            if address:
                ray.init(address=address, include_dashboard=False)
            else:
                ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
        self._actor_cls = ray.remote(num_cpus=0)(EngineHost)

    def launch(self, spec: InstanceSpec) -> RayHandle:
        actor = self._actor_cls.remote(spec.command_args(None), spec.env(child_env()))
        handle = self.handles[spec.name] = RayHandle(spec.name, actor)
        return handle

    def stop_all(self, timeout_s: float = 10.0) -> None:
        import ray

        super().stop_all(timeout_s)
        ray.shutdown()
