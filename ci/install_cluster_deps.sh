#!/usr/bin/env bash
# Install what cluster mode needs: etcd 3.4 (Debian etcd-server), libibverbs1 (Mooncake transfer
# engine, phase 2) and the Python clients aetcd + ray into .venv. Idempotent; fast when done.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${VPY:-.venv/bin/python}

if ! command -v etcd >/dev/null 2>&1 || ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  echo "[cluster-deps] installing etcd-server and libibverbs1 (apt)" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server libibverbs1 >/dev/null
  # Debian starts the etcd service on install; our tests and ci/etcd.sh run their own.
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
    $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
fi

if ! "$VPY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('aetcd') and u.find_spec('ray')))"; then
  echo "[cluster-deps] installing aetcd and ray into .venv" >&2
  "$VPY" -m pip install -q aetcd ray
fi
echo "[cluster-deps] ready: $(etcd --version 2>/dev/null | head -1), aetcd + ray in $VPY" >&2
