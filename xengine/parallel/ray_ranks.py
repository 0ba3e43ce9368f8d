"""Ranks 1..N-1 of an engine instance as Ray actors (``parallel.distributed_executor_backend: ray``).

A placement group holds one bundle per rank (rank 0's, the engine itself, is the one Ray put on its
node); each worker rank is an actor in its bundle that owns the worker process (``python -m xengine.parallel.worker``), so a
rank may sit on another node. Ranks meet over TCP at rank 0's node address. Each rank tells the
group its host (the Ray node id, through ``envs.HOST_ID``): ranks all on one host all-reduce through
shared memory, otherwise through gloo. ``RayRank`` looks like a ``subprocess.Popen`` to the group's
supervisor (``poll``, ``wait``, ``kill``, ``pid``). A worker whose engine died sees its gloo
connection close and exits; a killed actor takes its worker with it (parent-death signal).
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from xengine.api.envs import HOST_ID

RAY_CALL_TIMEOUT_S = 30.0
_POLL_S = 0.1


class RankHost:
    """The actor body: owns one worker process."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        import ray

        env = dict(env, **{HOST_ID.name: ray.get_runtime_context().get_node_id()})
        self.proc = subprocess.Popen([*cmd, "--parent-pid", str(os.getpid())], env=env)

    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class RayRank:
    """The engine's handle on one worker rank hosted by a Ray actor (``Popen``-like)."""

    def __init__(self, actor: Any) -> None:
        import ray

        self.actor = actor
        self.pid = ray.get(actor.pid.remote(), timeout=RAY_CALL_TIMEOUT_S)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        import ray

        if self.returncode is None:
            try:
                self.returncode = ray.get(self.actor.poll.remote(), timeout=RAY_CALL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the actor (or its node) is gone
                self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("ray rank", timeout or 0.0)
            time.sleep(_POLL_S)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        import ray

        try:
            ray.get(self.actor.kill.remote(), timeout=RAY_CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - already gone
            pass
        ray.kill(self.actor)
        self.returncode = self.returncode if self.returncode is not None else -9


class RayRanks:
    """The placement group and the actors of ranks 1..N-1."""

    def __init__(self, address: str, world_size: int, strategy: str, cpus_per_rank: int) -> None:
        import ray
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            ray.init(address=address or "auto", include_dashboard=False, log_to_driver=True)
        self.group = placement_group([{"CPU": cpus_per_rank}] * world_size, strategy=strategy)
        if not self.group.wait(timeout_seconds=120):
            ray.util.remove_placement_group(self.group)
            raise RuntimeError(
                f"the Ray cluster cannot place {world_size} ranks of {cpus_per_rank} CPU(s) with strategy "
                f"{strategy} (STRICT_SPREAD needs one node per rank); add nodes or change "
                "parallel.placement_strategy"
            )
        self.host_id = ray.get_runtime_context().get_node_id()
        self.host_ip = ray.util.get_node_ip_address()
        # rank 0 (this process) takes the bundle Ray put on its own node, the workers the others in order
        nodes = ray.util.placement_group_table(self.group).get("bundles_to_node_id", {})
        own = next((int(i) for i, node in sorted(nodes.items()) if node == self.host_id), 0)
        self.worker_bundles = [i for i in range(world_size) if i != own]

    def start(self, rank: int, cmd: list[str], env: dict[str, str]) -> RayRank:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.worker_bundles[rank - 1]
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=bundle
        )
        actor = ray.remote(num_cpus=0)(RankHost).options(scheduling_strategy=strategy).remote(cmd, env)
        return RayRank(actor)

    def close(self) -> None:
        import ray

        try:
            ray.util.remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 - the cluster is gone already
            pass
