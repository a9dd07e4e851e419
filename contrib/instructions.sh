#!/usr/bin/env bash
# contrib/instructions.sh [BIN_DIR ...]: user-space instructions per request of the
# server and of the worker, counted by valgrind's callgrind (`make bench-instructions`).
#
# CPU time per request on a shared virtual machine moves by a quarter from one minute to
# the next; instruction counts do not (the same build gives the same count within about
# 1 %, whatever else the machine does). They leave out the kernel (system calls, context
# switches), so they judge a change to the relay's own code, not a change in how many
# threads a request wakes: for that, `make bench` and `make bench-profile`.
#
# For each BIN_DIR (default target/release), and each side in turn: a demo backend, the
# server and the worker on loopback ports, that side under callgrind, 400 chat requests to
# warm up, the counters zeroed, then N (default 2000) requests over 4 keep-alive
# connections, and the count divided by N. `STREAM=1` asks for streamed answers instead
# (each read to its end). Needs valgrind and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${N:-2000}
dirs=("$@")
[ ${#dirs[@]} -gt 0 ] || dirs=(target/release)
backend=target/release/examples/demo_backend
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 2; }
[ -x "$backend" ] || { echo "build it first: cargo build --release --example demo_backend" >&2; exit 2; }
work=$(mktemp -d /tmp/instructions.XXXXXX)

drive() { # port count: `count` chat requests over 4 keep-alive connections
  python3 - "$1" "$2" "${STREAM:-0}" <<'PY'
import http.client, sys, threading
port, count = int(sys.argv[1]), int(sys.argv[2])
stream = b"true" if sys.argv[3] == "1" else b"false"
body = b'{"model":"demo","stream":' + stream + b',"max_tokens":16,"messages":[{"role":"user","content":"hello"}]}'
failed = []
def run(k):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    for _ in range(k):
        c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = c.getresponse(); r.read()
        if r.status != 200: failed.append(r.status)
threads = [threading.Thread(target=run, args=(count // 4,)) for _ in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
if failed: sys.exit(f"{len(failed)} requests failed: {sorted(set(failed))}")
PY
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_for() { # url pattern
  for _ in $(seq 1 300); do
    curl -s "$1" 2>/dev/null | grep -q "$2" && return 0
    sleep 0.1
  done
  echo "timed out waiting for $1" >&2; return 1
}

count() { # bin_dir side
  local bins=$1 side=$2
  local out=$work/$side.$RANDOM pids=()
  local bport rport
  bport=$(free_port); rport=$(free_port)
  local vg=(valgrind --tool=callgrind "--callgrind-out-file=$out")
  local s_pre=() w_pre=()
  [ "$side" = server ] && s_pre=("${vg[@]}")
  [ "$side" = worker ] && w_pre=("${vg[@]}")
  local counted
  DEMO_BACKEND_ADDR=127.0.0.1:$bport "$backend" >/dev/null 2>&1 & pids+=($!)
  WORKER_SECRET=s LISTEN_ADDR=127.0.0.1:$rport RUST_LOG=warn "${s_pre[@]}" "$bins/modelrelay-server" \
    >"$work/server.log" 2>&1 & pids+=($!)
  [ "$side" = server ] && counted=$!
  wait_for "http://127.0.0.1:$rport/health" ok
  WORKER_SECRET=s PROXY_URL=http://127.0.0.1:$rport BACKEND_URL=http://127.0.0.1:$bport \
    WORKER_NAME=w MAX_CONCURRENCY=8 RUST_LOG=warn "${w_pre[@]}" "$bins/modelrelay-worker" \
    >"$work/worker.log" 2>&1 & pids+=($!)
  [ "$side" = worker ] && counted=$!
  wait_for "http://127.0.0.1:$rport/health" '"workers_connected":1'
  drive "$rport" 400
  callgrind_control -z "$counted" >/dev/null 2>&1
  drive "$rport" "$n"
  callgrind_control -d "$counted" >/dev/null 2>&1
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  local total
  total=$(awk '/^(summary|totals):/ {print $2; exit}' "$out.1")
  echo $((total / n))
}

printf '%-40s %14s %14s\n' "build ($n requests, stream: ${STREAM:-0})" "server Ir/req" "worker Ir/req"
for d in "${dirs[@]}"; do
  printf '%-40s %14s %14s\n' "$d" "$(count "$d" server)" "$(count "$d" worker)"
done
rm -rf "$work"
