"""An engine process with a Mooncake Store tier (``kv_tiers.store_master``) runs a store client whose
transfer engine binds the wildcard address: it re-executes itself (same pid, same parent) with the
``memory.bind_host`` shim so those listeners bind ``kv_tiers.store_host`` and refuse other local
users (``docs/security.md``, "Mooncake binds"; ``docs/kv_tiers.md``)."""

from __future__ import annotations

import logging
import os
import sys

from xengine.api.config import EngineConfig

logger = logging.getLogger(__name__)


def confine_store_binds(config: EngineConfig, module: str, argv: list[str], host: str | None = None) -> None:
    """Re-execute ``python -m module argv`` under the shim bound to ``host`` (default the store host)
    when the store tier is on and the shim is not loaded yet; returns when there is nothing to do."""
    if not config.kv_tiers.store_master:
        return
    from memory.bind_host import exec_env
    from xengine.api.paths import cache_dir

    host = host or config.kv_tiers.store_host
    env = exec_env(host, os.environ, cache_dir())
    if env is None:
        return
    logger.info("re-executing with the bind shim so the KV store client listens on %s only", host)
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
