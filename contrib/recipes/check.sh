#!/usr/bin/env bash
# Runs the several-relays recipes in contrib/recipes/ for real, on loopback:
#   two relays (127.0.0.2:18181 and 127.0.0.3:18181), one worker connected to both
#   (PROXY_URL with two entries), the demo backend (127.0.0.1:18180), then in turn
#   nginx (nginx.conf, 127.0.0.1:18182), Caddy (Caddyfile, 127.0.0.1:18183) and round-robin
#   DNS (curl --resolve giving one name both relay addresses; no resolver is changed).
# Through each: a plain and a streamed chat request, then relay A is killed (SIGKILL) and
# the next requests must still succeed; relay A is restarted before the next proxy.
# Prints one result line per proxy and exits 1 if any failed; a proxy that is not
# installed is reported as skipped.
#
# Needs curl and the binaries: target/release (make release; cargo build --release
# --example demo_backend) or target/debug (cargo build --bins --example demo_backend);
# BIN=dir picks another directory. Installs nothing and changes no system service.
set -euo pipefail
cd "$(dirname "$0")/../.."
RECIPES=$PWD/contrib/recipes

if [ -z "${BIN:-}" ]; then
  BIN=target/release
  [ -x "$BIN/examples/demo_backend" ] || BIN=target/debug
fi
for b in modelrelay-server modelrelay-worker examples/demo_backend; do
  [ -x "$BIN/$b" ] || { echo "missing $BIN/$b (see the top of $0)" >&2; exit 2; }
done

BACKEND=127.0.0.1:18180
RELAY_A=127.0.0.2:18181
RELAY_B=127.0.0.3:18181
SECRET=recipes-check-secret
TMP=$(mktemp -d)
chmod 755 "$TMP" # nginx's workers (nobody) write their temp files under it
declare -A pid=()
failed=0

# shellcheck disable=SC2317 # called by the trap
cleanup() {
  local p
  for p in "${pid[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT INT TERM

# Polls `$@` for up to $WAIT_SECS (default 20) seconds; true once it succeeds.
until_ok() {
  local deadline=$((SECONDS + ${WAIT_SECS:-20}))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt "$deadline" ] || return 1
    sleep 0.1
  done
}

# shellcheck disable=SC2317 # called through until_ok
workers_on() { curl -sf "http://$1/health" | grep -q '"workers_connected":1'; }

start_relay() { # name addr
  WORKER_SECRET=$SECRET LISTEN_ADDR=$2 STATE_DIR="$TMP/state-$1" PUBLIC_URL=http://llm.test \
    "$BIN/modelrelay-server" >>"$TMP/relay-$1.log" 2>&1 &
  pid[relay-$1]=$!
}

stop() { # name [signal]
  kill "-${2:-TERM}" "${pid[$1]}" 2>/dev/null || true
  wait "${pid[$1]}" 2>/dev/null || true
  unset "pid[$1]"
}

# Both relays up with the worker registered on each.
both_relays_serving() {
  [ -n "${pid[relay-a]:-}" ] || start_relay a "$RELAY_A"
  until_ok workers_on "$RELAY_A" && until_ok workers_on "$RELAY_B"
}

chat() { # url-base [stream] [curl options...]
  local base=$1 stream=${2:-false}
  shift 2 || shift
  curl -sS -f -m 20 -N "$@" "$base/v1/chat/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"demo\",\"stream\":$stream,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}"
}

plain_ok() { chat "$@" | grep -q 'Hello from the modelrelay demo backend'; }
stream_ok() { # several data: events and the end marker
  local out
  out=$(chat "$1" true "${@:2}") || return 1
  [ "$(grep -c '^data: ' <<<"$out")" -gt 3 ] && grep -q '^data: \[DONE\]' <<<"$out"
}

# The checks through one proxy at `base` (extra curl options after it). Runs in this
# shell (it kills relay A); on failure `why` says what failed.
why=
exercise() { # base [curl options...]
  local base=$1 i
  shift
  plain_ok "$base" false "$@" || { why="plain request failed"; return 1; }
  stream_ok "$base" "$@" || { why="streamed request failed"; return 1; }
  stop relay-a KILL
  for i in $(seq 1 10); do
    plain_ok "$base" false "$@" || { why="request $i after relay A was killed failed"; return 1; }
  done
  stream_ok "$base" "$@" || { why="streamed request after relay A was killed failed"; return 1; }
}

result() { # label status detail
  printf '%-8s %-7s %s\n' "$1" "$2" "$3"
  [ "$2" != FAIL ] || failed=1
}

DEMO_BACKEND_ADDR=$BACKEND "$BIN/examples/demo_backend" >"$TMP/backend.log" 2>&1 &
pid[backend]=$!
start_relay a "$RELAY_A"
start_relay b "$RELAY_B"
WORKER_SECRET=$SECRET PROXY_URL="http://$RELAY_A,http://$RELAY_B" BACKEND_URL="http://$BACKEND" \
  WORKER_NAME=recipes "$BIN/modelrelay-worker" >"$TMP/worker.log" 2>&1 &
pid[worker]=$!
if ! both_relays_serving; then
  tail -n 20 "$TMP"/relay-*.log "$TMP/worker.log" >&2
  echo "the relays never had the worker registered" >&2
  exit 1
fi

# nginx, with its runtime files under $TMP around the recipe (an http-context snippet).
if command -v nginx >/dev/null; then
  cat >"$TMP/nginx-main.conf" <<EOF
pid $TMP/nginx.pid;
error_log $TMP/nginx-error.log;
events {}
http {
    access_log $TMP/nginx-access.log;
    client_body_temp_path $TMP/nginx-body;
    proxy_temp_path $TMP/nginx-proxy;
    fastcgi_temp_path $TMP/nginx-fastcgi;
    uwsgi_temp_path $TMP/nginx-uwsgi;
    scgi_temp_path $TMP/nginx-scgi;
    include $RECIPES/nginx.conf;
}
EOF
  nginx -p "$TMP" -c "$TMP/nginx-main.conf" -g 'daemon off;' >"$TMP/nginx.out" 2>&1 &
  pid[nginx]=$!
  if until_ok curl -sf http://127.0.0.1:18182/health && exercise http://127.0.0.1:18182; then
    result nginx ok "$(nginx -v 2>&1 | sed 's/.*: //'): plain + streamed, then 10 plain + 1 streamed with relay A killed"
  else
    result nginx FAIL "${why:-not listening}; $(tail -n 3 "$TMP/nginx-error.log" 2>/dev/null | tr '\n' ' ')"
  fi
  stop nginx
else
  result nginx skipped "not installed"
fi

# Caddy, with its data and config directories under $TMP.
if command -v caddy >/dev/null && both_relays_serving; then
  HOME=$TMP XDG_DATA_HOME=$TMP/caddy-data XDG_CONFIG_HOME=$TMP/caddy-config \
    caddy run --config "$RECIPES/Caddyfile" --adapter caddyfile >"$TMP/caddy.log" 2>&1 &
  pid[caddy]=$!
  if until_ok curl -sf http://127.0.0.1:18183/health && exercise http://127.0.0.1:18183; then
    result caddy ok "$(caddy version | cut -d' ' -f1): plain + streamed, then 10 plain + 1 streamed with relay A killed"
  else
    result caddy FAIL "${why:-not listening}; $(tail -n 3 "$TMP/caddy.log" | tr '\n' ' ')"
  fi
  stop caddy
elif ! command -v caddy >/dev/null; then
  result caddy skipped "not installed"
else
  result caddy FAIL "relay A did not get the worker back"
fi

# Round-robin DNS: one name, both relay addresses. curl takes them from --resolve instead
# of a resolver and moves on to the next address when one refuses the connection.
if both_relays_serving &&
  exercise http://llm.test:18181 --resolve "llm.test:18181:${RELAY_A%:*},${RELAY_B%:*}"; then
  result dns ok "curl --resolve llm.test → ${RELAY_A%:*},${RELAY_B%:*}: plain + streamed, then 10 plain + 1 streamed with relay A killed"
else
  result dns FAIL "${why:-relay A did not get the worker back}"
fi

exit "$failed"
