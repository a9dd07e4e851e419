#!/usr/bin/env bash
# Packaging suite (issue 15):
#  * shellcheck over every shell script (init scripts as dash, which OpenWrt's ash matches);
#  * the OpenWrt procd scripts in a harness of stubs (tests/packaging/openwrt.sh, under
#    busybox sh when installed);
#  * contrib/dist.sh: tarball contents, SHA256SUMS, reproducible output;
#  * contrib/install.sh into temporary DESTDIRs, with fake useradd/getent/chown/uname on
#    PATH (this machine is not modified): arch choice, checksum refusal, files and modes,
#    user and state dir, idempotence, kept configuration, OpenWrt layout, --prefix;
#  * contrib/docker: structural lint (tests/packaging/lint_docker.py) and, when buildah
#    works here, the server and worker images built from the Dockerfile (prebuilt static
#    binaries) and run: a worker registers, curl gets answers, SIGTERM drains both.
# Ends with "packaging: N passed, M failed, K skipped".
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
HOST_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
CROSS_TARGET_DIR=${MODELRELAY_CROSS_TARGET_DIR:-$HOME/.cache/modelrelay/cross-target}
ANSWER="Hello from the modelrelay demo backend! Your request went client to relay to worker to backend and back."
WAIT_SECS=60

passed=0 failed=0 skipped=0
ok() { passed=$((passed + 1)); echo "  ok    $*"; }
fail() { failed=$((failed + 1)); echo "  FAIL  $*"; }
skip() { skipped=$((skipped + 1)); echo "  skip  $*"; }
# Counts the "ok"/"FAIL" lines of a sub-harness's output ($1: file).
tally() {
  local n
  n=$(grep -c '^ok ' "$1"); passed=$((passed + n))
  n=$(grep -c '^FAIL ' "$1"); failed=$((failed + n))
  sed 's/^/  /' "$1"
}
finish() {
  echo "packaging: $passed passed, $failed failed, $skipped skipped"
  [ "$failed" -eq 0 ]
}

TMP=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  [ -z "${BUILDAH_ROOT:-}" ] || buildah_cmd rm -a >/dev/null 2>&1
  rm -rf "$TMP"
}
trap cleanup EXIT
wait_for() {
  local deadline=$((SECONDS + WAIT_SECS))
  until "$@"; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.1
  done
}

echo "== shellcheck"
if command -v shellcheck >/dev/null; then
  mapfile -t bash_scripts < <(git ls-files --cached --others --exclude-standard -- '*.sh' | grep -v -e '^contrib/install.sh$' -e '^tests/packaging/openwrt.sh$')
  for f in "${bash_scripts[@]}"; do
    if shellcheck "$f" >"$TMP/sc" 2>&1; then ok "shellcheck $f"; else fail "shellcheck $f"; cat "$TMP/sc"; fi
  done
  for f in contrib/install.sh tests/packaging/openwrt.sh contrib/openwrt/modelrelay-server.init contrib/openwrt/modelrelay-worker.init; do
    if shellcheck -s dash "$f" >"$TMP/sc" 2>&1; then ok "shellcheck -s dash $f"; else fail "shellcheck -s dash $f"; cat "$TMP/sc"; fi
  done
else
  fail "shellcheck not installed (apt-get install shellcheck)"
fi

echo
echo "== OpenWrt procd scripts (harness)"
if command -v busybox >/dev/null; then SH=(busybox sh); elif command -v dash >/dev/null; then SH=(dash); else SH=(sh); fi
echo "  (shell: ${SH[*]})"
"${SH[@]}" tests/packaging/openwrt.sh >"$TMP/openwrt.out" 2>&1
tally "$TMP/openwrt.out"

echo
echo "== make dist packaging (contrib/dist.sh) and contrib/install.sh"
# The static x86_64 binaries of the cross suite's profile (they run here: the installed copy
# is executed; the container images use them too); the other targets get marker files,
# enough to tell which tarball was installed.
STATIC=$CROSS_TARGET_DIR/x86_64-unknown-linux-musl/cross-test
if ! CARGO_TARGET_DIR=$CROSS_TARGET_DIR contrib/cross/cargo.sh x86_64-unknown-linux-musl build --quiet --profile cross-test --bins --features server-tls; then
  fail "static x86_64 build"
  finish
  exit 1
fi
if ! cargo build --quiet --all-features --example demo_backend; then fail "host build (demo backend)"; finish; exit 1; fi
BINS=$TMP/bins
for t in aarch64-unknown-linux-musl armv7-unknown-linux-musleabihf; do
  mkdir -p "$BINS/$t"
  for b in modelrelay-server modelrelay-worker; do echo "$t $b" >"$BINS/$t/$b"; done
done
mkdir -p "$BINS/x86_64-unknown-linux-musl" "$BINS/x86_64-pc-windows-gnu"
cp "$STATIC/modelrelay-server" "$STATIC/modelrelay-worker" "$BINS/x86_64-unknown-linux-musl/"
echo "windows worker" >"$BINS/x86_64-pc-windows-gnu/modelrelay-worker.exe"
ALL="x86_64-unknown-linux-musl aarch64-unknown-linux-musl armv7-unknown-linux-musleabihf x86_64-pc-windows-gnu"
DIST=$TMP/dist
# shellcheck disable=SC2086
if contrib/dist.sh --out "$DIST" --bin-dir "$BINS" $ALL >"$TMP/dist.log" 2>&1; then ok "dist.sh packs 4 targets"; else
  fail "dist.sh"; cat "$TMP/dist.log"; finish; exit 1
fi
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
if (cd "$DIST" && sha256sum -c --quiet SHA256SUMS) && [ "$(wc -l <"$DIST/SHA256SUMS")" = 5 ]; then
  ok "SHA256SUMS lists the 4 tarballs and install.sh, and they verify"
else
  fail "SHA256SUMS: $(cat "$DIST/SHA256SUMS")"
fi
linux_want="LICENSE README.md bin/modelrelay-server bin/modelrelay-worker examples/server.env.example examples/worker.env.example man/modelrelay-server.8 man/modelrelay-worker.8 openwrt/modelrelay-server.init openwrt/modelrelay-worker.init openwrt/modelrelay.config systemd/modelrelay-server.service systemd/modelrelay-server@.service systemd/modelrelay-worker@.service systemd/server.env.example systemd/worker.env.example"
windows_want="LICENSE README.md bin/modelrelay-worker.exe examples/server.env.example examples/worker.env.example man/modelrelay-server.8 man/modelrelay-worker.8"
docs_want=$(cd docs && printf 'docs/%s\n' *.md)
for t in $ALL; do
  name=modelrelay-$VERSION-$t
  got=$(tar -tzf "$DIST/$name.tar.gz" | grep -v '/$' | sed "s|^$name/||" | sort | tr '\n' ' ' | sed 's/ $//')
  want=$linux_want
  [[ $t == *windows* ]] && want=$windows_want
  # shellcheck disable=SC2086
  want=$(printf '%s\n' $want $docs_want | sort | tr '\n' ' ' | sed 's/ $//')
  if [ "$got" = "$want" ]; then ok "$name.tar.gz holds binaries, man pages, units, examples, README, docs, LICENSE"; else
    fail "$name.tar.gz contents: $got"
  fi
done
listing=$(tar -tvzf "$DIST/modelrelay-$VERSION-aarch64-unknown-linux-musl.tar.gz")
if [ "$(awk '$2 != "0/0"' <<<"$listing" | wc -l)" = 0 ] && grep -q '^-rwxr-xr-x .*bin/modelrelay-worker$' <<<"$listing"; then
  ok "tarball entries owned 0/0, binaries mode 755"
else
  fail "tarball ownership/modes: $listing"
fi
contrib/dist.sh --out "$TMP/dist2" --bin-dir "$BINS" aarch64-unknown-linux-musl >/dev/null 2>&1
if cmp -s "$DIST/modelrelay-$VERSION-aarch64-unknown-linux-musl.tar.gz" "$TMP/dist2/modelrelay-$VERSION-aarch64-unknown-linux-musl.tar.gz"; then
  ok "tarballs are reproducible (byte-identical on a second run)"
else
  fail "tarballs differ between two runs"
fi

# Fakes for the system tools install.sh calls: user database, useradd, chown, uname.
FAKE=$TMP/fake
mkdir -p "$FAKE"
cat >"$FAKE/getent" <<'EOF'
#!/bin/sh
[ "$1" = passwd ] && grep -q "^$2:" "$FAKE_DB" 2>/dev/null
EOF
cat >"$FAKE/useradd" <<'EOF'
#!/bin/sh
echo "useradd $*" >>"$FAKE_LOG"
for last; do :; done
echo "$last:x:999:999::/nonexistent:/usr/sbin/nologin" >>"$FAKE_DB"
EOF
cat >"$FAKE/chown" <<'EOF'
#!/bin/sh
echo "chown $*" >>"$FAKE_LOG"
EOF
cat >"$FAKE/uname" <<'EOF'
#!/bin/sh
if [ "$1" = -m ]; then echo "${FAKE_MACHINE:-x86_64}"; else /bin/uname "$@"; fi
EOF
chmod +x "$FAKE"/*
export FAKE_DB=$TMP/passwd FAKE_LOG=$TMP/fake.log
# Runs install.sh with the fakes: $1 machine, rest install.sh arguments. Output in $TMP/inst.out.
inst() {
  local machine=$1
  shift
  FAKE_MACHINE=$machine PATH="$FAKE:$PATH" "${INSTALL_SH[@]}" "$@" >"$TMP/inst.out" 2>&1
}
tree_state() { (cd "$1" && find . -printf '%p %m %s\n' | sort && find . -type f -exec sha256sum {} + | sort); }
INSTALL_SH=(dash "$DIST/install.sh")

D1=$TMP/root1
: >"$FAKE_DB"
: >"$FAKE_LOG"
if inst x86_64 --destdir "$D1"; then ok "install.sh (x86_64) into a DESTDIR"; else fail "install.sh x86_64"; cat "$TMP/inst.out"; fi
modes_ok=yes
for f in "usr/local/bin/modelrelay-server 755" "usr/local/bin/modelrelay-worker 755" \
  "usr/local/share/man/man8/modelrelay-server.8 644" "usr/local/share/man/man8/modelrelay-worker.8 644" \
  "usr/local/lib/systemd/system/modelrelay-server.service 644" "usr/local/lib/systemd/system/modelrelay-worker@.service 644" \
  "usr/local/share/doc/modelrelay/examples/worker.env.example 644" "usr/local/share/doc/modelrelay/README.md 644" "usr/local/share/doc/modelrelay/docs/configuration.md 644" \
  "etc/modelrelay/server.env 600" "var/lib/modelrelay 750"; do
  read -r path mode <<<"$f"
  [ "$(stat -c %a "$D1/$path" 2>/dev/null)" = "$mode" ] || { modes_ok=no; echo "    $path: $(stat -c %a "$D1/$path" 2>&1), want $mode"; }
done
if [ $modes_ok = yes ]; then ok "binaries, man pages, units, examples, server.env (600), state dir (750) in place"; else fail "installed files/modes"; fi
if "$D1/usr/local/bin/modelrelay-worker" --version | grep -q "modelrelay-worker $VERSION"; then ok "installed binary runs"; else fail "installed binary"; fi
if grep -qx 'ExecStart=/usr/local/bin/modelrelay-server' "$D1/usr/local/lib/systemd/system/modelrelay-server.service"; then
  ok "unit ExecStart points at PREFIX/bin"
else
  fail "unit ExecStart: $(grep ExecStart "$D1/usr/local/lib/systemd/system/modelrelay-server.service")"
fi
if [ "$(grep -c '^useradd' "$FAKE_LOG")" = 1 ] && grep -q '^useradd --system --user-group --no-create-home --home-dir /var/lib/modelrelay --shell [^ ]* modelrelay$' "$FAKE_LOG" &&
  grep -qx "chown modelrelay: $D1/var/lib/modelrelay" "$FAKE_LOG"; then
  ok "system user created once, state dir owned by it"
else
  fail "user/state dir: $(cat "$FAKE_LOG")"
fi
echo "WORKER_SECRET=mine" >"$D1/etc/modelrelay/server.env"
before=$(tree_state "$D1")
if inst x86_64 --destdir "$D1" && [ "$(tree_state "$D1")" = "$before" ]; then ok "second run: nothing changes (idempotent)"; else
  fail "second run changed the tree or failed"; cat "$TMP/inst.out"
fi
if [ "$(grep -c '^useradd' "$FAKE_LOG")" = 1 ] && grep -q 'exists     user modelrelay' "$TMP/inst.out" &&
  grep -q 'kept       .*/etc/modelrelay/server.env' "$TMP/inst.out" && [ "$(grep -c 'unchanged  .*/bin/' "$TMP/inst.out")" = 2 ]; then
  ok "second run: user kept, edited server.env kept, binaries unchanged"
else
  fail "second run report"; cat "$TMP/inst.out"
fi

D2=$TMP/root2
if inst aarch64 --destdir "$D2" --no-user && grep -q 'aarch64-unknown-linux-musl modelrelay-server' "$D2/usr/local/bin/modelrelay-server"; then
  ok "aarch64 machine gets the aarch64 tarball"
else
  fail "aarch64 choice"; cat "$TMP/inst.out"
fi
D3=$TMP/root3
if inst armv7l --destdir "$D3" --no-user && grep -q 'armv7-unknown-linux-musleabihf modelrelay-worker' "$D3/usr/local/bin/modelrelay-worker"; then
  ok "armv7l machine gets the armv7 tarball"
else
  fail "armv7 choice"; cat "$TMP/inst.out"
fi
D4=$TMP/root4
if ! inst mips --destdir "$D4" && grep -q "no build for machine architecture 'mips'" "$TMP/inst.out" && [ ! -e "$D4" ]; then
  ok "an unknown architecture is refused, nothing installed"
else
  fail "mips: $(cat "$TMP/inst.out")"
fi
if ! inst x86_64 --destdir "$D4" "$DIST/modelrelay-$VERSION-aarch64-unknown-linux-musl.tar.gz" && grep -q 'is not the x86_64-unknown-linux-musl build' "$TMP/inst.out"; then
  ok "a tarball for another architecture is refused"
else
  fail "wrong-arch tarball: $(cat "$TMP/inst.out")"
fi
BAD=$TMP/bad
mkdir -p "$BAD"
cp "$DIST"/* "$BAD/"
printf 'x' >>"$BAD/modelrelay-$VERSION-x86_64-unknown-linux-musl.tar.gz"
INSTALL_SH=(dash "$BAD/install.sh")
if ! inst x86_64 --destdir "$D4" && grep -q 'checksum mismatch' "$TMP/inst.out" && [ ! -e "$D4" ]; then
  ok "a tarball whose SHA-256 does not match is refused, nothing installed"
else
  fail "tampered tarball: $(cat "$TMP/inst.out")"
fi
rm "$BAD/SHA256SUMS"
if ! inst aarch64 --destdir "$D4" && grep -q 'no SHA256SUMS' "$TMP/inst.out"; then
  ok "no SHA256SUMS: refused"
else
  fail "missing SHA256SUMS: $(cat "$TMP/inst.out")"
fi
INSTALL_SH=(dash "$DIST/install.sh")
D5=$TMP/root5
if inst x86_64 --destdir "$D5" --prefix /opt/modelrelay --no-user &&
  grep -qx 'ExecStart=/opt/modelrelay/bin/modelrelay-worker' "$D5/opt/modelrelay/lib/systemd/system/modelrelay-worker@.service" &&
  [ -x "$D5/opt/modelrelay/bin/modelrelay-server" ]; then
  ok "--prefix: binaries and unit paths follow it"
else
  fail "--prefix"; cat "$TMP/inst.out"
fi
# OpenWrt (BusyBox sh, like a router): procd scripts, UCI config, prefix /usr.
D6=$TMP/root6
mkdir -p "$D6/etc"
echo "DISTRIB_ID='OpenWrt'" >"$D6/etc/openwrt_release"
if command -v busybox >/dev/null; then INSTALL_SH=(busybox sh "$DIST/install.sh"); fi
if inst aarch64 --destdir "$D6" --no-user && [ -x "$D6/etc/init.d/modelrelay-server" ] && [ -x "$D6/etc/init.d/modelrelay-worker" ] &&
  [ "$(stat -c %a "$D6/etc/config/modelrelay")" = 600 ] && grep -qx 'PROG=/usr/bin/modelrelay-worker' "$D6/etc/init.d/modelrelay-worker" &&
  [ -f "$D6/usr/bin/modelrelay-server" ] && [ ! -e "$D6/usr/lib/systemd" ]; then
  ok "OpenWrt ($(basename "${INSTALL_SH[0]}") sh): procd scripts in /etc/init.d, /etc/config/modelrelay, binaries in /usr/bin"
else
  fail "OpenWrt layout"; cat "$TMP/inst.out"
fi
INSTALL_SH=(dash "$DIST/install.sh")

echo
echo "== contrib/docker"
python3 tests/packaging/lint_docker.py >"$TMP/docker.out" 2>&1
tally "$TMP/docker.out"

BUILDAH_ROOT=
buildah_cmd() { buildah --root "$BUILDAH_ROOT/storage" --runroot "$BUILDAH_ROOT/run" --storage-driver vfs "$@"; }
# Every descendant of process $1.
descendants() { local p; for p in $(pgrep -P "$1"); do echo "$p"; descendants "$p"; done; }
# The pid of the container's entrypoint under `buildah run` process $1 (cmdline $2).
entry_pid() { local p; for p in $(descendants "$1"); do [ "$(tr -d '\0' <"/proc/$p/cmdline" 2>/dev/null)" = "$2" ] && echo "$p"; done; }
has_entry() { [ -n "$(entry_pid "$1" "$2")" ]; }
listening_port() { grep -o 'listening on [0-9.]*:[0-9]*' "$1" 2>/dev/null | head -n 1 | sed 's/.*://'; }
have_port() { [ -n "$(listening_port "$1")" ]; }
exited() { ! kill -0 "$1" 2>/dev/null; }

docker_images() {
  local ctx=$TMP/docker-ctx static=$STATIC img c base
  if ! command -v buildah >/dev/null; then
    skip "docker images: buildah not installed (apt-get install buildah); Dockerfile linted only"
    return
  fi
  BUILDAH_ROOT=$TMP/buildah
  mkdir -p "$ctx/contrib/docker" "$ctx/prebuilt"
  cp contrib/docker/Dockerfile contrib/docker/data.README "$ctx/contrib/docker/"
  cp "$static/modelrelay-server" "$static/modelrelay-worker" "$ctx/prebuilt/"
  for img in server worker; do
    if buildah_cmd build --quiet --isolation chroot --build-arg BINARIES=prebuilt --target "$img" \
      -f "$ctx/contrib/docker/Dockerfile" -t "modelrelay-$img:test" "$ctx" >"$TMP/buildah-$img.log" 2>&1; then
      ok "buildah builds the $img image (FROM scratch, prebuilt static binary)"
    else
      if grep -qiE 'operation not permitted|cannot (set up|mount)|namespace' "$TMP/buildah-$img.log"; then
        skip "docker images: buildah cannot build here ($(tail -n 1 "$TMP/buildah-$img.log"))"
      else
        fail "buildah build $img"; cat "$TMP/buildah-$img.log"
      fi
      return
    fi
  done
  if [ "$(buildah_cmd inspect --format '{{.OCIv1.Config.Entrypoint}} {{.OCIv1.Config.User}} {{.OCIv1.Config.StopSignal}}' modelrelay-server:test)" = "[/modelrelay-server] 65532:65532 SIGTERM" ]; then
    ok "server image: entrypoint, user 65532, STOPSIGNAL SIGTERM"
  else
    fail "server image config: $(buildah_cmd inspect --format '{{.OCIv1.Config}}' modelrelay-server:test)"
  fi
  if [ "$(buildah_cmd images --noheading --format '{{.Size}}' modelrelay-worker:test | head -n 1)" != "" ]; then
    ok "image sizes: server $(buildah_cmd images --noheading --format '{{.Size}}' modelrelay-server:test | head -n 1), worker $(buildah_cmd images --noheading --format '{{.Size}}' modelrelay-worker:test | head -n 1) (cross-test profile, unstripped)"
  fi

  # Run them (chroot isolation shares the host network): server, worker, host demo backend.
  DEMO_BACKEND_ADDR=127.0.0.1:0 "$HOST_TARGET_DIR/debug/examples/demo_backend" >"$TMP/backend.log" 2>&1 &
  pids+=($!)
  backend_up() { grep -q 'on http://' "$TMP/backend.log"; }
  wait_for backend_up || { fail "demo backend"; return; }
  local backend server worker spid wpid
  backend=$(grep -o 'http://[0-9.:]*' "$TMP/backend.log" | head -n 1)
  c=$(buildah_cmd from modelrelay-server:test)
  # An admin token makes the server open its usage journal in /data: the directory the
  # image made for uid 65532 must be writable.
  buildah_cmd run --isolation chroot -e WORKER_SECRET=img -e LISTEN_ADDR=127.0.0.1:0 -e MODELRELAY_ADMIN_TOKEN=adm "$c" -- /modelrelay-server >"$TMP/img-server.log" 2>&1 &
  server=$!
  pids+=("$server")
  if ! wait_for have_port "$TMP/img-server.log"; then fail "server container did not listen"; cat "$TMP/img-server.log"; return; fi
  base=http://127.0.0.1:$(listening_port "$TMP/img-server.log")
  grep -q 'usage journal /data/usage.journal' "$TMP/img-server.log" && ok "server container: runs as 65532, state in /data"
  c=$(buildah_cmd from modelrelay-worker:test)
  buildah_cmd run --isolation chroot -e WORKER_SECRET=img -e PROXY_URL="$base" -e BACKEND_URL="$backend" -e WORKER_NAME=container "$c" -- /modelrelay-worker >"$TMP/img-worker.log" 2>&1 &
  worker=$!
  pids+=("$worker")
  registered() { curl -s "$base/v1/models" | grep -q '"id":"demo"'; }
  if wait_for registered; then ok "worker container registers with the server container"; else
    fail "worker container did not register"; tail -n 20 "$TMP/img-worker.log"; return
  fi
  local body stream
  body=$(curl -s --max-time 30 "$base/v1/chat/completions" -H 'content-type: application/json' -d '{"model":"demo","messages":[{"role":"user","content":"Hi"}]}')
  stream=$(curl -sN --max-time 30 "$base/v1/chat/completions" -H 'content-type: application/json' -d '{"model":"demo","stream":true,"messages":[{"role":"user","content":"Hi"}]}')
  if grep -qF "$ANSWER" <<<"$body" && grep -q '^data: \[DONE\]' <<<"$stream"; then ok "containers answer plain and streaming"; else
    fail "containers' answers: $body / $(head -c 200 <<<"$stream")"
  fi
  # `docker stop`: SIGTERM to the entrypoint (buildah itself does not forward it).
  wait_for has_entry "$worker" /modelrelay-worker && wpid=$(entry_pid "$worker" /modelrelay-worker)
  wait_for has_entry "$server" /modelrelay-server && spid=$(entry_pid "$server" /modelrelay-server)
  kill -TERM "${wpid:-0}" 2>/dev/null
  if wait_for exited "$worker" && wait "$worker"; then ok "worker container: SIGTERM drains, exit 0"; else fail "worker container stop"; fi
  kill -TERM "${spid:-0}" 2>/dev/null
  if wait_for exited "$server" && wait "$server"; then ok "server container: SIGTERM drains, exit 0"; else fail "server container stop"; fi
}
docker_images
echo "  (docker-compose.yml is linted only: no Docker daemon or registry here)"

finish
