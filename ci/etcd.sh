#!/usr/bin/env bash
# Start or stop a loopback-only etcd 3.4 for xllm cluster mode (users and CI).
#   ci/etcd.sh start [--port P] [--data-dir D]    # prints the endpoint; pid in D/etcd.pid
#   ci/etcd.sh stop  [--data-dir D]
set -euo pipefail
CMD=${1:-}
shift || true
PORT=2379
DATA_DIR=${XLLM_ETCD_DATA_DIR:-/tmp/xllm-etcd}
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT=$2; shift 2 ;;
    --data-dir) DATA_DIR=$2; shift 2 ;;
    *) echo "ci/etcd.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
PID_FILE="$DATA_DIR/etcd.pid"

case "$CMD" in
  start)
    command -v etcd >/dev/null || { echo "etcd not found: run ci/install_cluster_deps.sh" >&2; exit 1; }
    mkdir -p "$DATA_DIR"
    if [ -f "$PID_FILE" ] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; then
      echo "etcd already running (pid $(cat "$PID_FILE"))" >&2; echo "127.0.0.1:$PORT"; exit 0
    fi
    PEER_PORT=$((PORT + 1))
    nohup etcd --name xllm --data-dir "$DATA_DIR/data" \
      --listen-client-urls "http://127.0.0.1:$PORT" --advertise-client-urls "http://127.0.0.1:$PORT" \
      --listen-peer-urls "http://127.0.0.1:$PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$PEER_PORT" \
      --initial-cluster "xllm=http://127.0.0.1:$PEER_PORT" >"$DATA_DIR/etcd.log" 2>&1 &
    echo $! >"$PID_FILE"
    for _ in $(seq 1 100); do
      if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && grep -q "ready to serve client" "$DATA_DIR/etcd.log"; then
        echo "127.0.0.1:$PORT"; exit 0
      fi
      kill -0 "$(cat "$PID_FILE")" 2>/dev/null || break
      sleep 0.1
    done
    echo "etcd did not start; see $DATA_DIR/etcd.log" >&2; tail -5 "$DATA_DIR/etcd.log" >&2; exit 1 ;;
  stop)
    if [ -f "$PID_FILE" ]; then
      PID=$(cat "$PID_FILE")
      kill "$PID" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$PID" 2>/dev/null || true
      rm -f "$PID_FILE"
    fi ;;
  *) echo "usage: ci/etcd.sh start|stop [--port P] [--data-dir D]" >&2; exit 2 ;;
esac
