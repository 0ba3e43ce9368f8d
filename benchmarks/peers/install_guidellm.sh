#!/usr/bin/env bash
# Install guidellm (PyPI package `guidellm`, the load generator vLLM's users run) into its own venv,
# benchmarks/peers/.venv-guidellm, for benchmarks/serve_guidellm.py.
#
# Idempotent: an existing venv whose `guidellm` imports at the pinned version is left as it is.
# Its own venv because its pins (transformers, httpx, pydantic) need not agree with the project's.
#
# It needs torch (its data loader), never CUDA: the CPU build is installed first, pinned like ci/setup.sh
# pins it (from pip's find-links on this machine), so pip does not pull ~5 GB of CUDA libraries.
#
# Env: GUIDELLM_VERSION (default 0.8.1), PYTHON (default python3.11), VENV (default below),
#      XLLM_TORCH_VERSION (default 2.13.0, the CPU build ci/setup.sh installs).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VENV:-$HERE/.venv-guidellm}"
PYTHON="${PYTHON:-python3.11}"
GUIDELLM_VERSION="${GUIDELLM_VERSION:-0.8.1}"
TORCH_VERSION="${XLLM_TORCH_VERSION:-2.13.0}"

say() { echo "[install_guidellm] $*"; }

check_import() {
    "$VENV/bin/python" - "$GUIDELLM_VERSION" <<'EOF'
import sys
from importlib.metadata import version

import guidellm  # noqa: F401

found = version("guidellm")
if found != sys.argv[1]:
    sys.exit(f"guidellm {found} installed, {sys.argv[1]} wanted")
print(f"guidellm {found}")
EOF
}

if [[ -x "$VENV/bin/guidellm" ]] && check_import >/dev/null 2>&1; then
    say "already installed in $VENV; nothing to do"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    say "installing torch==$TORCH_VERSION (CPU) first"
    "${PIP[@]}" install --progress-bar off "torch==$TORCH_VERSION"
fi
say "installing guidellm==$GUIDELLM_VERSION (about two minutes)"
"${PIP[@]}" install --progress-bar off "guidellm==$GUIDELLM_VERSION"

if check_import; then
    say "done: $VENV"
else
    say "ERROR: guidellm does not import in $VENV" >&2
    exit 1
fi
