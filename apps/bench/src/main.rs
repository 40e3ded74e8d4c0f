//! `chunnel-bench`: every subcommand prints a human-readable account on stderr and exactly one
//! JSON line of results on stdout, last.
//!
//! * `overhead`: loopback echo through 0, 1, 3 and 5 no-op Chunnels over kernel UDP and Unix
//!   datagram sockets, beside a raw tokio baseline; plus callgrind instruction counts per
//!   message and a count of heap allocations per message.
//! * `negotiate`: connection set-up cost (connect + first echo) for a raw UDP exchange, 1-RTT
//!   negotiation and 0-RTT reconnect.
//! * `reconfig`: unilateral runtime reconfiguration: fast-path cost of a reconfigurable select
//!   (lock-free and lock mechanisms) and the pause of a switch under load.
//! * `probe` (internal): the deterministic loop that `overhead` runs under callgrind.

mod alloc;
mod datapaths;
mod etl;
mod harness;
mod kv;
mod lent;
mod negotiate;
mod negotiate_flood;
mod overhead;
mod probe;
mod pubsub;
mod reconfig;
mod rendezvous;
mod report;
mod sched;
mod secure;
mod shm;
mod soak;
mod stats;
mod uring;
mod xdp;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

#[derive(Parser)]
#[command(
    name = "chunnel-bench",
    about = "Chunnel measurements; one JSON line on stdout"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Marginal cost of no-op Chunnels over kernel UDP and Unix datagrams vs. raw sockets.
    Overhead(overhead::Args),
    /// Connection set-up cost: raw UDP exchange vs. 1-RTT and 0-RTT negotiation.
    Negotiate(negotiate::Args),
    /// Unilateral reconfiguration: fast-path cost of a reconfigurable select, switch pause.
    Reconfig(reconfig::Args),
    /// Sharded KV store under YCSB load: client vs server sharding, Chunnels vs inline.
    Kv(kv::Args),
    /// Multi-party negotiation: join and transition-commit latency per rendezvous backend.
    Rendezvous(rendezvous::Args),
    /// Shared memory vs kernel UDP: echo round trip through chunnel-shm, a raw ring, and UDP.
    Shm(shm::Args),
    /// io_uring UDP datapath vs. a raw io_uring echo: round trip p50/p99, 64 B throughput.
    Uring(uring::Args),
    /// Every datapath through the library vs its raw baseline, and Figure 7 on shared memory.
    Datapaths(datapaths::Args),
    /// Lent (zero-copy) buffers vs the copying path, shared memory and io_uring, 1460 B and
    /// 8 KiB (as in `datapaths`).
    Lent(lent::Args),
    /// AF_XDP alone (as in `datapaths`): kernel UDP client vs raw and library AF_XDP echo.
    Xdp(xdp::Args),
    /// TLS over TCP and QUIC: chunnel-secure vs tokio-rustls and quinn used directly.
    Secure(secure::Args),
    /// Pub/sub over Kafka, NATS JetStream, Redis Streams: Chunnel vs the client crates.
    Pubsub(pubsub::Args),
    /// The ETL application end to end: latency against offered load, Kafka and NATS.
    Etl(etl::Args),
    /// Packet scheduler determinism: a 1 ms flow's latency under bulk, FIFO vs priority vs TAS.
    Sched(sched::Args),
    /// Runs every figure, writes docs/figures/*.json and plots, regenerates docs/evaluation.md.
    Report(report::Args),
    /// Soak: the KV store under YCSB with live switches, server restarts, malformed frames.
    Soak(soak::Args),
    /// Internal: one deterministic run for callgrind / the allocation counter.
    #[command(hide = true)]
    Probe(probe::Args),
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Overhead(a) => overhead::run(a),
        Cmd::Negotiate(a) => negotiate::run(a),
        Cmd::Reconfig(a) => reconfig::run(a),
        Cmd::Kv(a) => kv::run(a),
        Cmd::Rendezvous(a) => rendezvous::run(a),
        Cmd::Shm(a) => shm::run(a),
        Cmd::Uring(a) => uring::run(a),
        Cmd::Datapaths(a) => datapaths::run(a),
        Cmd::Lent(a) => lent::run(a),
        Cmd::Xdp(a) => xdp::run(a),
        Cmd::Secure(a) => secure::run(a),
        Cmd::Pubsub(a) => pubsub::run(a),
        Cmd::Etl(a) => etl::run(a),
        Cmd::Sched(a) => sched::run(a),
        Cmd::Report(a) => report::run(a),
        Cmd::Soak(a) => soak::run(a),
        Cmd::Probe(a) => probe::run(a),
    }
}

/// Pins the calling thread to `cpu` (client and server then share one core: on this kind of VM
/// a cross-core wake-up costs ~45 us and makes latency bimodal).
pub(crate) fn pin_to(cpu: usize) -> Result<()> {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            anyhow::bail!("pinning to cpu {cpu}: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}
