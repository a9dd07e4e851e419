#!/usr/bin/env bash
# contrib/size.sh [TARGET]: builds the stripped static binaries of every build — default,
# FEATURES=minimal (routers), NO_TLS=1, FEATURES=server-tls — with `make static`, prints
# their sizes in bytes, and for x86_64-unknown-linux-musl checks the size budgets (exit 1
# when a binary is over). Each build keeps its own target directory under target/size/,
# so a rerun only rebuilds what changed. `make size` runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-x86_64-unknown-linux-musl}

# build name, make arguments, server budget, worker budget (bytes; - : none).
builds=(
  "default||2400000|2700000"
  "minimal|FEATURES=minimal|1700000|-"
  "notls|NO_TLS=1|-|-"
  "server-tls|FEATURES=server-tls|-|-"
)

rows=() over=0
for b in "${builds[@]}"; do
  IFS='|' read -r name args server_budget worker_budget <<<"$b"
  dir=target/size/$name
  echo "== make static TARGET=$target $args" >&2
  # shellcheck disable=SC2086  # $args is zero or one make variable
  CARGO_TARGET_DIR=$dir make --no-print-directory static TARGET="$target" $args >&2
  row="$name"
  for bin in modelrelay-server modelrelay-worker; do
    f=$dir/$target/release/$bin
    [ -e "$f" ] || f=$f.exe
    if [ ! -e "$f" ]; then row+="|—"; continue; fi
    size=$(stat -c %s "$f")
    budget=$server_budget
    [ "$bin" = modelrelay-worker ] && budget=$worker_budget
    mark=""
    if [ "$target" = x86_64-unknown-linux-musl ] && [ "$budget" != - ]; then
      if [ "$size" -le "$budget" ]; then mark=" (budget $budget)"; else mark=" OVER budget $budget"; over=1; fi
    fi
    row+="|$size$mark"
  done
  rows+=("$row")
done

echo
echo "sizes of $target (make static, stripped, bytes):"
printf '%-12s %-34s %-34s\n' build server worker
for r in "${rows[@]}"; do
  IFS='|' read -r name server worker <<<"$r"
  printf '%-12s %-34s %-34s\n' "$name" "$server" "$worker"
done
exit $over
