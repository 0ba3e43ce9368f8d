"""``cluster.engine_nice``: validated, passed to every launched engine, applied by the engine process
to all of its threads (a real child process here; the launched cluster is checked in
``test_cluster_colocation.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xengine.api.config import EngineConfig
from xservice.cluster.config import ClusterConfig
from xservice.cluster.launchers.base import InstanceSpec


@pytest.mark.parametrize("nice", [-1, 20])
def test_out_of_range_is_refused(nice: int) -> None:
    with pytest.raises(ValueError, match="engine_nice"):
        ClusterConfig(instances="a,b", engine_nice=nice).validate()


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
    code = (
        "import os, threading\n"
        "from xengine.process.engine_server import lower_priority\n"
        "before = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)\n"
        "before.start()\n"
        "lower_priority(7); lower_priority(7)\n"  # twice (a re-exec): still 7
        "after = []\n"
        "t = threading.Thread(target=lambda: after.append(os.getpriority(os.PRIO_PROCESS, 0)))\n"
        "t.start(); t.join()\n"
        "tids = [int(x) for x in os.listdir('/proc/self/task')]\n"
        "print(sorted({os.getpriority(os.PRIO_PROCESS, x) for x in tids}), after)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[7] [7]"
