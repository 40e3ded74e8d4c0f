#!/usr/bin/env bash
# The soak (issue 26, item 5): one hour of the key-value store under YCSB load (2000 req/s)
# with a live sharding switch every second, a kill and restart of the server process every
# 3 minutes and a stream of malformed frames. Writes target/soak/soak.csv (sampled every 5 s;
# CSV=path for another), the server's log (soak.server.log) beside it, and prints the summary
# (one JSON line) on stdout, also saved as target/soak/soak.summary.json. Not part of CI.
#
#   scripts/soak.sh                       # one hour
#   DURATION=120 scripts/soak.sh          # a short try
#   CPU=1 scripts/soak.sh --rate 1000     # pinned to core 1 (taskset); extra flags passed on
set -euo pipefail
cd "$(dirname "$0")/.."

duration=${DURATION:-3600}
out=target/soak
csv=${CSV:-$out/soak.csv}
mkdir -p "$out" "$(dirname "$csv")"
CARGO_INCREMENTAL=0 cargo build --release -p chunnel-bench
pin=()
if [[ -n "${CPU:-}" ]] && command -v taskset >/dev/null; then
    pin=(taskset -c "$CPU")
fi
"${pin[@]}" ./target/release/chunnel-bench soak --duration "$duration" \
    --csv "$csv" "$@" | tee "${csv%.csv}.summary.json"
