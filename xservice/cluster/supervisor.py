"""``InstanceSupervisor``: relaunches launched engine instances whose process exited.

It watches every handle of a launcher (local subprocesses, Ray actors). When an instance's process
exits, the pool fails its requests over at once (migration), and the supervisor launches it again
under the same name after a backoff chosen by ``RestartPolicy``; the new process registers a new
incarnation (taking the name over from the dead one at once, without waiting for its lease) and the
pool connects to it like to any instance. Once an instance used up its restart
budget the supervisor gives up on it loudly. Attach mode (``launcher: external``) launches nothing,
so it supervises nothing: standalone engines belong to the user's process manager. A process that
only stalled past its lease (and never exited) is not relaunched in any mode: it rejoins by itself
as a new incarnation once it resumes (``xengine/process/cluster_agent.py``, docs/cluster.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from xservice.cluster.launchers import BaseLauncher, InstanceSpec
from xservice.policies.restart import RestartPolicy

logger = logging.getLogger(__name__)

LOCAL_WATCH_INTERVAL_S = 0.1
REMOTE_WATCH_INTERVAL_S = 1.0


class InstanceSupervisor:
    def __init__(
        self,
        launcher: BaseLauncher,
        specs: dict[str, InstanceSpec],
        policy: RestartPolicy,
        mark_dead: Any,  # pool.mark_dead(name, reason)
        incarnation_of: Callable[[str], str | None] | None = None,  # the registered incarnation of a name
    ) -> None:
        self.launcher = launcher
        self._incarnation_of = incarnation_of
        self.specs = specs
        self.policy = policy
        self._mark_dead = mark_dead
        self._restart_times: dict[str, list[float]] = {name: [] for name in specs}
        self.num_restarts: dict[str, int] = {name: 0 for name in specs}
        self.gave_up: set[str] = set()
        self.restarting: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Watch the launched processes until cancelled."""
        try:
            while True:
                for name, handle in list(self.launcher.handles.items()):
                    if name in self.restarting or name in self.gave_up:
                        continue
                    code = (
                        handle.exit_code() if _is_local(handle) else await asyncio.to_thread(handle.exit_code)
                    )
                    if code is not None:
                        self._on_exit(name, code)
                local = all(_is_local(h) for h in self.launcher.handles.values())
                await asyncio.sleep(LOCAL_WATCH_INTERVAL_S if local else REMOTE_WATCH_INTERVAL_S)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _on_exit(self, name: str, code: int) -> None:
        _say(f"instance {name} exited with code {code}")
        # its registered incarnation is this process's (or an older, also dead, one's): the relaunch
        # may take the name over from it at once
        dead = self._incarnation_of(name) if self._incarnation_of is not None else None
        self._mark_dead(name, f"process exited with code {code}")
        self.restarting.add(name)
        task = asyncio.get_running_loop().create_task(self._relaunch(name, dead), name=f"relaunch-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _relaunch(self, name: str, dead_incarnation: str | None = None) -> None:
        times = self._restart_times[name]
        delay = self.policy.delay(times, time.monotonic())
        if delay is None:
            self.restarting.discard(name)
            self.gave_up.add(name)
            _say(
                f"error: instance {name} died {self.policy.max_restarts + 1} times within "
                f"{self.policy.window_s:.0f}s; giving up on it"
            )
            return
        _say(f"relaunching instance {name} in {delay:.1f}s (restart {self.num_restarts[name] + 1})")
        await asyncio.sleep(delay)
        times.append(time.monotonic())
        self.num_restarts[name] += 1
        try:
            spec = dataclasses.replace(self.specs[name], replaces=dead_incarnation)
            await asyncio.to_thread(self.launcher.launch, spec)
        except Exception as e:  # noqa: BLE001 - counts as a failed restart; the watch loop retries
            logger.error("relaunching instance %s failed: %s", name, e)
        finally:
            self.restarting.discard(name)


def _is_local(handle: Any) -> bool:
    return hasattr(handle, "proc")


def _say(message: str) -> None:
    print(f"xllm: {message}", file=sys.stderr, flush=True)
