#!/usr/bin/env bash
# Lint gates: ruff check and ruff format --check over the whole tree.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
