"""Instance launchers: ``local`` (subprocesses) and ``ray`` (Ray actors hosting the engine process)."""

from __future__ import annotations

from xservice.cluster.launchers.base import BaseLauncher, InstanceHandle, InstanceSpec


def make_launcher(kind: str) -> BaseLauncher:
    if kind == "local":
        from xservice.cluster.launchers.local import LocalLauncher

        return LocalLauncher()
    if kind == "ray":
        from xservice.cluster.launchers.ray import RayLauncher

        return RayLauncher()
    raise ValueError(f"unknown launcher {kind!r}; valid: local, ray")


__all__ = ["BaseLauncher", "InstanceHandle", "InstanceSpec", "make_launcher"]
