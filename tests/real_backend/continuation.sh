#!/usr/bin/env bash
# Finishing an answer whose worker died, against the real llama-server (Gemma 3 270M):
# prints how often the continued answer equals the uninterrupted one, and fails unless
# every run is one well-formed stream with its prefix intact. RUNS (default 20),
# MAX_TOKENS (64) and SEED choose the runs; API=messages runs `/v1/messages` through
# the `anthropic` client instead of chat completions.
#
# Unlike run.sh's llama-server this one uses a jinja chat template: llama-server treats a
# trailing assistant message as a prefill only then (with --no-jinja the worker sees no
# echo of the prefill and refuses the continuation: the client gets today's error).
set -euo pipefail
cd "$(dirname "$0")/../.."

CACHE=$(contrib/ci/setup-real-backend.sh | tail -n 1)
cargo build --quiet --release --bins

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
LLAMA_PORT=$(free_port); RELAY_PORT=$(free_port)
LOGS=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

"$CACHE/llama-server" -m "$CACHE/gemma3.gguf" --alias gemma3 --host 127.0.0.1 --port "$LLAMA_PORT" \
  -np 2 -c 4096 -t 2 --jinja >"$LOGS/llama.log" 2>&1 & pids+=($!)
WORKER_SECRET=real LISTEN_ADDR="127.0.0.1:$RELAY_PORT" \
  ./target/release/modelrelay-server >"$LOGS/server.log" 2>&1 & pids+=($!)
for _ in $(seq 1 600); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$LLAMA_PORT/health")" = 200 ] && break
  sleep 0.1
done

WORKER_ENV=$(printf '{"WORKER_SECRET":"real","PROXY_URL":"http://127.0.0.1:%s","BACKEND_URL":"http://127.0.0.1:%s","MAX_CONCURRENCY":"2","LOG_LEVEL":"info"}' "$RELAY_PORT" "$LLAMA_PORT")
if ! RELAY="127.0.0.1:$RELAY_PORT" LOGS="$LOGS" WORKER_ENV="$WORKER_ENV" \
    WORKER_BIN=./target/release/modelrelay-worker "$CACHE/venv/bin/python" -u tests/real_backend/continuation.py; then
  for f in server worker-a worker-b; do echo "---- $f log (tail)"; tail -n 20 "$LOGS/$f.log"; done
  exit 1
fi
