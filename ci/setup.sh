#!/usr/bin/env bash
# Set up everything xllm needs on a fresh Debian 12 / Python 3.11 machine: a virtualenv in .venv
# with the CPU build of torch and the project (editable) with its dev tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH_VERSION=${XLLM_TORCH_VERSION:-2.13.0}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv" >&2
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  # Install torch on its own first and pinned: the CPU wheel, not the CUDA build with its GB of deps.
  echo "[setup] installing torch==${TORCH_VERSION} (CPU)" >&2
  "$VPY" -m pip install -q "torch==${TORCH_VERSION}"
fi

STAMP=.venv/.xllm-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  echo "[setup] installing xllm and its dependencies" >&2
  "$VPY" -m pip install -q -e ".[dev]"
  touch "$STAMP"
fi
# cluster mode: etcd 3.4, libibverbs1, aetcd, ray (skips quickly when present)
# Under CI (CI set, as .ci/run does) nothing is optional: a failed install fails the set-up, so it can
# never turn into a green run with the tests that need it skipped.
if ! ./ci/install_cluster_deps.sh; then
  [ -n "${CI:-}" ] && { echo "[setup] error: cluster deps failed to install (CI needs them)" >&2; exit 1; }
  echo "[setup] cluster deps not installed (optional outside CI; needs root or sudo)" >&2
fi
# the CPU backend's C kernels (ops/cpu_kernels), built once into the cache; without a C compiler or
# AVX-512 the engine runs oneDNN and the torch reference instead
# (under CI a failed build fails the set-up, unless this CPU cannot run them at all: no AVX-512)
if ! "$VPY" - >&2 <<'PY'
import os, sys
from ops.cpu_kernels.build import build_all, kernels_disabled_reason
built = build_all()
print("[setup] CPU kernels:", built)
hardware = kernels_disabled_reason()  # e.g. the CPU lacks AVX-512: nothing to build
# a kernel this CPU cannot run (e.g. the bf16 panel GEMM without avx512_bf16) is not a failed build
failed = [n for n, v in built.items() if v != "ok" and kernels_disabled_reason(n) is None]
sys.exit(bool(os.environ.get("CI")) and hardware is None and bool(failed))
PY
then
  [ -n "${CI:-}" ] && { echo "[setup] error: the CPU kernels failed to build (CI needs them)" >&2; exit 1; }
  echo "[setup] CPU kernels not built: the engine runs oneDNN and the torch reference" >&2
fi
echo "[setup] ready: $("$VPY" -c 'import torch, sys; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")')" >&2
