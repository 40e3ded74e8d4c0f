#!/usr/bin/env bash
# The whole test suite, installing what it needs. Safe to run on a fresh Debian 12 machine
# (as root, or with sudo available) and on a machine that already has everything.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's line carries the time since the script started, so a CI log shows where the
# minutes go.
log() { printf '\n==> [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }

# --- system packages --------------------------------------------------------------------
# valgrind: callgrind instruction counts in chunnel-bench. redis-server and etcd: the
# rendezvous backends' tests start their own servers (free loopback ports, stopped by PID);
# redis-cli (redis-tools) breaks a server's subscriptions in the notification tests.
# protobuf-compiler: etcd's Rust client generates its gRPC code at build time.
need_pkgs=()
command -v valgrind >/dev/null 2>&1 || need_pkgs+=(valgrind)
command -v redis-server >/dev/null 2>&1 || need_pkgs+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_pkgs+=(redis-tools)
command -v etcd >/dev/null 2>&1 || need_pkgs+=(etcd-server)
command -v protoc >/dev/null 2>&1 || need_pkgs+=(protobuf-compiler)
# clang builds the XDP program of chunnel-xdp; iproute2 gives the network-namespace tests `ip`.
command -v clang >/dev/null 2>&1 || need_pkgs+=(clang)
command -v ip >/dev/null 2>&1 || need_pkgs+=(iproute2)
command -v openssl >/dev/null 2>&1 || need_pkgs+=(openssl)  # chunnel-secure's interop tests
# chunnelctl's tests drive it in a real terminal (a detached tmux session, capture-pane);
# its permission test runs it as nobody with setpriv (util-linux, always installed).
command -v tmux >/dev/null 2>&1 || need_pkgs+=(tmux)
command -v promtool >/dev/null 2>&1 || need_pkgs+=(prometheus)  # chunnel-metrics' scrape test: promtool check metrics
# chunnel-pubsub's tests and `chunnel-bench pubsub` start nats-server (JetStream) and Kafka 4.1
# (jars from Maven Central through scripts/kafka/fetch.sh, cached under ~/.cache/chunnel).
command -v nats-server >/dev/null 2>&1 || need_pkgs+=(nats-server)
command -v java >/dev/null 2>&1 || need_pkgs+=(default-jre-headless)
command -v mvn >/dev/null 2>&1 || need_pkgs+=(maven)
# The font `chunnel-bench report` draws its plots' text with (feature `report`).
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need_pkgs+=(fonts-dejavu-core)
if ((${#need_pkgs[@]})); then
  log "installing ${need_pkgs[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 $SUDO apt-get update -qq
  timeout 600 $SUDO apt-get install -y -qq "${need_pkgs[@]}"
fi

# --- Rust toolchain components -----------------------------------------------------------
rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy

log "cargo fmt --check"
cargo fmt --all -- --check

log "no import cycle between the modules of any crate"
for src in crates/*/src apps/*/src; do python3 scripts/module-cycles.py "$src" > /dev/null || { python3 scripts/module-cycles.py "$src" | tail -n 3; exit 1; }; done

# The AF_XDP tests must not skip here (CI runs as root with clang and ip installed above).
export CHUNNEL_XDP_REQUIRE=1

# Optional backends that need servers or build tools are features; the suite enables them all.
FEATURES="chunnel-metrics/prometheus,chunnel-negotiate/metrics,chunnel-negotiate/tracing,chunnel-std/metrics,chunnel-net/metrics,chunnel-discovery/shm,chunnel-discovery/uring,chunnel-rendezvous/redis,chunnel-rendezvous/etcd,chunnel-bench/stores,chunnel-bench/report,chunnel-pubsub/kafka,chunnel-pubsub/nats,chunnel-pubsub/redis,chunnel-bench/pubsub,chunnel-etl/kafka,chunnel-etl/nats,chunnel-etl/redis"

log "Kafka 4.1 jars for the pub/sub tests (Maven Central, cached)"
./scripts/kafka/fetch.sh

log "cargo clippy --all-targets -D warnings (default features, then all backends)"
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy --workspace --all-targets --locked --features "$FEATURES" -- -D warnings

log "cargo test (workspace with every backend, including doctests and trybuild compile-fail tests)"
cargo test --workspace --locked --features "$FEATURES"

log "Ordered over Reliable with 8 concurrent senders: 5,000,000 messages in release (0 lost, 0 duplicated)"
CHUNNEL_CONCURRENT_MESSAGES=5000000 cargo test --release --locked -p chunnel-std --test ordered_concurrent

log "loom: the reconfiguration cell's switch against send/recv, every interleaving up to the preemption bound"
# Its own cfg and target directory: --cfg chunnel_loom swaps the cell's atomics for loom's.
RUSTFLAGS="--cfg chunnel_loom" CARGO_TARGET_DIR=target/loom \
  cargo test --release --locked -p chunnel --test loom_reconfig -- --test-threads=1 --nocapture

log "deterministic simulation: a seed replays exactly with tokio's own choices seeded (--cfg tokio_unstable)"
# Its own cfg and target directory, as loom's. The normal run above explores the seeds; this
# checks that two runs of a seed take the same path.
RUSTFLAGS="--cfg tokio_unstable" CARGO_TARGET_DIR=target/sim-replay \
  cargo test --locked -p chunnel-negotiate --test sim_connection -- sim_runs_replay_exactly
RUSTFLAGS="--cfg tokio_unstable" CARGO_TARGET_DIR=target/sim-replay \
  cargo test --locked -p chunnel-rendezvous --test sim_group -- sim_group_runs_replay_exactly

log "fuzzing: every cargo-fuzz target 20 s on its committed seeds"
./scripts/fuzz-ci.sh

log "cargo doc with warnings denied"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet --features "$FEATURES"

# Every short bench run has one feature set, so chunnel-bench is built once in release (a
# run with other features would rebuild it and the crates whose features change).
bench() { cargo run --release --locked -q -p chunnel-bench --features stores,pubsub -- "$@"; }

log "demo"
cargo run --release --locked -q -p chunnel-demo -- --messages 2000

log "chunnel-bench overhead (short run: checks the tool works end to end)"
bench overhead --reps 1 --pings 300 --millis 50 \
  | tail -n 1 | python3 -c 'import json,sys; d=json.load(sys.stdin); stacks={str(r["layers"]) for r in d["results"]}; assert d["bench"]=="overhead" and len(d["results"])==28 and {"metered","metered+prometheus"} <= stacks, d; assert d["checks"]["metrics_no_alloc_per_msg"], d["checks"]; print("bench JSON ok:", d["checks"])'

log "chunnel-bench negotiate (short run: checks the tool works end to end)"
for server in "" "--accept-loop"; do
  bench negotiate --reps 1 --conns 200 $server \
    | tail -n 1 | python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["bench"]=="negotiate" and len(d["variants"])==4, d; print("bench JSON ok:", d["server_accept"], d["checks"])'
done
bench secure --reps 1 --conns 20 --msgs 500 --bulk-mib 4 \
  | tail -n 1 | python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["bench"]=="secure" and len(d["transports"])==2, d; print("bench JSON ok:", d["checks"])'
bench negotiate --flood 2000 --flood-clients 50 --flood-slow 1 \
  | tail -n 1 | python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["bench"]=="negotiate_flood" and d["clients_connected"]==50 and d["flood_hellos"]==2000 and d["slow_answers"]>0, d; print("bench JSON ok:", d["connect_p50_us"], d["peer_cap_stats"], d["slow_answers"])'

log "chunnel-bench kv (short run: the YCSB generator against both sharding modes and the inline baselines)"
bench kv --reps 1 --records 500 --loads 2000,4000 \
  --warmup-ms 50 --run-ms 200 --ab-load 2000 --ab-ms 200 \
  | tail -n 1 | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["bench"] == "kv" and d["p95_bound_us"] > 0 and d["p95_bound_why"], d
for mode in ("client_push", "server_side"):
    pts = d["sweep"][mode]
    assert pts and all("offered_rps" in p and "p95_us" in p for p in pts), pts
assert {"client_push", "server_side", "ratio_client_push_over_server_side"} <= set(d["max_load_meeting_bound"])
for v in ("full", "no_chunnels", "no_chunnels_no_mux"):
    assert d["full_vs_inline"]["variants"][v]["p50_us"]["runs"] == 1, v
p = d["full_vs_inline"]["paired"]
assert p["samples"]["full"] > 0 and p["samples"]["no_chunnels"] > 0, p
assert d["server"]["clients_client_push"] >= 1 and d["server"]["clients_server_side"] >= 1, d["server"]
print("bench JSON ok: max loads", d["max_load_meeting_bound"])'

log "chunnel-bench soak (10 s: live switches, two server kills, malformed frames; nothing lost)"
mkdir -p target/soak
bench soak --duration 10 --restart-secs 4 --sample-secs 1 \
  --csv target/soak/smoke.csv \
  | tail -n 1 | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["bench"] == "soak" and d["ok"] and d["served"] > 0 and d["lost"] == 0, d
assert d["switches"] > 0 and d["restarts"] > 0, d
print("soak JSON ok:", {k: d[k] for k in ("served", "errors", "lost", "switches", "restarts", "malformed")})'

log "chunnel-bench reconfig (short run: every switch delivered every message once, both kinds)"
bench reconfig --reps 1 --millis 30 --pause-reps 1 \
  --messages 4000 --switch-every 500 --no-callgrind \
  | tail -n 1 | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["bench"] == "reconfig", d
for m in (d["switch_pause"]["lock-free"], d["switch_pause"]["lock"], d["multilateral"]["pause"]):
    assert m["switches"] >= 1 and m["loss"]["lost"] == 0 and m["loss"]["duplicates"] == 0, m
assert d["checks"]["zero_loss"] and d["checks"]["multilateral_zero_loss"], d["checks"]
print("bench JSON ok:", d["checks"])'

log "chunnel-bench sched (short run: a 1 ms flow under bulk with FIFO, priority and the time-aware shaper)"
taskset -c 0,1 cargo run --release --locked -q -p chunnel-bench --features stores,pubsub -- sched --secs 0.3 --reps 1 \
  | tail -n 1 | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["bench"] == "sched" and set(d["results"]) == {"alone", "fifo", "priority", "time_aware"}, d
for m, r in d["results"].items():
    assert r["one_way_p50_us"]["runs"] == 1 and r["one_way_p50_us"]["median"] > 0, (m, r)
    assert (r["bulk_mbps"]["median"] > 0) == (m != "alone"), (m, r)
print("bench JSON ok:", {m: round(r["one_way_p99_us"]["median"], 1) for m, r in d["results"].items()})'

log "chunnel-bench rendezvous (short run: every backend joins and commits at two group sizes)"
bench rendezvous --sizes 1,4 --reps 3 --backends sqlite,redis,etcd \
  | tail -n 1 | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["bench"] == "rendezvous", d
assert set(d["backends"]) == {"sqlite", "redis", "etcd"}, d["backends"].keys()
for b, sizes in d["backends"].items():
    for n in ("1", "4"):
        for what in ("join", "commit"):
            s = sizes[n][what]
            assert s["n"] == 3 and s["p50_ms"] > 0, (b, n, what, s)
print("bench JSON ok:", {b: v["4"]["commit"]["p50_ms"] for b, v in d["backends"].items()})'

log "chunnel-bench pubsub (short run: Chunnel vs client crate per broker, each broker started here)"
bench pubsub --msgs 200 --reps 1 \
  | tail -n 1 | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["bench"] == "pubsub" and set(d["brokers"]) == {"redis", "nats", "kafka"}, d
assert set(d["brokers"]["nats"]["baselines"]) == {"no_id"} and set(d["brokers"]["kafka"]["baselines"]) == {"no_id"}, d
for b, v in d["brokers"].items():
    for s in [v["chunnel"], v["direct"]] + [x["direct"] for x in v["baselines"].values()]:
        assert s["latency_p50_us"]["median"] > 0 and s["throughput_msgs_per_s"]["median"] > 0, (b, s)
assert set(d["ordering"]) == {"redis", "nats", "kafka"}, d
for b, o in d["ordering"].items():
    for n in ("1", "4"):
        assert o["receiver_over_service"][n]["latency_p50"]["median"] > 0, (b, n, o)
print("bench JSON ok:", {b: (round(v["ratio_latency_p50"]["median"], 2), round(v["ratio_throughput"]["median"], 2)) for b, v in d["brokers"].items()})'

log "chunnel-bench etl (short run: the ETL pipeline's latency against offered load, Kafka and NATS)"
bench etl --secs 2 --rates 500,2000 \
  | tail -n 1 | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["bench"] == "etl" and set(d["brokers"]) == {"kafka", "nats"}, d
for b, v in d["brokers"].items():
    assert "failed" not in v and len(v["points"]) == 2, (b, v)
    for p in v["points"]:
        assert p["complete"] and p["missing"] == 0 and p["p50_us"] > 0, (b, p)
print("bench JSON ok:", {b: [(p["offered_per_s"], p["p50_us"]) for p in v["points"]] for b, v in d["brokers"].items()})'

log "chunnel-bench datapaths (short run: kernel UDP, io_uring, shared memory, AF_XDP vs raw; Figure 7)"
bench datapaths --msgs 2000 --reps 2 \
  | tail -n 1 | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["bench"] == "datapaths", d
for k in ("kernel_udp", "io_uring", "shared_memory"):
    assert d["datapaths"][k]["library"]["rtt_p50_us"]["median"] > 0, (k, d["datapaths"][k])
assert len(d["figure7"]["results"]) == 16, d["figure7"]
# CI runs as root with CHUNNEL_XDP_REQUIRE=1: AF_XDP must have run, through the XSK socket.
x = d["datapaths"]["af_xdp"]
assert x["library"]["rtt_p50_us"]["median"] > 0 and x["raw"]["rtt_p50_us"]["median"] > 0, x
assert d["checks"]["af_xdp_all_requests_redirected"], d["checks"]
# AF_XDP at both ends: requests redirected at the server, echoes at the client.
b = x["both_ends"]
assert b["library"]["rtt_p50_us"]["median"] > 0 and b["raw"]["rtt_p50_us"]["median"] > 0, b
assert d["checks"]["af_xdp_both_ends_all_redirected"], d["checks"]
print("bench JSON ok:", d["checks"])'

log "all tests passed"
