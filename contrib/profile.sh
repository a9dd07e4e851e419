#!/usr/bin/env bash
# contrib/profile.sh [BIN_DIR] [CLIENTS]: where the server's time goes end to end under
# load (`make bench-profile`). Runs `BENCH_PROFILE_E2E=CLIENTS` (default 64) with the
# modelrelay-server and modelrelay-worker found in BIN_DIR (default target/release), and
# while the load runs records the server with `perf`: CPU samples (user vs kernel, the
# hottest symbols) and every context switch (how many per request, by thread and by
# whether the thread went to sleep or only yielded or was preempted). Needs `perf` and
# permission to trace (root, or kernel.perf_event_paranoid <= 1). Symbols need a build
# with them (see docs/proving.md, "To see where the time goes with symbols").
set -euo pipefail
cd "$(dirname "$0")/.."
bins=${1:-target/release}
clients=${2:-64}
bench=target/release/examples/bench
command -v perf >/dev/null || { echo "perf is not installed" >&2; exit 2; }
[ -x "$bench" ] || { echo "build the bench first: cargo build --release --example bench" >&2; exit 2; }
out=$(mktemp -d /tmp/profile.XXXXXX)

BENCH_BIN_DIR=$bins BENCH_SECS=14 BENCH_PROFILE_E2E=$clients "$bench" >"$out/bench.txt" 2>&1 &
bench_pid=$!
until grep -q "server pid" "$out/bench.txt" 2>/dev/null; do
  kill -0 "$bench_pid" 2>/dev/null || { cat "$out/bench.txt" >&2; exit 1; }
  sleep 0.1
done
server=$(grep -o 'server pid [0-9]*' "$out/bench.txt" | awk '{print $3}')
sleep 2 # past the ramp-up
perf record -q -F 999 -p "$server" -o "$out/cpu.data" -- sleep 4 >/dev/null 2>&1
perf record -q -e sched:sched_switch -p "$server" -o "$out/switch.data" -- sleep 2 >/dev/null 2>&1
wait "$bench_pid"
rps=$(grep -o 'clients: [0-9]*' "$out/bench.txt" | awk '{print $2}')

echo "== $bins, $clients clients end to end: $rps requests/s over the window"
grep -E "CPU/request|switches/request" "$out/bench.txt"
echo
echo "server CPU samples, user vs kernel:"
perf report -i "$out/cpu.data" --no-children --sort dso --stdio 2>/dev/null |
  awk '/^ +[0-9.]+%/ {p=$1; sub("%","",p); if ($2 ~ /kernel/) k+=p; else u+=p}
       END {printf "  user %.1f %%, kernel %.1f %%\n", u, k}'
echo "hottest server symbols (the relay's own need a build with symbols):"
perf report -i "$out/cpu.data" --no-children --sort sym --stdio 2>/dev/null |
  grep -E '^ +[0-9.]+%' | sed -n '1,12p'
echo
echo "server context switches per request, by thread and kind (2 s sample):"
perf script -i "$out/switch.data" 2>/dev/null |
  awk -v rps="$rps" '
    { comm=""; state="";
      for (i = 1; i <= NF; i++) {
        if ($i ~ /^prev_comm=/) { comm=substr($i, 11); sub(/[0-9]+$/, "N", comm); sub(/w[0-9]+/, "wN", comm) }
        if ($i ~ /^prev_state=/) state=substr($i, 12)
      }
      kind = (state ~ /^S/ || state ~ /^D/) ? "slept" : "yielded or preempted";
      n[comm " " kind]++; total++ }
    END { for (k in n) printf "  %-40s %6.2f\n", k, n[k] / (rps * 2);
          printf "  %-40s %6.2f\n", "all", total / (rps * 2) }' | sort
echo "raw data: $out"
