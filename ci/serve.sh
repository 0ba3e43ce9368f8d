#!/usr/bin/env bash
# Set up everything, then serve. With no --model it serves the embedded default model
# (generated on first use into ~/.cache/xllm, reused after). Extra args go to `xllm serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
exec .venv/bin/xllm serve "$@"
