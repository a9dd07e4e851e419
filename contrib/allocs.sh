#!/usr/bin/env bash
# contrib/allocs.sh [BIN_DIR] [CLIENTS]: heap allocations per request in the server and
# the worker, end to end under load (`make bench-allocs`). Runs `BENCH_PROFILE_E2E=CLIENTS`
# (default 64) with the binaries in BIN_DIR (default target/release) and counts every call
# of glibc's malloc, realloc and calloc in both processes with `perf` uprobes, over the
# whole load window; per request is that over the requests the bench reports. The probes
# slow both processes down (requests/s here is not a figure), not what they count.
# Needs `perf`, root (to place the probes) and binaries linked against glibc (the static
# musl builds have no libc to probe).
set -euo pipefail
cd "$(dirname "$0")/.."
bins=${1:-target/release}
clients=${2:-64}
secs=${BENCH_SECS:-6}
bench=target/release/examples/bench
command -v perf >/dev/null || { echo "perf is not installed" >&2; exit 2; }
[ -x "$bench" ] || { echo "build the bench first: cargo build --release --example bench" >&2; exit 2; }
libc=$(ldd "$bins/modelrelay-server" 2>/dev/null | awk '/libc\.so/ {print $3}')
[ -n "$libc" ] || { echo "$bins/modelrelay-server is not linked against glibc: nothing to probe" >&2; exit 2; }
for f in malloc realloc calloc; do
  perf probe -q -x "$libc" "$f" >/dev/null 2>&1 ||
    perf probe -l 2>/dev/null | grep -q "probe_libc:$f " ||
    { echo "cannot place a probe on $f in $libc (root needed)" >&2; exit 2; }
done
out=$(mktemp -d /tmp/allocs.XXXXXX)

BENCH_BIN_DIR=$bins BENCH_SECS=$secs BENCH_PROFILE_E2E=$clients "$bench" >"$out/bench.txt" 2>&1 &
bench_pid=$!
until grep -q "worker pid" "$out/bench.txt" 2>/dev/null; do
  kill -0 "$bench_pid" 2>/dev/null || { cat "$out/bench.txt" >&2; exit 1; }
  sleep 0.05
done
events=probe_libc:malloc,probe_libc:realloc,probe_libc:calloc
for side in server worker; do
  pid=$(grep -o "$side pid [0-9]*" "$out/bench.txt" | awk '{print $3}')
  # Ends by itself when the bench stops the process.
  perf stat -x, -e "$events" -p "$pid" -o "$out/$side.txt" >/dev/null 2>&1 &
done
wait "$bench_pid"
wait
rps=$(grep -o 'clients: [0-9]*' "$out/bench.txt" | awk '{print $2}')
requests=$((rps * secs))
echo "== $bins, $clients clients end to end, $requests requests counted"
for side in server worker; do
  awk -F, -v side="$side" -v n="$requests" '
    $1 ~ /^[0-9]+$/ { name = $3; sub("probe_libc:", "", name); c[name] = $1; t += $1 }
    END { printf "  %-7s allocations/request %6.1f  (malloc %.1f, realloc %.1f, calloc %.1f)\n",
                 side, t / n, c["malloc"] / n, c["realloc"] / n, c["calloc"] / n }' "$out/$side.txt"
done
echo "raw data: $out"
