#!/usr/bin/env bash
# Cross suite (issue 15): the binaries for other machines, run.
#
#  * x86_64-unknown-linux-musl, natively: the same checks as below without an emulator,
#    built with the opt-in mimalloc allocator.
#  * aarch64-unknown-linux-musl and armv7-unknown-linux-musleabihf, under qemu-user: the
#    server and the worker of that target start, the worker registers, curl gets the demo
#    backend's answer through them (plain and streaming), over plain HTTP/WS and over
#    HTTPS/WSS (ring's ARM code on both ends), then SIGTERM drains both (exit 0).
#  * x86_64-pc-windows-gnu, under wine (when installed): the worker registers with a host
#    server, answers plain and streaming, and Ctrl-C (wine turns SIGINT into CTRL_C_EVENT)
#    drains it while a request is in flight: the request completes, the worker exits 0.
#
# Cross builds use the `cross-test` profile (no LTO, no debug info) and a target directory
# that outlives the CI clone (MODELRELAY_CROSS_TARGET_DIR, default
# ~/.cache/modelrelay/cross-target), so a warm run only builds what changed.
# MODELRELAY_CROSS_TARGETS picks targets; MODELRELAY_CROSS_BIN_DIR=DIR tests prebuilt
# binaries instead (DIR/<target>/modelrelay-{server,worker}[.exe], e.g. from `make dist`;
# their TLS run needs MODELRELAY_CROSS_TLS=1 and a server built with server-tls).
# Ends with "cross: N passed, M failed, K skipped".
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD

HOST_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
CROSS_TARGET_DIR=${MODELRELAY_CROSS_TARGET_DIR:-$HOME/.cache/modelrelay/cross-target}
TARGETS=${MODELRELAY_CROSS_TARGETS:-x86_64-unknown-linux-musl aarch64-unknown-linux-musl armv7-unknown-linux-musleabihf x86_64-pc-windows-gnu}
WINEPREFIX_DIR=${MODELRELAY_WINEPREFIX:-$HOME/.cache/modelrelay/wine}
ANSWER="Hello from the modelrelay demo backend! Your request went client to relay to worker to backend and back."
# Generous: a cold qemu or wine start on a busy 2-core machine takes seconds, not minutes.
WAIT_SECS=${MODELRELAY_CROSS_WAIT_SECS:-120}

passed=0 failed=0 skipped=0
ok() { passed=$((passed + 1)); echo "  ok    $*"; }
fail() { failed=$((failed + 1)); echo "  FAIL  $*"; }
skip() { skipped=$((skipped + 1)); echo "  skip  $*"; }
finish() {
  echo "cross: $passed passed, $failed failed, $skipped skipped"
  [ "$failed" -eq 0 ]
}

TMP=$(mktemp -d)
pids=()
# Wine's own server and services exit by themselves once the last program ends (a run of
# this suite elsewhere on the machine may share the prefix: they are not killed here).
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT

# Polls `cmd...` until it succeeds; fails after WAIT_SECS.
wait_for() {
  local deadline=$((SECONDS + WAIT_SECS))
  until "$@"; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.1
  done
}
# The port a server logged ("listening on 127.0.0.1:PORT"), once it has.
listening_port() { grep -o 'listening on [0-9.]*:[0-9]*' "$1" 2>/dev/null | head -n 1 | sed 's/.*://'; }
have_port() { [ -n "$(listening_port "$1")" ]; }
health() { curl -s "${CURL_TLS[@]}" "$1/health"; }
workers_up() { health "$1" | grep -q "\"workers_connected\":$2[,}]"; }
in_flight() { health "$1" | grep -q "\"in_flight\":$2[,}]"; }
serves_demo() { curl -s "${CURL_TLS[@]}" "$1/v1/models" | grep -q '"id":"demo"'; }
exited() { ! kill -0 "$1" 2>/dev/null; }
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null; }
# Peak RSS of `cmd... --version` (KiB): what qemu-user plus a binary cost before any work.
peak_kib() {
  python3 -c 'import resource, subprocess, sys
subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)' "$@" --version 2>/dev/null || echo "?"
}
CURL_TLS=()

# Plain and streaming chat through the relay at $1; $2 names the case.
chat_checks() {
  local base=$1 what=$2 body stream text
  body=$(curl -s --max-time 60 "${CURL_TLS[@]}" "$base/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"demo","messages":[{"role":"user","content":"Hello!"}]}')
  if grep -qF "\"content\":\"$ANSWER\"" <<<"$body"; then ok "$what: plain answer"; else fail "$what: plain answer: $body"; fi
  stream=$(curl -sN --max-time 60 "${CURL_TLS[@]}" "$base/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"demo","stream":true,"messages":[{"role":"user","content":"Hello!"}]}')
  text=$(grep '^data: {' <<<"$stream" | grep -o '"content":"[^"]*"' | sed 's/^"content":"//; s/"$//' | tr -d '\n')
  if [ "$text" = "$ANSWER" ] && grep -q '^data: \[DONE\]' <<<"$stream"; then
    ok "$what: streamed answer ($(grep -c '^data: {' <<<"$stream") events, [DONE])"
  else
    fail "$what: streamed answer: $(head -c 400 <<<"$stream")"
  fi
}

show_logs() { for f in "$@"; do echo "---- $(basename "$f") (tail)"; tail -n 20 "$f"; done; }

echo "== host: demo backend and server"
if ! cargo build --quiet --all-features --bins --example demo_backend; then
  fail "host build (demo backend, server)"
  finish
  exit 1
fi
HOST_BIN=$HOST_TARGET_DIR/debug
DEMO_BACKEND_ADDR=127.0.0.1:0 "$HOST_BIN/examples/demo_backend" >"$TMP/backend.log" 2>&1 &
pids+=($!)
backend_up() { grep -q 'on http://' "$TMP/backend.log"; }
if ! wait_for backend_up; then fail "demo backend did not start"; show_logs "$TMP/backend.log"; finish; exit 1; fi
BACKEND=$(grep -o 'http://[0-9.:]*' "$TMP/backend.log" | head -n 1)
echo "  demo backend on $BACKEND"

# Certificates for the HTTPS/WSS runs: a private CA and a server certificate for 127.0.0.1.
make_pki() {
  (cd "$TMP" &&
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem -days 2 \
      -subj /CN=modelrelay-cross-ca -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign &&
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout server.key -out server.csr -subj /CN=localhost &&
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n' >ext.cnf &&
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile ext.cnf) >/dev/null 2>&1
}
PKI=no
if command -v openssl >/dev/null && make_pki; then PKI=yes; fi

# Builds (or finds) the binaries of target $1 into BIN; the feature set is server-tls, so
# the same binaries serve the plain and the TLS runs (x86_64 musl: mimalloc as well).
build_target() {
  local t=$1 started=$SECONDS
  if [ -n "${MODELRELAY_CROSS_BIN_DIR:-}" ]; then
    BIN=$MODELRELAY_CROSS_BIN_DIR/$t
    return 0
  fi
  BIN=$CROSS_TARGET_DIR/$t/cross-test
  local what=(--bins --features server-tls)
  # The native musl pair also runs on the opt-in mimalloc allocator (the ARM pairs keep
  # musl's own), so that feature is exercised end to end too.
  [ "$t" = x86_64-unknown-linux-musl ] && what=(--bins --features "server-tls mimalloc")
  [[ $t == *windows* ]] && what=(--bin modelrelay-worker)
  if CARGO_TARGET_DIR=$CROSS_TARGET_DIR contrib/cross/cargo.sh "$t" build --quiet --profile cross-test "${what[@]}"; then
    ok "$t: cross build ($((SECONDS - started)) s)"
  else
    fail "$t: cross build"
    return 1
  fi
}

# One server + worker pair of target $1 under qemu ($2, empty: natively); TLS when $3 = tls.
qemu_run() {
  local t=$1 qemu=$2 mode=$3 dir=$TMP/$1-$3 base port server worker extra=() wextra=() run=()
  [ -z "$qemu" ] || run=("$qemu")
  mkdir -p "$dir"
  CURL_TLS=()
  if [ "$mode" = tls ]; then
    extra=(TLS_CERT_FILE="$TMP/server.pem" TLS_KEY_FILE="$TMP/server.key")
    wextra=(CA_FILE="$TMP/ca.pem")
    CURL_TLS=(--cacert "$TMP/ca.pem")
  fi
  env WORKER_SECRET=cross LISTEN_ADDR=127.0.0.1:0 STATE_DIR="$dir" DRAIN_TIMEOUT_SECS=30 "${extra[@]}" \
    "${run[@]}" "$BIN/modelrelay-server" >"$dir/server.log" 2>&1 &
  server=$!
  pids+=("$server")
  if ! wait_for have_port "$dir/server.log"; then
    fail "$t ($mode): server did not listen"; show_logs "$dir/server.log"; kill "$server"; return
  fi
  port=$(listening_port "$dir/server.log")
  if [ "$mode" = tls ]; then base=https://127.0.0.1:$port; else base=http://127.0.0.1:$port; fi
  if wait_for serves_health "$base"; then ok "$t ($mode): server starts${qemu:+ under qemu}, /health answers"; else
    fail "$t ($mode): /health"; show_logs "$dir/server.log"; kill "$server"; return
  fi
  env WORKER_SECRET=cross PROXY_URL="$base" BACKEND_URL="$BACKEND" WORKER_NAME="$t" DRAIN_TIMEOUT_SECS=30 "${wextra[@]}" \
    "${run[@]}" "$BIN/modelrelay-worker" >"$dir/worker.log" 2>&1 &
  worker=$!
  pids+=("$worker")
  if wait_for workers_up "$base" 1 && wait_for serves_demo "$base"; then
    ok "$t ($mode): worker registers$([ "$mode" = tls ] && echo ' over wss://'), model demo listed"
  else
    fail "$t ($mode): worker did not register"; show_logs "$dir/server.log" "$dir/worker.log"
    kill "$server" "$worker"; return
  fi
  chat_checks "$base" "$t ($mode)"
  if [ "$mode" = plain ] && [ -z "$qemu" ]; then
    IDLE_RSS+=("$t: server $(rss_kib "$server") KiB, worker $(rss_kib "$worker") KiB after 2 requests (native)")
  elif [ "$mode" = plain ]; then
    # Indicative: qemu-user's RSS is the guest's plus the emulator's own.
    IDLE_RSS+=("$t: server $(rss_kib "$server") KiB, worker $(rss_kib "$worker") KiB after 2 requests; qemu-user running \`--version\`: $(peak_kib "$qemu" "$BIN/modelrelay-server") / $(peak_kib "$qemu" "$BIN/modelrelay-worker") KiB")
  fi
  kill -TERM "$worker"
  if wait_for exited "$worker" && wait "$worker"; then ok "$t ($mode): worker drains on SIGTERM, exit 0"; else
    fail "$t ($mode): worker exit after SIGTERM"; show_logs "$dir/worker.log"
  fi
  kill -TERM "$server"
  if wait_for exited "$server" && wait "$server"; then ok "$t ($mode): server drains on SIGTERM, exit 0"; else
    fail "$t ($mode): server exit after SIGTERM"; show_logs "$dir/server.log"
  fi
  CURL_TLS=()
}
serves_health() { [ "$(curl -s -o /dev/null -w '%{http_code}' "${CURL_TLS[@]}" "$1/health")" = 200 ]; }

qemu_for() {
  local arch=$1 q
  for q in "qemu-$arch-static" "qemu-$arch"; do
    command -v "$q" >/dev/null && { command -v "$q"; return 0; }
  done
  return 1
}

# The file(1) description every binary of the target must match.
describe() {
  case $1 in
    x86_64-unknown-linux-musl) echo 'ELF 64-bit LSB.*x86-64.*static(-pie)? linked' ;;
    aarch64-*) echo 'ELF 64-bit LSB.*ARM aarch64.*statically linked' ;;
    armv7-*) echo 'ELF 32-bit LSB.*ARM, EABI5.*statically linked' ;;
    *windows*) echo 'PE32\+ executable.*console.*x86-64' ;;
  esac
}
check_binaries() {
  local t=$1 f d
  d=$(describe "$t")
  for f in "$@"; do
    [ "$f" = "$t" ] && continue
    if file -b "$f" | grep -qE "$d"; then ok "$t: $(basename "$f") is $(file -b "$f" | cut -d, -f1-2)"; else
      fail "$t: $(basename "$f"): $(file -b "$f" 2>&1)"
    fi
  done
}

IDLE_RSS=()
linux_target() {
  local t=$1 arch=$2 qemu=
  echo
  echo "== $t ($([ "$arch" = native ] && echo natively || echo qemu-user))"
  build_target "$t" || return
  check_binaries "$t" "$BIN/modelrelay-server" "$BIN/modelrelay-worker"
  if [ "$arch" != native ] && ! qemu=$(qemu_for "$arch"); then
    fail "$t: qemu-$arch-static not found (apt-get install qemu-user-static)"
    return
  fi
  qemu_run "$t" "$qemu" plain
  if [ "$PKI" != yes ]; then
    skip "$t: TLS run (openssl not available)"
  elif [ -n "${MODELRELAY_CROSS_BIN_DIR:-}" ] && [ "${MODELRELAY_CROSS_TLS:-0}" != 1 ]; then
    skip "$t: TLS run (prebuilt binaries: MODELRELAY_CROSS_TLS=1 if the server has server-tls)"
  else
    qemu_run "$t" "$qemu" tls
  fi
}

WINE=$(command -v wine64 || command -v wine || { [ -x /usr/lib/wine/wine64 ] && echo /usr/lib/wine/wine64; } || true)

windows_target() {
  local t=x86_64-pc-windows-gnu dir=$TMP/windows server base worker slow started
  echo
  echo "== $t (wine)"
  build_target "$t" || return
  check_binaries "$t" "$BIN/modelrelay-worker.exe"
  # The cfg(windows) code (src/signals.rs) gets the host's lint bar too.
  if [ -z "${MODELRELAY_CROSS_BIN_DIR:-}" ]; then
    if CARGO_TARGET_DIR=$CROSS_TARGET_DIR contrib/cross/cargo.sh "$t" clippy --quiet --lib --bins -- -D warnings >"$TMP/clippy-windows.log" 2>&1; then
      ok "$t: clippy -D warnings (lib and binaries)"
    else
      fail "$t: clippy"; cat "$TMP/clippy-windows.log"
    fi
  fi
  if [ -z "$WINE" ]; then
    skip "$t: end to end under wine (wine64 not installed: apt-get install wine64)"
    return
  fi
  mkdir -p "$dir" "$WINEPREFIX_DIR"
  export WINEPREFIX=$WINEPREFIX_DIR WINEDEBUG=-all
  if [ ! -f "$WINEPREFIX_DIR/system.reg" ]; then
    started=$SECONDS
    "$WINE" wineboot --init >"$dir/wineboot.log" 2>&1
    echo "  wine prefix created in $((SECONDS - started)) s ($WINEPREFIX_DIR, kept for the next run)"
  fi
  cp "$BIN/modelrelay-worker.exe" "$dir/"
  # Rust's std imports ProcessPrng from bcryptprimitives.dll (Windows 10+); Wine before 9
  # lacks it. A two-line shim next to the exe (RtlGenRandom underneath) stands in for it.
  if ! "$WINE" "$dir/modelrelay-worker.exe" --version >"$dir/version.txt" 2>&1; then
    if x86_64-w64-mingw32-gcc -O2 -shared -o "$dir/bcryptprimitives.dll" tests/cross/wine/bcryptprimitives.c -ladvapi32 &&
      "$WINE" "$dir/modelrelay-worker.exe" --version >"$dir/version.txt" 2>&1; then
      echo "  (this Wine lacks bcryptprimitives.dll: using tests/cross/wine/bcryptprimitives.c)"
    else
      fail "$t: modelrelay-worker.exe --version under wine: $(tail -n 3 "$dir/version.txt")"
      return
    fi
  fi
  ok "$t: runs under $("$WINE" --version 2>/dev/null || echo wine): $(tr -d '\r' <"$dir/version.txt")"

  env WORKER_SECRET=cross LISTEN_ADDR=127.0.0.1:0 STATE_DIR="$dir" "$HOST_BIN/modelrelay-server" >"$dir/server.log" 2>&1 &
  server=$!
  pids+=("$server")
  if ! wait_for have_port "$dir/server.log"; then fail "$t: host server did not listen"; return; fi
  base=http://127.0.0.1:$(listening_port "$dir/server.log")
  WORKER_SECRET=cross PROXY_URL="$base" BACKEND_URL="$BACKEND" WORKER_NAME=windows DRAIN_TIMEOUT_SECS=60 \
    "$WINE" "$dir/modelrelay-worker.exe" >"$dir/worker.log" 2>&1 &
  worker=$!
  pids+=("$worker")
  if wait_for workers_up "$base" 1 && wait_for serves_demo "$base"; then ok "$t: worker registers under wine"; else
    fail "$t: worker did not register under wine"; show_logs "$dir/worker.log"; return
  fi
  chat_checks "$base" "$t"
  # Ctrl-C while a request is in flight (the backend holds it 3 s): the worker stops taking
  # work, the server stops routing to it, the request completes, the worker exits 0.
  curl -s --max-time 60 "$base/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"demo","scenario":"delay:3000","messages":[{"role":"user","content":"Hello!"}]}' >"$dir/slow.json" &
  slow=$!
  if ! wait_for in_flight "$base" 1; then fail "$t: slow request never in flight"; return; fi
  kill -INT "$worker"
  not_listed() { ! serves_demo "$1"; }
  if wait_for not_listed "$base" && ! exited "$slow"; then ok "$t: Ctrl-C: server stops routing to the draining worker"; else
    fail "$t: Ctrl-C: worker still routable or request already over"
  fi
  wait "$slow"
  if grep -qF "\"content\":\"$ANSWER\"" "$dir/slow.json"; then ok "$t: Ctrl-C: in-flight request completes"; else
    fail "$t: Ctrl-C: in-flight request: $(head -c 300 "$dir/slow.json")"
  fi
  if wait_for exited "$worker" && wait "$worker"; then ok "$t: Ctrl-C: worker drained, exit 0"; else
    fail "$t: Ctrl-C: worker exit status"; show_logs "$dir/worker.log"
  fi
  if grep -q 'graceful shutdown (signal): finishing 1 in-flight' "$dir/worker.log"; then
    ok "$t: Ctrl-C arrived as a drain with the request in flight"
  else
    fail "$t: no drain with 1 in flight in the worker log"; show_logs "$dir/worker.log"
  fi
  kill -TERM "$server"
  wait "$server" 2>/dev/null
}

for t in $TARGETS; do
  case $t in
    x86_64-unknown-linux-musl) linux_target "$t" native ;;
    aarch64-unknown-linux-musl) linux_target "$t" aarch64 ;;
    armv7-unknown-linux-musleabihf) linux_target "$t" arm ;;
    x86_64-pc-windows-gnu) windows_target ;;
    *) fail "$t: no cross test for this target" ;;
  esac
done

if [ ${#IDLE_RSS[@]} -gt 0 ]; then
  echo
  echo "== idle RSS (under qemu-user: indicative, the emulator's own memory included)"
  printf '  %s\n' "${IDLE_RSS[@]}"
fi
finish
