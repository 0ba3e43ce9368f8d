"""The Triton kernels of full decode graphs, in Triton's interpreter: ``triton_interpreter_cases.py``
run in a fresh process with ``TRITON_INTERPRET=1`` (Triton reads it at import, and torch.compile
imports Triton earlier in the suite's own process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CASES = Path(__file__).with_name("triton_interpreter_cases.py")


def test_triton_kernels_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(CASES)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
