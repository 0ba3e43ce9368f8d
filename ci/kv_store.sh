#!/usr/bin/env bash
# Start or stop a loopback-only KV store (mooncake_master + its memory) for kv_tiers.store_master
# (users and CI; `xllm kv-store` runs the same in the foreground).
#   ci/kv_store.sh start [--port P] [--memory-gb G] [--dir D]   # prints host:port; pid in D/kv_store.pid
#   ci/kv_store.sh stop  [--dir D]
set -euo pipefail
CMD=${1:-}
shift || true
PORT=50051
MEMORY_GB=4
DIR=/tmp/xllm-kv-store
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT=$2; shift 2 ;;
    --memory-gb) MEMORY_GB=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    *) echo "ci/kv_store.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
PID_FILE="$DIR/kv_store.pid"

case "$CMD" in
  start)
    mkdir -p "$DIR"
    if [ -f "$PID_FILE" ] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; then
      echo "KV store already running (pid $(cat "$PID_FILE"))" >&2; echo "127.0.0.1:$PORT"; exit 0
    fi
    PYTHONPATH="$ROOT" nohup "$PY" -m xengine.process.kv_store_server --port "$PORT" --memory-gb "$MEMORY_GB" \
      >"$DIR/ready.json" 2>"$DIR/kv_store.log" &
    echo $! >"$PID_FILE"
    for _ in $(seq 1 300); do
      if grep -q '"ready": true' "$DIR/ready.json" 2>/dev/null; then echo "127.0.0.1:$PORT"; exit 0; fi
      kill -0 "$(cat "$PID_FILE")" 2>/dev/null || break
      sleep 0.1
    done
    echo "the KV store did not start; see $DIR/kv_store.log" >&2; tail -5 "$DIR/kv_store.log" >&2; exit 1 ;;
  stop)
    if [ -f "$PID_FILE" ]; then
      PID=$(cat "$PID_FILE")
      kill "$PID" 2>/dev/null || true
      for _ in $(seq 1 150); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$PID" 2>/dev/null || true
      rm -f "$PID_FILE"
    fi ;;
  *) echo "usage: ci/kv_store.sh start|stop [--port P] [--memory-gb G] [--dir D]" >&2; exit 2 ;;
esac
