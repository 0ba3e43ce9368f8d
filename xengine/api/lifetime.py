"""Child processes that do not outlive their parent (Linux ``PR_SET_PDEATHSIG``), torch-free."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Get ``sig`` when the parent ``parent_pid`` dies; exit now if it already has (before the request
    took effect)."""
    set_parent_death_signal(sig)
    if os.getppid() != parent_pid:
        os._exit(1)
