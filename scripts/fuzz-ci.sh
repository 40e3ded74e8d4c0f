#!/usr/bin/env bash
# Every cargo-fuzz target for a short, bounded time on its committed seed corpus (fuzz/seeds/<t>):
# the fuzzing part of CI (called by scripts/test-all.sh). Long runs are in docs/testing.md.
#
#   scripts/fuzz-ci.sh                    # 20 s per target, as many at once as CPUs (at most 4)
#   CHUNNEL_FUZZ_SECS=60 CHUNNEL_FUZZ_JOBS=1 scripts/fuzz-ci.sh
#   scripts/fuzz-ci.sh hello server       # only these targets
#
# Builds all targets once, then runs each from a scratch copy of its seeds (libFuzzer adds new
# inputs to the first corpus directory only, so fuzz/seeds stays as committed). Fails on any
# crash, leak, timeout or out-of-memory, printing each failing target's reproducer path and
# the command that replays it.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

SECS="${CHUNNEL_FUZZ_SECS:-20}"
log() { printf '\n==> %s\n' "$*"; }

# --- tools --------------------------------------------------------------------------------
if ! rustup toolchain list 2>/dev/null | grep -q '^nightly-'; then
  log "fuzz-ci: the nightly toolchain is missing (cargo-fuzz needs it for -Zsanitizer); installing it"
  rustup toolchain install nightly --profile minimal
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  log "fuzz-ci: cargo-fuzz is missing; installing it (cargo install cargo-fuzz --locked)"
  cargo install cargo-fuzz --locked
fi

mapfile -t all_targets < <(cargo +nightly fuzz list)
if (($#)); then targets=("$@"); else targets=("${all_targets[@]}"); fi

# --- build once ---------------------------------------------------------------------------
log "fuzz-ci: building ${#all_targets[@]} targets (cargo +nightly fuzz build: release, ASan, debug assertions)"
t0=$(date +%s)
cargo +nightly fuzz build
echo "fuzz-ci: build took $(($(date +%s) - t0)) s"

# --- run each -----------------------------------------------------------------------------
# libFuzzer runs one thread per target: JOBS targets run at once (default: the CPU count, at
# most 4), so CI's two cores fuzz two targets at a time for the same time each.
JOBS="${CHUNNEL_FUZZ_JOBS:-$(nproc)}"
((JOBS > 4)) && JOBS=4
((JOBS < 1)) && JOBS=1
scratch=$(mktemp -d "${TMPDIR:-/tmp}/chunnel-fuzz-ci.XXXXXX")
trap 'rm -rf "$scratch"' EXIT

# Runs target $1 (its log in $scratch/$1.log, its exit status in $scratch/$1.rc).
run_one() {
  local t=$1 corpus="$scratch/corpus-$1" out="$scratch/$1.log" rc=0
  mkdir -p "$corpus" "artifacts/$t"
  cp "seeds/$t"/* "$corpus/"
  # -timeout: one input running over 10 s is a failure; the outer timeout guards the rest.
  timeout $((SECS + 120)) cargo +nightly fuzz run "$t" "$corpus" "seeds/$t" -- \
    -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    >"$out" 2>&1 || rc=$?
  echo "$rc" >"$scratch/$t.rc"
}

for t in "${targets[@]}"; do
  [ -d "seeds/$t" ] || { echo "fuzz-ci: no committed seeds in fuzz/seeds/$t" >&2; exit 1; }
done
log "fuzz-ci: ${#targets[@]} targets for ${SECS} s each, ${JOBS} at a time"
running=0
for t in "${targets[@]}"; do
  if ((running >= JOBS)); then
    wait -n || true
    running=$((running - 1))
  fi
  echo "fuzz-ci: $t ($(ls "seeds/$t" | wc -l) seeds)"
  run_one "$t" &
  running=$((running + 1))
done
wait || true

summary=()
failed=0
for t in "${targets[@]}"; do
  out="$scratch/$t.log"
  rc=$(cat "$scratch/$t.rc" 2>/dev/null || echo "?")
  if [ "$rc" != 0 ]; then
    failed=1
    tail -n 60 "$out"
    echo
    echo "fuzz-ci: FAILED: target $t (exit $rc)" >&2
    # libFuzzer: "Test unit written to <fuzz>/artifacts/<t>/crash-<sha1>" (cargo-fuzz's prefix).
    repro=$(grep -oE 'Test unit written to [^ ]+' "$out" | tail -n 1 | sed 's/^Test unit written to //' || true)
    if [ -n "$repro" ]; then
      echo "fuzz-ci: reproducer: $repro" >&2
      echo "fuzz-ci: replay it:  (cd fuzz && cargo +nightly fuzz run $t $repro)" >&2
    else
      echo "fuzz-ci: no reproducer written (see the log above)" >&2
    fi
    continue
  fi
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$out" | tail -n 1 || true)
  execs=$(grep -E '^stat::number_of_executed_units' "$out" | awk '{print $2}' || true)
  summary+=("$(printf '%-13s %10s execs  %s' "$t" "${execs:-?}" "${done_line:-}")")
done
((failed)) && exit 1

log "fuzz-ci: every target ran ${SECS} s without a crash"
printf '%s\n' "${summary[@]}"
