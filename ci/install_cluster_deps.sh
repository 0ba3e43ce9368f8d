#!/usr/bin/env bash
# Install what cluster mode needs: etcd 3.4 (Debian etcd-server), libibverbs1 (needed by the Mooncake
# transfer engine), gcc + libc6-dev (PD engines build memory/bind_host/bind_host.c, which keeps the
# transfer engine's listeners on the engine's host), iproute2 (`ss`, used by the tests; `ip` and `tc` for ci/netns.sh) and, into .venv, the Python clients aetcd + ray and the Mooncake transfer engine
# (mooncake-transfer-engine-non-cuda: PD KV transfer over TCP). Idempotent; fast when done.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${VPY:-.venv/bin/python}

if ! command -v etcd >/dev/null 2>&1 || ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 \
  || ! command -v cc >/dev/null 2>&1 || [ ! -f /usr/include/stdio.h ] || ! command -v ss >/dev/null 2>&1 \
  || ! command -v tc >/dev/null 2>&1; then
  echo "[cluster-deps] installing etcd-server, libibverbs1, gcc, libc6-dev and iproute2 (apt)" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server libibverbs1 gcc libc6-dev iproute2 >/dev/null
  # Debian starts the etcd service on install; our tests and ci/etcd.sh run their own.
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
    $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
fi

if ! "$VPY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('aetcd') and u.find_spec('ray')))"; then
  echo "[cluster-deps] installing aetcd and ray into .venv" >&2
  "$VPY" -m pip install -q aetcd ray
fi
if ! "$VPY" -c "import importlib.util as u, sys; sys.exit(not u.find_spec('mooncake.engine'))" 2>/dev/null; then
  echo "[cluster-deps] installing mooncake-transfer-engine-non-cuda into .venv" >&2
  "$VPY" -m pip install -q mooncake-transfer-engine-non-cuda
fi
echo "[cluster-deps] ready: $(etcd --version 2>/dev/null | head -1), aetcd + ray + mooncake in $VPY" >&2
