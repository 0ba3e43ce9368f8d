"""``LocalLauncher``: engine instances as subprocesses of the service (they die with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from xengine.api.entrypoints import ENGINE_SERVER_MODULE
from xservice.cluster.launchers.base import BaseLauncher, InstanceHandle, InstanceSpec, stop_process
from xservice.engine.process import child_env


class LocalHandle(InstanceHandle):
    def __init__(self, name: str, proc: subprocess.Popen) -> None:
        self.name = name
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_process(self.proc, timeout_s)


class LocalLauncher(BaseLauncher):
    def launch(self, spec: InstanceSpec) -> LocalHandle:
        cmd = [sys.executable, "-m", ENGINE_SERVER_MODULE, *spec.command_args(os.getpid())]
        if spec.netns:  # ``ip netns exec`` enters the namespace and execs the engine (same pid)
            cmd = ["ip", "netns", "exec", spec.netns, *cmd]
        # Own session: the terminal's Ctrl-C goes to the service, which stops the engines.
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, env=spec.env(child_env()), start_new_session=True
        )
        handle = self.handles[spec.name] = LocalHandle(spec.name, proc)
        return handle
