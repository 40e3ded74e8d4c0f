//! The Chunnel tour. One process starts a server and a client over loopback; the client's
//! stack holds a `select` between a Unix datagram socket (the local fast path) and UDP. The
//! demo lists the concrete stacks the select offers, builds each one in turn by applying its
//! pick (what negotiation will do), exchanges messages and prints what happened.
//!
//! Then the negotiation part ([`negotiation`]): a server and clients agree on a stack over
//! the wire, fall back to the option they share, reconnect with 0-RTT, and refuse an
//! incompatible client with a clear error on both ends.
//!
//! Then the reconfiguration part ([`reconfiguration`]): a live connection switches an
//! exact-match Chunnel with its peer's agreement (two-phase commit, in-band) while messages
//! flow, and the demo prints the pause.
//!
//! Last, the multi-party part ([`rendezvous`]): a publisher and receivers agree on their
//! group's stack through a rendezvous store (embedded SQLite), and the group switches ordering
//! mode when a second receiver joins and back when it leaves (paper §7.2).
//!
//! Run: `cargo run --release -p chunnel-demo` (add `-- --messages N` to change the count).
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use chunnel::{
    Chunnel, ChunnelConnection, Either, Listener, Noop, Offers, StackOption, select, stack,
};
use chunnel_net::{udp, uds};

mod negotiation;
mod reconfiguration;
mod rendezvous;
mod serve;

const MSG_LEN: usize = 64;
const BURST: usize = 16;

fn main() -> Result<()> {
    if std::env::args().nth(1).as_deref() == Some("serve") {
        return serve_main();
    }
    let messages = parse_messages()?;
    // One thread: client and server share a core, the stable way to time loopback here.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        tour(messages).await?;
        negotiation::tour().await?;
        reconfiguration::tour().await?;
        rendezvous::tour().await
    })
}

/// `chunnel-demo serve [--control PATH] [--rate N]` (see [`serve`]).
fn serve_main() -> Result<()> {
    let mut args = std::env::args().skip(2);
    let (mut control, mut rate) = (None, 1000);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--control" => control = Some(args.next().context("--control needs a path")?.into()),
            "--rate" => {
                rate = args
                    .next()
                    .context("--rate needs a number")?
                    .parse()
                    .context("--rate needs a number")?
            }
            "-h" | "--help" => {
                println!("usage: chunnel-demo serve [--control PATH] [--rate MESSAGES_PER_SEC]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (try --help)"),
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(serve::serve(control, rate))
}

fn parse_messages() -> Result<usize> {
    let mut args = std::env::args().skip(1);
    let mut messages = 20_000;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--messages" => {
                messages = args
                    .next()
                    .context("--messages needs a number")?
                    .parse()
                    .context("--messages needs a number")?
            }
            "-h" | "--help" => {
                println!("usage: chunnel-demo [--messages N] | chunnel-demo serve --control PATH");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (try --help)"),
        }
    }
    Ok(messages)
}

async fn tour(messages: usize) -> Result<()> {
    println!("Chunnel demo: a server and a client in one process, over loopback.\n");

    // The server listens on both datapaths and echoes whatever arrives.
    let unix_name = uds::UnixAddr::Abstract(format!("chunnel-demo-{}", std::process::id()).into());
    let udp_listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let udp_addr = udp_listener.local_addr()?;
    let unix_listener = uds::DatagramListener::bind(unix_name.clone()).await?;
    tokio::spawn(echo(udp_listener));
    tokio::spawn(echo(unix_listener));
    println!("server: echoing on udp {udp_addr} and unix datagram {unix_name}");

    // The client: a no-op layer over a choice of datapath, local fast path preferred.
    let client = stack![
        Noop,
        select(
            uds::DatagramConnect::new(unix_name.clone()),
            udp::Connect::new(udp_addr)
        )
    ];
    let options = client.offers();
    println!(
        "client stack: stack![Noop, select(unix-dgram, udp)] offers {} concrete stacks:",
        options.len()
    );
    for o in &options {
        println!("  pick {:?}: {}", o.pick.branches(), describe(o));
    }

    for option in &options {
        let mut s = client.clone();
        s.apply(&option.pick)?;
        let conn = s.connect_wrap(()).await?;
        let side = match conn.get_ref() {
            Either::Left(_) => "unix datagram",
            Either::Right(_) => "udp",
        };
        println!("\nbuilt pick {:?} -> {side}", option.pick.branches());
        let report = exchange(&conn, messages).await?;
        report.print();
    }

    // A stack whose datapath is absent fails with a typed error, not a panic or a hang.
    let mut missing = stack![
        Noop,
        uds::DatagramConnect::new(uds::UnixAddr::Abstract(b"chunnel-demo-nobody".to_vec()))
    ];
    match missing.connect_wrap(()).await {
        Ok(_) => println!("\nunexpected: connected to a socket nobody listens on"),
        Err(e) => println!("\nconnecting to a unix socket nobody listens on: error: {e}"),
    }
    Ok(())
}

fn describe(o: &StackOption) -> String {
    o.chunnels
        .iter()
        .map(|c| c.id.as_ref())
        .collect::<Vec<_>>()
        .join(" > ")
}

async fn echo<L>(mut listener: L)
where
    L: Listener,
    L::Connection: ChunnelConnection<Data = Bytes> + 'static,
{
    while let Ok(conn) = listener.accept().await {
        tokio::spawn(async move {
            let mut slots = vec![None; BURST];
            while let Ok(n) = conn.recv(&mut slots).await {
                let burst: Vec<Bytes> = slots[..n].iter_mut().filter_map(Option::take).collect();
                if conn.send(burst).await.is_err() {
                    break;
                }
            }
        });
    }
}

struct Report {
    messages: usize,
    in_order: usize,
    lost: usize,
    rtts: Vec<Duration>,
    throughput: f64,
}

impl Report {
    fn print(&self) {
        let pct = |p: f64| {
            let i = ((self.rtts.len() as f64 - 1.0) * p).round() as usize;
            self.rtts[i].as_secs_f64() * 1e6
        };
        println!(
            "  ping-pong: {} messages of {MSG_LEN} B, {} came back in order, {} lost",
            self.messages, self.in_order, self.lost
        );
        println!(
            "  round trip: p50 {:.1} us, p99 {:.1} us, max {:.1} us",
            pct(0.50),
            pct(0.99),
            pct(1.0)
        );
        println!(
            "  bursts of {BURST}: {:.0} messages/s echoed",
            self.throughput
        );
    }
}

async fn exchange<C: ChunnelConnection<Data = Bytes>>(conn: &C, messages: usize) -> Result<Report> {
    let payload = |i: usize| {
        let mut v = vec![0u8; MSG_LEN];
        v[..8].copy_from_slice(&(i as u64).to_be_bytes());
        Bytes::from(v)
    };
    let id = |b: &Bytes| u64::from_be_bytes(b[..8].try_into().unwrap_or_default()) as usize;
    let mut slots = vec![None; BURST];

    // Latency: one message in flight at a time.
    let mut rtts = Vec::with_capacity(messages);
    let mut in_order = 0;
    let mut lost = 0;
    for i in 0..messages {
        let t = Instant::now();
        conn.send([payload(i)]).await?;
        match tokio::time::timeout(Duration::from_secs(1), conn.recv(&mut slots[..1])).await {
            Ok(r) => {
                r?;
                rtts.push(t.elapsed());
                if slots[0].take().as_ref().map(id) == Some(i) {
                    in_order += 1;
                }
            }
            Err(_) => lost += 1,
        }
    }
    if rtts.is_empty() {
        bail!("no message came back");
    }
    rtts.sort();

    // Throughput: bursts, one burst in flight.
    let start = Instant::now();
    let mut done = 0;
    while done < messages {
        conn.send((0..BURST).map(|k| payload(done + k))).await?;
        let mut got = 0;
        while got < BURST {
            match tokio::time::timeout(Duration::from_secs(1), conn.recv(&mut slots)).await {
                Ok(r) => got += r?,
                Err(_) => break, // a lost datagram: move on
            }
        }
        done += BURST;
    }
    let throughput = done as f64 / start.elapsed().as_secs_f64();
    Ok(Report {
        messages,
        in_order,
        lost,
        rtts,
        throughput,
    })
}
