#!/usr/bin/env bash
# `make test`: every suite, then a summary of which ran and how many tests each executed.
# MODELRELAY_SKIP_REAL_BACKEND=1 leaves out the llama-server suite (it builds llama.cpp
# once per machine, ~5 minutes, then takes about a minute).
set -uo pipefail
cd "$(dirname "$0")/../.."

summary=()
status=0
log=$(mktemp)

step() { echo; echo "== $*"; }

step "cargo fmt --check"
cargo fmt --all -- --check || status=1
step "cargo clippy -D warnings (default, all and no features)"
cargo clippy --all-targets --quiet -- -D warnings || status=1
cargo clippy --all-targets --quiet --all-features -- -D warnings || status=1
cargo clippy --all-targets --quiet --no-default-features -- -D warnings || status=1

step "cargo test (all features, so the built-in server TLS is tested too)"
cargo test --all-targets --all-features 2>&1 | tee "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# Pair each "Running <target>" with its "test result" line.
while IFS= read -r line; do summary+=("$line"); done < <(awk '
  /Running (unittests )?[^ ]+/ { name=$2; if ($2=="unittests") name=$3; sub(/ \(.*/, "", name) }
  /^test result:/ { printf "%-40s %s passed, %s failed\n", name, $4, $6 }' "$log" | sed 's/;//g')

if [ "${MODELRELAY_SKIP_REAL_BACKEND:-0}" = 1 ]; then
  summary+=("$(printf '%-40s %s' 'real backend (llama-server + SDKs)' 'skipped (MODELRELAY_SKIP_REAL_BACKEND=1)')")
else
  step "real backend: llama-server + openai/anthropic SDKs + curl"
  tests/real_backend/run.sh 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  line=$(grep -E '^real-backend: [0-9]+ passed' "$log" | tail -n 1)
  summary+=("$(printf '%-40s %s' 'tests/real_backend (llama-server + SDKs)' "${line#real-backend: }")")
  [ -n "$line" ] || summary+=("real backend suite did not run to completion")
fi

echo
echo "== suites"
printf '  %s\n' "${summary[@]}"
total_passed=$(printf '%s\n' "${summary[@]}" | awk '{for (i=1;i<NF;i++) if ($(i+1) ~ /^passed/) p+=$i; for (i=1;i<NF;i++) if ($(i+1) ~ /^failed/) f+=$i} END {print p+0, f+0}')
set -- $total_passed
echo "total: $1 passed, $2 failed"
rm -f "$log"
exit $status
