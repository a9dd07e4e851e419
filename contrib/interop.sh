#!/usr/bin/env bash
# Interop run against the original ModelRelay (protocol v1), on loopback only:
#   contrib/interop.sh /path/to/original/target/release
# The directory must hold the original's modelrelay-server and modelrelay-worker (built
# from its source; CI cannot fetch it, so this is a script to rerun by hand, not a test).
# Checks, each with a plain and a streamed chat request through the demo backend:
#   1. our server, the original worker;
#   2. the original server, our worker;
#   3. our worker connected to two relays at once (ours and the original): both answer;
#   4. two of our relays, the original worker on one of them and ours on both.
set -euo pipefail
cd "$(dirname "$0")/.."
ORIG="${1:?usage: contrib/interop.sh ORIGINAL_RELEASE_DIR}"
BIN=target/release
for b in "$ORIG/modelrelay-server" "$ORIG/modelrelay-worker" "$BIN/modelrelay-server" "$BIN/modelrelay-worker" "$BIN/examples/demo_backend"; do
  [ -x "$b" ] || { echo "missing $b (make release; cargo build --release --example demo_backend)" >&2; exit 1; }
done

SECRET=interop-secret
pids=()
# shellcheck disable=SC2317 # called by the trap
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 never opened" >&2; return 1; }
# Waits until the relay's /v1/models lists the demo model (a worker registered there).
wait_model() { for _ in $(seq 1 100); do curl -fsS "http://127.0.0.1:$1/v1/models" 2>/dev/null | grep -q '"demo"' && return 0; sleep 0.1; done; echo "no worker on :$1" >&2; return 1; }

BACKEND=$(free_port)
DEMO_BACKEND_ADDR="127.0.0.1:$BACKEND" "$BIN/examples/demo_backend" >/dev/null 2>&1 & pids+=($!)
wait_port "$BACKEND"

server() { # server BINARY PORT
  WORKER_SECRET=$SECRET LISTEN_ADDR="127.0.0.1:$2" RUST_LOG=warn "$1" >/dev/null 2>&1 & pids+=($!)
  wait_port "$2"
}
worker() { # worker BINARY PROXY_URL NAME
  WORKER_SECRET=$SECRET PROXY_URL="$2" BACKEND_URL="http://127.0.0.1:$BACKEND" MODELS=demo \
    WORKER_NAME="$3" MAX_CONCURRENCY=4 RUST_LOG=warn "$1" >/dev/null 2>&1 & pids+=($!)
}
failures=0
check() { # check LABEL PORT
  local plain stream
  plain=$(curl -sS -m 20 "http://127.0.0.1:$2/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"demo","messages":[{"role":"user","content":"hello"}]}' || true)
  stream=$(curl -sS -N -m 20 "http://127.0.0.1:$2/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"demo","stream":true,"messages":[{"role":"user","content":"hello"}]}' || true)
  if grep -q '"choices"' <<<"$plain" && grep -q 'data: \[DONE\]' <<<"$stream"; then
    echo "ok    $1"
  else
    echo "FAIL  $1"; echo "  plain: ${plain:0:200}"; echo "  stream: ${stream:0:200}"; failures=$((failures + 1))
  fi
}

A=$(free_port); server "$BIN/modelrelay-server" "$A"
worker "$ORIG/modelrelay-worker" "http://127.0.0.1:$A" orig-worker
wait_model "$A"; check "our server, original worker" "$A"

O=$(free_port); server "$ORIG/modelrelay-server" "$O"
worker "$BIN/modelrelay-worker" "http://127.0.0.1:$O" our-worker
wait_model "$O"; check "original server, our worker" "$O"

B=$(free_port); server "$BIN/modelrelay-server" "$B"
O2=$(free_port); server "$ORIG/modelrelay-server" "$O2"
worker "$BIN/modelrelay-worker" "http://127.0.0.1:$B,http://127.0.0.1:$O2" multi-homed
wait_model "$B"; wait_model "$O2"
check "our worker on two relays: our relay" "$B"
check "our worker on two relays: the original relay" "$O2"

C=$(free_port); server "$BIN/modelrelay-server" "$C"
D=$(free_port); server "$BIN/modelrelay-server" "$D"
worker "$BIN/modelrelay-worker" "http://127.0.0.1:$C,http://127.0.0.1:$D" ours-both
worker "$ORIG/modelrelay-worker" "http://127.0.0.1:$C" orig-on-one
wait_model "$C"; wait_model "$D"
for _ in 1 2 3; do check "two of our relays, original worker on the first" "$C"; done
check "two of our relays: the second" "$D"

echo "interop: $failures failed"
exit $((failures > 0))
