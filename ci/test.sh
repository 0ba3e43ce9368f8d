#!/usr/bin/env bash
# Set up everything, run the lint gates, then the whole test suite (CPU only, no network).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
bash ci/lint.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
