"""``cluster.launch.engine_nice``: validated, passed to every launched engine, applied by the engine process
to all of its threads (a real child process here; the launched cluster is checked in
``test_cluster_colocation.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xengine.api.config import EngineConfig
from xservice.cluster.config_legacy import cluster_from_dict
from xservice.cluster.launchers.base import InstanceSpec


@pytest.mark.parametrize("nice", [-1, 20])
def test_out_of_range_is_refused(nice: int) -> None:
    with pytest.raises(ValueError, match="engine_nice"):
        cluster_from_dict({"launch": {"instances": "a,b", "engine_nice": nice}}).validate()


def test_engine_server_refuses_a_negative_nice() -> None:
    from xengine.process.engine_server import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--config-json", "{}", "--name", "e0", "--store", "x", "--nice", "-5"])


def test_spec_passes_it_only_when_set() -> None:
    spec = InstanceSpec("e0", "mixed", EngineConfig(), "embedded+tcp://127.0.0.1:1")
    assert "--nice" not in spec.command_args(None)
    args = InstanceSpec("e0", "mixed", EngineConfig(), "embedded+tcp://127.0.0.1:1", nice=7).command_args(
        None
    )
    assert args[args.index("--nice") + 1] == "7"


def test_lower_priority_reaches_every_thread_and_is_absolute() -> None:
    """Threads started before and after ``lower_priority`` end up at nice 7, however often it runs.

    ``before`` is held alive until every thread was read, so it is checked for certain; a thread that
    ends between ``listdir`` and ``getpriority`` (one of the interpreter's or torch's) is skipped, not a
    failure."""
    code = (
        "import os, threading\n"
        "from xengine.process.engine_server import lower_priority\n"
        "started, stop = threading.Event(), threading.Event()\n"
        "before = threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True)\n"
        "before.start(); started.wait()\n"
        "lower_priority(7); lower_priority(7)\n"  # twice (a re-exec): still 7
        "after = []\n"
        "t = threading.Thread(target=lambda: after.append(os.getpriority(os.PRIO_PROCESS, 0)))\n"
        "t.start(); t.join()\n"
        "def nice(tid):\n"
        "    try:\n"
        "        return os.getpriority(os.PRIO_PROCESS, tid)\n"
        "    except ProcessLookupError:\n"  # the thread ended after listdir
        "        return None\n"
        "seen = {tid: nice(tid) for tid in map(int, os.listdir('/proc/self/task'))}\n"
        "print(seen[os.getpid()], seen[before.native_id], after,\n"
        "      sorted({v for v in seen.values() if v is not None}))\n"
        "stop.set()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "7 7 [7] [7]"  # main thread, the earlier thread, a later one, all that remain
