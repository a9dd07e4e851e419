#!/usr/bin/env bash
# Real-backend suite: llama.cpp's llama-server (Gemma 3 270M, 4 slots) behind the real
# modelrelay-server and modelrelay-worker, exercised with the openai and anthropic Python
# SDKs, the ollama client and curl; a second llama-server (--embeddings) serves /api/embed. Prepares its tools with contrib/ci/setup-real-backend.sh (cached).
set -euo pipefail
cd "$(dirname "$0")/../.."

CACHE=$(contrib/ci/setup-real-backend.sh | tail -n 1)
cargo build --quiet --release --bins

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
LLAMA_PORT=$(free_port); RELAY_PORT=$(free_port); FAST_PORT=$(free_port); EMBED_PORT=$(free_port)
ROUTER_PORT=$(free_port); ROUTER_RELAY_PORT=$(free_port)
LOGS=$(mktemp -d)
pids=()
# The router llama-server runs each loaded model as a child process: stop those too.
cleanup() {
  for p in "${pids[@]}"; do pkill -TERM -P "$p" 2>/dev/null || true; done
  kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true
}
trap cleanup EXIT

# The main relay's queue timeout is far above anything the suite runs (four 96-token
# streams on two busy cores can take a minute): a queued request waits for a slot to
# free, whatever the machine's speed. The fast-404 answer for unknown models needs a
# relay older than its queue timeout, so a second relay with a 2 s timeout (and its own
# worker on the same llama-server) serves that one test.
FAST404_QUEUE_TIMEOUT_SECS=2
"$CACHE/llama-server" -m "$CACHE/gemma3.gguf" --alias gemma3 --host 127.0.0.1 --port "$LLAMA_PORT" \
  -np 4 -c 4096 -t 2 --no-jinja --chat-template gemma >"$LOGS/llama.log" 2>&1 & pids+=($!)
# A second llama-server for embeddings (`--embeddings` makes it an embedding server).
"$CACHE/llama-server" -m "$CACHE/gemma3.gguf" --alias gemma3-embed --host 127.0.0.1 --port "$EMBED_PORT" \
  --embeddings --pooling mean -np 1 -c 1024 -t 1 >"$LOGS/llama-embed.log" 2>&1 & pids+=($!)
# llama-server in router mode: the Gemma file under two names, none loaded until asked
# (issue 12's lifecycle tests); --slot-save-path enables slot erase (cache flush).
mkdir -p "$LOGS/models" "$LOGS/slots" "$LOGS/router-state"
ln -s "$CACHE/gemma3.gguf" "$LOGS/models/gemma-a.gguf"; ln -s "$CACHE/gemma3.gguf" "$LOGS/models/gemma-b.gguf"
"$CACHE/llama-server" --models-dir "$LOGS/models" --no-models-autoload --models-max 2 --host 127.0.0.1 \
  --port "$ROUTER_PORT" -np 1 -c 2048 -t 1 --no-jinja --chat-template gemma --slot-save-path "$LOGS/slots" \
  >"$LOGS/llama-router.log" 2>&1 & pids+=($!)
head -c 48 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$LOGS/op.key"
WORKER_SECRET=real LISTEN_ADDR="127.0.0.1:$ROUTER_RELAY_PORT" MODELRELAY_ADMIN_TOKEN=router-admin \
  STATE_DIR="$LOGS/router-state" VERIFIED_OP_TOKEN_KEY_PATH="$LOGS/op.key" \
  ./target/release/modelrelay-server >"$LOGS/server-router.log" 2>&1 & pids+=($!)
WORKER_SECRET=real QUEUE_TIMEOUT_SECS=600 LISTEN_ADDR="127.0.0.1:$RELAY_PORT" \
  ./target/release/modelrelay-server >"$LOGS/server.log" 2>&1 & pids+=($!)
WORKER_SECRET=real QUEUE_TIMEOUT_SECS=$FAST404_QUEUE_TIMEOUT_SECS LISTEN_ADDR="127.0.0.1:$FAST_PORT" \
  ./target/release/modelrelay-server >"$LOGS/server-fast404.log" 2>&1 & pids+=($!)

for _ in $(seq 1 600); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$LLAMA_PORT/health")" = 200 ] && break
  sleep 0.1
done
WORKER_SECRET=real PROXY_URL="http://127.0.0.1:$RELAY_PORT" BACKEND_URL="http://127.0.0.1:$LLAMA_PORT" \
  MAX_CONCURRENCY=4 ./target/release/modelrelay-worker >"$LOGS/worker.log" 2>&1 & pids+=($!)
for _ in $(seq 1 600); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$EMBED_PORT/health")" = 200 ] && break
  sleep 0.1
done
WORKER_SECRET=real PROXY_URL="http://127.0.0.1:$RELAY_PORT" BACKEND_URL="http://127.0.0.1:$EMBED_PORT" \
  WORKER_NAME=embed MAX_CONCURRENCY=1 ./target/release/modelrelay-worker >"$LOGS/worker-embed.log" 2>&1 & pids+=($!)
WORKER_SECRET=real PROXY_URL="http://127.0.0.1:$FAST_PORT" BACKEND_URL="http://127.0.0.1:$LLAMA_PORT" \
  MAX_CONCURRENCY=1 ./target/release/modelrelay-worker >"$LOGS/worker-fast404.log" 2>&1 & pids+=($!)
for _ in $(seq 1 600); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$ROUTER_PORT/health")" = 200 ] && break
  sleep 0.1
done
WORKER_SECRET=real PROXY_URL="http://127.0.0.1:$ROUTER_RELAY_PORT" BACKEND_URL="http://127.0.0.1:$ROUTER_PORT" \
  WORKER_NAME=router MAX_CONCURRENCY=1 ./target/release/modelrelay-worker >"$LOGS/worker-router.log" 2>&1 & pids+=($!)

if ! RELAY="http://127.0.0.1:$RELAY_PORT" LLAMA="http://127.0.0.1:$LLAMA_PORT" MODEL=gemma3 \
    EMBED_MODEL=gemma3-embed RELAY_FAST404="http://127.0.0.1:$FAST_PORT" FAST404_QUEUE_TIMEOUT_SECS=$FAST404_QUEUE_TIMEOUT_SECS \
    ROUTER_RELAY="http://127.0.0.1:$ROUTER_RELAY_PORT" ROUTER_ADMIN=router-admin ROUTER_KEY="$LOGS/op.key" \
    "$CACHE/venv/bin/python" tests/real_backend/test_sdks.py; then
  for f in llama llama-embed llama-router server worker worker-embed server-fast404 worker-fast404 server-router worker-router; do echo "---- $f log (tail)"; tail -n 30 "$LOGS/$f.log"; done
  exit 1
fi
# The routes beyond chat (tokenize, detokenize, apply-template, infill, rerank).
if ! RELAY="http://127.0.0.1:$RELAY_PORT" LLAMA="http://127.0.0.1:$LLAMA_PORT" MODEL=gemma3 \
    "$CACHE/venv/bin/python" tests/real_backend/test_endpoints.py; then
  for f in llama server worker; do echo "---- $f log (tail)"; tail -n 30 "$LOGS/$f.log"; done
  exit 1
fi
# What the context-trim tests made the worker do (one line per trim).
grep -h "pre-trimmed\|refused the prompt\|refusal goes out" "$LOGS/worker.log" | sed 's/^/    worker: /' || true
