#!/bin/sh
# Runs `make bench` against two builds back to back, alternating, and prints the median
# of every figure per build (and the runs themselves).
#
#   contrib/bench-compare.sh BASE_DIR NEW_DIR [RUNS]
#
# BASE_DIR and NEW_DIR each hold a modelrelay-server and a modelrelay-worker (a
# target/release directory); the bench program is this checkout's
# target/release/examples/bench, so only the binaries under test differ. RUNS defaults
# to 5. Alternating (A B A B ...) spreads whatever else the machine does over both
# builds; on a shared machine judge by the CPU/request rows, which move far less than
# requests/s, and next to the floor's own drift between the two sides (the
# forwarders are the same code on both: what they differ by is the machine's noise).
# The raw outputs stay in $BENCH_OUT (default: a new directory under /tmp); RUNS=0 with
# BENCH_OUT set summarises the outputs already there. BASE_ORIG=1: BASE_DIR holds the
# original ModelRelay's binaries (the bench runs them with BENCH_ORIG; `make bench-orig`).
set -eu

if [ $# -lt 2 ]; then
    echo "usage: $0 BASE_DIR NEW_DIR [RUNS]" >&2
    exit 2
fi
base=$1
new=$2
runs=${3:-5}
bench=${BENCH:-target/release/examples/bench}
for d in "$base" "$new"; do
    for b in modelrelay-server modelrelay-worker; do
        [ -x "$d/$b" ] || { echo "$d/$b: not found (build it first)" >&2; exit 2; }
    done
done
[ -x "$bench" ] || { echo "$bench: not found (cargo build --release --example bench)" >&2; exit 2; }
out=${BENCH_OUT:-$(mktemp -d /tmp/bench-compare.XXXXXX)}
mkdir -p "$out"

i=1
while [ "$i" -le "$runs" ]; do
    for side in base new; do
        if [ "$side" = base ]; then dir=$base; else dir=$new; fi
        echo "run $i/$runs: $side ($dir)" >&2
        if [ "$side" = base ] && [ "${BASE_ORIG:-}" = 1 ]; then
            BENCH_ORIG=$dir "$bench" >"$out/$side-$i.txt" 2>"$out/$side-$i.err"
        else
            BENCH_BIN_DIR=$dir "$bench" >"$out/$side-$i.txt" 2>"$out/$side-$i.err"
        fi
    done
    i=$((i + 1))
done

# Every figure row: section + name (the first 44 columns) -> the relay column (the
# figure's own value in the rows that have no direct one).
extract() {
    awk '
        /^== relay core/ { sec = "core" }
        /^== end to end/ { sec = "e2e" }
        # The Ollama rows have a wider name column of their own: not parsed.
        /^(ollama|same relay)/ { next }
        length($0) > 58 && substr($0, 45, 1) == " " {
            name = substr($0, 1, 44); sub(/ +$/, "", name)
            v = substr($0, 59, 12); gsub(/ /, "", v)
            if (v ~ /^[0-9.+-]+$/ && name != "figure") print sec ": " name "\t" v
        }' "$1"
}

for f in "$out"/base-*.txt "$out"/new-*.txt; do
    side=$(basename "$f" | cut -d- -f1)
    extract "$f" | sed "s/^/$side\t/"
done | awk -F '\t' '
    function show(v) { return (v >= 100 || v <= -100) ? sprintf("%.0f", v) : sprintf("%.3f", v) }
    function median(list,   n, a, i, j, t) {
        n = split(list, a, " ")
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
        return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    {
        key = $2
        if (!(key in seen)) { seen[key] = 1; order[++n] = key }
        vals[$1, key] = vals[$1, key] " " $3
    }
    END {
        printf "%-58s %10s %10s %8s  %s\n", "figure (median of runs)", "base", "new", "new/base", "new runs"
        for (i = 1; i <= n; i++) {
            k = order[i]; b = median(vals["base", k]); w = median(vals["new", k])
            r = (b + 0 != 0) ? sprintf("%.2f", w / b) : "-"
            printf "%-58s %10s %10s %8s %s\n", k, show(b), show(w), r, vals["new", k]
        }
    }'
echo "raw outputs: $out" >&2
