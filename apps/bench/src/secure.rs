//! `chunnel-bench secure`: the secure datapaths of `chunnel-secure` against the same
//! technology used directly, in the same run, on the same rcgen certificate:
//!
//! * TLS 1.3 over TCP: `chunnel_secure::tls::{Connect, Listener}` vs tokio-rustls on tokio's
//!   `TcpStream` (rustls with the ring provider, TLS 1.3 only, the same ALPN; `TCP_NODELAY`
//!   on both ends, as the library sets it).
//! * QUIC, stream mode: `chunnel_secure::quic::{Connect, Listener}` with [`Mode::Stream`] vs
//!   quinn driven directly (one bidirectional stream the client opens).
//!
//! Both sides carry the same length-framed messages (4-byte big-endian length, then the
//! message): the raw side builds each frame in a reusable buffer and writes it with
//! `write_all` + `flush`, and reads it with `read_exact`, as a hand-written program would.
//! Both sides' client configurations keep rustls's default session cache, so after the first
//! connection both resume TLS sessions.
//!
//! Measured per transport and side, interleaved (raw first on even repetitions, library first
//! on odd ones):
//! 1. connect + first echo: a new connection (TCP + TLS handshake, or QUIC handshake + the
//!    stream), one `--size` message echoed, the connection dropped; p50 over `--conns`.
//! 2. echo round trip, one message of `--size` bytes in flight, on one connection: p50/p99
//!    over `--msgs` after `--msgs / 10` warm-up.
//! 3. bulk: `--bulk-mib` MiB in `--bulk-size` messages client → server (a sink that counts
//!    them and answers an empty message with the byte count), timed from the first send to
//!    the count's arrival, after a 1 MiB warm-up on the same connection: MiB/s.
//!
//! Negotiated (`--transports` including quic, unless `--no-negotiated`): a
//! `chunnel_secure::negotiated::Server` preferring QUIC (offering quic, tls) and a `Client`
//! offering `select(quic, tls)`. The bar's figure is a **reconnect**, as raw quinn's connect
//! reuses its endpoint and TLS resumption: the client has verified the QUIC pick once (at
//! start) and remembers it, so each connect goes straight to the QUIC endpoint with a REBIND
//! and the first message behind it (docs/wire.md §16.5, `Client::connect_with`), no UDP
//! negotiation, and one `--size` message is echoed (the server's BOUND rides with the echo,
//! §16.3), the connection dropped. The
//! **first contact** (a client with `remember(0)`: negotiation over UDP, the QUIC handshake to
//! the picked endpoint, BIND with the first message behind it, BOUND) is reported alongside;
//! p50 over `--conns`, measured in the same repetition as raw quinn's connect + first echo
//! (just before the QUIC pair on even repetitions, just after it on odd ones), reported as
//! negotiated / raw quinn per repetition. The same with `Client::connect` and the message
//! sent after it (REBIND, wait for BOUND, then the message) is reported alongside. Each of
//! the three variants runs its `--conns` connections in a run of its own, as raw quinn's do,
//! so that one variant's leftovers (connections closing, negotiation state) do not fall
//! inside another's timings.
//!
//! Client and servers run as tasks of one current-thread tokio runtime on one pinned core
//! (`--cpu`), so the figures are the whole CPU cost of both ends plus kernel loopback, without
//! cross-core wake-ups (see docs/evaluation.md). Figures are medians with min/max over
//! `--reps`; ratios (library / raw) are taken per repetition.

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ConnectionExt};
use chunnel_secure::negotiated::{self, Transport as NTransport};
use chunnel_secure::quic::{self, Mode};
use chunnel_secure::{ClientConfig, Identity, ServerConfig, TrustRoots, tls};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::stats::{median, quantile, spread};

const SERVER_NAME: &str = "localhost";
const ALPN: &[u8] = b"chunnel-bench/1";
const MIB: usize = 1024 * 1024;
/// The whole run taking longer than this has stalled.
const STALL: Duration = Duration::from_secs(900);

#[derive(clap::Args, Clone)]
pub(crate) struct Args {
    /// Repetitions (each measures every transport and side, interleaved).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Connections per side per repetition for connect + first echo.
    #[arg(long, default_value_t = 200)]
    conns: usize,
    /// Timed echo round trips per side per repetition.
    #[arg(long, default_value_t = 5000)]
    msgs: usize,
    /// Echo message size (bytes).
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Bulk transfer per side per repetition, in MiB.
    #[arg(long, default_value_t = 64)]
    bulk_mib: usize,
    /// Bulk message size (bytes).
    #[arg(long, default_value_t = 16 * 1024)]
    bulk_size: usize,
    /// CPU to pin to (client and servers share it); negative to leave unpinned.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    cpu: i64,
    /// Only these transports (comma-separated: tls, quic).
    #[arg(long, value_delimiter = ',', default_value = "tls,quic")]
    transports: Vec<String>,
    /// Skip the negotiated select(quic, tls) connect + first echo.
    #[arg(long)]
    no_negotiated: bool,
    /// Profiling aid: measure only this side (raw or library); its figures stand in for the
    /// other's, so the ratios are meaningless. For callgrind / perf on one side.
    #[arg(long, hide = true)]
    only: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Transport {
    Tls,
    Quic,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Tls => "tls_over_tcp",
            Transport::Quic => "quic_stream",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Raw,
    Lib,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Raw => "raw",
            Side::Lib => "library",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    /// Sends every message back.
    Echo,
    /// Counts bytes; answers an empty message with the count (8 bytes, big-endian).
    Sink,
}

/// One repetition's figures for one transport and side.
#[derive(Clone, Copy, Default)]
struct Sample {
    connect_p50_us: f64,
    connect_p99_us: f64,
    echo_p50_us: f64,
    echo_p99_us: f64,
    bulk_mib_s: f64,
    /// Bulk MiB per CPU-second of this thread (client, servers and quinn's drivers all run
    /// on it): what the transfer costs, whatever else the core ran meanwhile.
    bulk_mib_cpu_s: f64,
}

/// CPU time of the calling thread, in seconds.
fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

pub(crate) fn run(a: Args) -> Result<()> {
    ensure!(
        a.reps >= 1 && a.conns >= 1 && a.msgs >= 1 && a.bulk_mib >= 1 && a.bulk_size >= 1,
        "need --reps, --conns, --msgs, --bulk-mib and --bulk-size >= 1"
    );
    let mut transports = Vec::new();
    for t in &a.transports {
        transports.push(match t.as_str() {
            "tls" => Transport::Tls,
            "quic" => Transport::Quic,
            other => anyhow::bail!("unknown transport {other:?} (tls, quic)"),
        });
    }
    if a.cpu >= 0 {
        crate::pin_to(a.cpu as usize)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let started = Instant::now();
    let (results, negotiated) = rt.block_on(async {
        tokio::time::timeout(STALL, measure_all(&a, &transports))
            .await
            .context("secure benchmark stalled")?
    })?;
    let wall = started.elapsed();

    let mut per_transport = serde_json::Map::new();
    let mut checks = serde_json::Map::new();
    let mut all = true;
    for (t, [raw, lib]) in transports.iter().zip(&results) {
        let (v, echo_ok, tput_ok, connect_ratio) = report(*t, raw, lib);
        let key = t.name();
        checks.insert(format!("{key}_echo_p50_within_1_05x"), json!(echo_ok));
        checks.insert(format!("{key}_throughput_at_least_0_95x"), json!(tput_ok));
        checks.insert(
            format!("{key}_connect_first_echo_p50_ratio"),
            json!(connect_ratio),
        );
        all &= echo_ok && tput_ok;
        per_transport.insert(key.into(), v);
    }
    let mut neg_json = Value::Null;
    if let Some(neg) = &negotiated {
        let qi = transports
            .iter()
            .position(|t| *t == Transport::Quic)
            .context("negotiated figures without quic")?;
        let (v, ok) = report_negotiated(neg, &results[qi][0]);
        checks.insert("negotiated_connect_within_1_1x".into(), json!(ok));
        all &= ok;
        neg_json = v;
    }
    checks.insert("all_meet_bar".into(), json!(all));
    let out = json!({
        "bench": "secure",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "what": "chunnel-secure TLS-over-TCP and QUIC (stream mode) vs tokio-rustls and quinn used directly; \
                 same rcgen certificate, same length framing, one pinned core, interleaved repetitions",
        "cpu": a.cpu,
        "reps": a.reps,
        "conns_per_rep": a.conns,
        "echo_msgs_per_rep": a.msgs,
        "echo_size": a.size,
        "bulk_bytes_per_rep": a.bulk_mib * MIB,
        "bulk_msg_size": a.bulk_size,
        "wall_seconds": wall.as_secs_f64(),
        "transports": per_transport,
        "negotiated": neg_json,
        "checks": checks,
    });
    println!("{out}");
    Ok(())
}

/// The JSON of one transport: both sides' figures and the per-repetition ratios; also whether
/// the echo p50 and throughput ratios meet the bar, and the connect ratio's median.
fn report(t: Transport, raw: &[Sample], lib: &[Sample]) -> (Value, bool, bool, f64) {
    let col = |xs: &[Sample], f: fn(&Sample) -> f64| xs.iter().map(f).collect::<Vec<_>>();
    let side = |xs: &[Sample], what: &str| {
        json!({
            "what": what,
            "connect_first_echo_p50_us": spread(&col(xs, |s| s.connect_p50_us)),
            "connect_first_echo_p99_us": spread(&col(xs, |s| s.connect_p99_us)),
            "echo_p50_us": spread(&col(xs, |s| s.echo_p50_us)),
            "echo_p99_us": spread(&col(xs, |s| s.echo_p99_us)),
            "bulk_mib_per_s": spread(&col(xs, |s| s.bulk_mib_s)),
            "bulk_mib_per_cpu_s": spread(&col(xs, |s| s.bulk_mib_cpu_s)),
        })
    };
    let ratio = |f: fn(&Sample) -> f64| -> Vec<f64> {
        raw.iter().zip(lib).map(|(r, l)| f(l) / f(r)).collect()
    };
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        median(&v)
    };
    let connect = ratio(|s| s.connect_p50_us);
    let echo = ratio(|s| s.echo_p50_us);
    let tput = ratio(|s| s.bulk_mib_s);
    let tput_cpu = ratio(|s| s.bulk_mib_cpu_s);
    let b_cpu = med(tput_cpu.clone());
    let (c, e, b) = (med(connect.clone()), med(echo.clone()), med(tput.clone()));
    let (raw_what, lib_what) = match t {
        Transport::Tls => (
            "tokio-rustls over tokio TcpStream, write_all + flush / read_exact of length-framed messages",
            "chunnel_secure::tls::Connect vs tls::Listener",
        ),
        Transport::Quic => (
            "quinn, one bidirectional stream, write_all / read_exact of length-framed messages",
            "chunnel_secure::quic::Connect vs quic::Listener, Mode::Stream",
        ),
    };
    let echo_ok = e <= 1.05;
    let tput_ok = b >= 0.95;
    let v = json!({
        "raw": side(raw, raw_what),
        "library": side(lib, lib_what),
        "ratios_library_over_raw": {
            "connect_first_echo_p50": spread(&connect),
            "echo_p50": spread(&echo),
            "echo_p99": spread(&ratio(|s| s.echo_p99_us)),
            "bulk_throughput": spread(&tput),
            "bulk_throughput_per_cpu_s": spread(&tput_cpu),
        },
        "bar": {
            "echo_p50_ratio": e,
            "echo_p50_within_1_05x": echo_ok,
            "throughput_ratio": b,
            "throughput_at_least_0_95x": tput_ok,
            "throughput_per_cpu_s_ratio": b_cpu,
            "throughput_per_cpu_s_at_least_0_95x": b_cpu >= 0.95,
        },
    });
    (v, echo_ok, tput_ok, c)
}

/// The JSON of the negotiated connect + first echo against raw quinn's (`raw`, the same
/// repetitions), and whether it meets the 1.1x bar.
fn report_negotiated(neg: &[NegSample], raw: &[Sample]) -> (Value, bool) {
    let col = |f: fn(&NegSample) -> f64| neg.iter().map(f).collect::<Vec<_>>();
    let ratio = |f: fn(&NegSample) -> f64| -> Vec<f64> {
        neg.iter()
            .zip(raw)
            .map(|(n, r)| f(n) / r.connect_p50_us)
            .collect()
    };
    let mut r = ratio(|n| n.pipelined_p50_us);
    r.sort_by(f64::total_cmp);
    let m = median(&r);
    let ok = m <= 1.1;
    let v = json!({
        "what": "chunnel_secure::negotiated: Server offering (quic, tls) preferring QUIC, Client offering select(quic, tls), one message echoed per connection. The bar measures reconnects (as raw quinn's connect reuses its endpoint and TLS resumption): the client remembers its verified QUIC pick and goes straight to the QUIC endpoint with a REBIND (docs/wire.md §16.5), no UDP negotiation. first_contact_* measures a client that remembers nothing (remember(0)): UDP negotiation, QUIC handshake to the picked endpoint, BIND/BOUND.",
        "pick": "quic",
        "measures": "reconnect (remembered pick, REBIND); first_contact: fresh negotiation each time",
        "connect_first_echo_p50_us": spread(&col(|n| n.pipelined_p50_us)),
        "connect_first_echo_p99_us": spread(&col(|n| n.pipelined_p99_us)),
        "connect_then_send_p50_us": spread(&col(|n| n.sequential_p50_us)),
        "first_contact_connect_first_echo_p50_us": spread(&col(|n| n.first_contact_p50_us)),
        "raw_quinn_connect_first_echo_p50_us": spread(&raw.iter().map(|s| s.connect_p50_us).collect::<Vec<_>>()),
        "ratios_over_raw_quinn": {
            "connect_first_echo_p50": spread(&r),
            "connect_then_send_p50": spread(&ratio(|n| n.sequential_p50_us)),
            "first_contact_connect_first_echo_p50": spread(&ratio(|n| n.first_contact_p50_us)),
        },
        "bar": {
            "connect_first_echo_p50_ratio": m,
            "measured_on": "reconnect",
            "within_1_1x": ok,
        },
    });
    (v, ok)
}

/// One repetition's negotiated figures.
#[derive(Clone, Copy, Default)]
struct NegSample {
    /// `connect_with(addr, [msg])`, then the echo read.
    pipelined_p50_us: f64,
    pipelined_p99_us: f64,
    /// `connect(addr)`, then the message sent and the echo read.
    sequential_p50_us: f64,
    /// `connect_with(addr, [msg])` by a client that remembers nothing (a fresh negotiation
    /// each time), then the echo read.
    first_contact_p50_us: f64,
}

/// The negotiated server (echoing) and client.
struct Negotiated {
    /// Remembers its verified pick: every measured connect is a reconnect (REBIND).
    client: negotiated::Client,
    /// Remembers nothing: every connect negotiates.
    fresh: negotiated::Client,
    addr: SocketAddr,
    _server: tokio::task::JoinHandle<()>,
}

impl Negotiated {
    async fn start(certs: &Certs) -> Result<Self> {
        let id = Identity::from_der(vec![certs.cert.clone()], certs.key());
        let mut server = negotiated::Server::builder([NTransport::Quic, NTransport::Tls])
            .identity(id)
            .bind(any_local())
            .await?;
        let addr = server.local_addr();
        let task = tokio::spawn(async move {
            while let Ok(r) = server.accept().await {
                if let Ok(c) = r {
                    tokio::spawn(async move {
                        let _ = lib_handle(c, Role::Echo).await;
                    });
                }
            }
        });
        let mut roots = TrustRoots::empty();
        roots.add_der(certs.cert.clone())?;
        let client = negotiated::Client::builder([NTransport::Quic, NTransport::Tls])
            .trust(roots.clone(), SERVER_NAME)
            .build()?;
        let fresh = negotiated::Client::builder([NTransport::Quic, NTransport::Tls])
            .trust(roots, SERVER_NAME)
            .remember(0)
            .build()?;
        // The first contact, so that every measured connect of `client` is a reconnect.
        drop(client.connect(addr).await?);
        ensure!(client.remembered() == 1, "the QUIC pick was not remembered");
        Ok(Negotiated {
            client,
            fresh,
            addr,
            _server: task,
        })
    }

    async fn sample(&self, a: &Args, m: &Bytes) -> Result<NegSample> {
        let mut pipelined = Vec::with_capacity(a.conns);
        let mut sequential = Vec::with_capacity(a.conns);
        let mut first_contact = Vec::with_capacity(a.conns);
        // Each variant in its own run of connections, as raw quinn's are measured: a
        // variant's leftovers (closing connections, the negotiation's UDP state) do not land
        // inside another's timings.
        for i in (0..3).flat_map(|v| std::iter::repeat_n(v, a.conns)) {
            let t = Instant::now();
            let c = match i % 3 {
                0 => self.client.connect_with(self.addr, [m.clone()]).await?,
                1 => {
                    let c = self.client.connect(self.addr).await?;
                    c.send_one(m.clone()).await?;
                    c
                }
                _ => self.fresh.connect_with(self.addr, [m.clone()]).await?,
            };
            let got = c.recv_one().await?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            ensure!(
                c.transport() == NTransport::Quic,
                "negotiated {}",
                c.transport()
            );
            ensure!(got.len() == m.len(), "negotiated echo: {} B", got.len());
            drop(c);
            match i % 3 {
                0 => pipelined.push(us),
                1 => sequential.push(us),
                _ => first_contact.push(us),
            }
        }
        pipelined.sort_by(f64::total_cmp);
        sequential.sort_by(f64::total_cmp);
        first_contact.sort_by(f64::total_cmp);
        Ok(NegSample {
            pipelined_p50_us: median(&pipelined),
            pipelined_p99_us: quantile(&pipelined, 0.99),
            sequential_p50_us: median(&sequential),
            first_contact_p50_us: median(&first_contact),
        })
    }
}

type Measured = (Vec<[Vec<Sample>; 2]>, Option<Vec<NegSample>>);

/// Per transport: [raw samples, library samples]; the negotiated samples if measured.
async fn measure_all(a: &Args, transports: &[Transport]) -> Result<Measured> {
    let certs = Certs::new()?;
    let neg = if transports.contains(&Transport::Quic) && !a.no_negotiated {
        Some(Negotiated::start(&certs).await?)
    } else {
        None
    };
    let mut neg_out = Vec::new();
    let mut clients = Vec::new();
    for &t in transports {
        clients.push([
            Client::start(t, Side::Raw, &certs).await?,
            Client::start(t, Side::Lib, &certs).await?,
        ]);
    }
    let mut out: Vec<[Vec<Sample>; 2]> = transports.iter().map(|_| Default::default()).collect();
    let echo_msg = Bytes::from(vec![0x5a; a.size]);
    let bulk_msg = Bytes::from(vec![0xa5; a.bulk_size]);
    for rep in 0..a.reps {
        for (ti, &t) in transports.iter().enumerate() {
            let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
            let neg_here = neg.as_ref().filter(|_| t == Transport::Quic);
            if let Some(n) = neg_here
                && rep % 2 == 0
            {
                neg_out.push(negotiated_sample(n, a, &echo_msg, rep).await?);
            }
            for si in order {
                if let Some(only) = &a.only
                    && clients[ti][si].side.name() != only
                {
                    let o = 1 - si;
                    let s = clients[ti][o].sample(a, &echo_msg, &bulk_msg).await?;
                    out[ti][si].push(s);
                    continue;
                }
                let c = &mut clients[ti][si];
                let s = c
                    .sample(a, &echo_msg, &bulk_msg)
                    .await
                    .with_context(|| format!("{} {} rep {rep}", t.name(), c.side.name()))?;
                eprintln!(
                    "rep {rep} {:<12} {:<7}: connect+echo p50 {:>8.1} us  echo p50 {:>7.1} us p99 {:>7.1} us  bulk {:>7.1} MiB/s ({:>7.1} MiB/cpu-s)",
                    t.name(),
                    c.side.name(),
                    s.connect_p50_us,
                    s.echo_p50_us,
                    s.echo_p99_us,
                    s.bulk_mib_s,
                    s.bulk_mib_cpu_s
                );
                out[ti][si].push(s);
            }
            if let Some(n) = neg_here
                && rep % 2 == 1
            {
                neg_out.push(negotiated_sample(n, a, &echo_msg, rep).await?);
            }
        }
    }
    Ok((out, neg.map(|_| neg_out)))
}

async fn negotiated_sample(n: &Negotiated, a: &Args, m: &Bytes, rep: usize) -> Result<NegSample> {
    let s = n
        .sample(a, m)
        .await
        .with_context(|| format!("negotiated rep {rep}"))?;
    eprintln!(
        "rep {rep} negotiated select(quic, tls): reconnect+echo p50 {:>8.1} us (connect, then send: {:>8.1} us; first contact: {:>8.1} us)",
        s.pipelined_p50_us, s.sequential_p50_us, s.first_contact_p50_us
    );
    Ok(s)
}

/// The rcgen certificate both sides use, for `localhost`.
struct Certs {
    cert: CertificateDer<'static>,
    key_pkcs8: Vec<u8>,
}

impl Certs {
    fn new() -> Result<Self> {
        let ck = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()])?;
        Ok(Certs {
            cert: ck.cert.der().clone(),
            key_pkcs8: ck.signing_key.serialize_der(),
        })
    }

    fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_pkcs8.clone()))
    }

    fn lib_server(&self) -> Result<ServerConfig> {
        Ok(
            ServerConfig::builder(Identity::from_der(vec![self.cert.clone()], self.key()))
                .alpn([ALPN])
                .build()?,
        )
    }

    fn lib_client(&self) -> Result<ClientConfig> {
        let mut roots = TrustRoots::empty();
        roots.add_der(self.cert.clone())?;
        Ok(ClientConfig::builder(roots, SERVER_NAME)
            .alpn([ALPN])
            .build()?)
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// rustls alone: ring, TLS 1.3 only, the ALPN, rustls's default session storage.
    fn raw_server(&self) -> Result<rustls::ServerConfig> {
        let mut cfg = rustls::ServerConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(vec![self.cert.clone()], self.key())?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }

    /// rustls alone: ring, TLS 1.3 only, trusting the certificate, the ALPN, rustls's default
    /// session cache.
    fn raw_client(&self) -> Result<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.cert.clone())?;
        let mut cfg = rustls::ClientConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth();
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }
}

fn any_local() -> SocketAddr {
    (Ipv4Addr::LOCALHOST, 0).into()
}

/// How a client reaches its echo and sink servers.
// Four long-lived values: their size does not matter, an extra indirection on one side might.
#[allow(clippy::large_enum_variant)]
enum Dial {
    RawTls {
        connector: TlsConnector,
        name: ServerName<'static>,
    },
    RawQuic {
        endpoint: quinn::Endpoint,
        cfg: quinn::ClientConfig,
    },
    LibTls([tls::Connect; 2]),
    LibQuic([quic::Connect; 2]),
}

/// One transport and side: its two servers (echo, sink) run as tasks; this dials them.
struct Client {
    side: Side,
    dial: Dial,
    /// [echo, sink] server addresses.
    addrs: [SocketAddr; 2],
}

impl Client {
    async fn start(t: Transport, side: Side, certs: &Certs) -> Result<Self> {
        let roles = [Role::Echo, Role::Sink];
        let mut addrs = [any_local(); 2];
        let dial = match (t, side) {
            (Transport::Tls, Side::Raw) => {
                let acceptor = TlsAcceptor::from(Arc::new(certs.raw_server()?));
                for (i, role) in roles.into_iter().enumerate() {
                    let l = TcpListener::bind(any_local()).await?;
                    addrs[i] = l.local_addr()?;
                    tokio::spawn(raw_tls_serve(l, acceptor.clone(), role));
                }
                Dial::RawTls {
                    connector: TlsConnector::from(Arc::new(certs.raw_client()?)),
                    name: ServerName::try_from(SERVER_NAME)?,
                }
            }
            (Transport::Quic, Side::Raw) => {
                let server = quinn::ServerConfig::with_crypto(Arc::new(
                    QuicServerConfig::try_from(certs.raw_server()?)
                        .map_err(|e| anyhow!("QUIC server config: {e}"))?,
                ));
                for (i, role) in roles.into_iter().enumerate() {
                    let ep = quinn::Endpoint::server(server.clone(), any_local())?;
                    addrs[i] = ep.local_addr()?;
                    tokio::spawn(raw_quic_serve(ep, role));
                }
                let cfg = quinn::ClientConfig::new(Arc::new(
                    QuicClientConfig::try_from(certs.raw_client()?)
                        .map_err(|e| anyhow!("QUIC client config: {e}"))?,
                ));
                Dial::RawQuic {
                    endpoint: quinn::Endpoint::client(any_local())?,
                    cfg,
                }
            }
            (Transport::Tls, Side::Lib) => {
                let server = certs.lib_server()?;
                for (i, role) in roles.into_iter().enumerate() {
                    let l = tls::Listener::bind(any_local(), server.clone()).await?;
                    addrs[i] = l.local_addr()?;
                    tokio::spawn(lib_serve(l, role));
                }
                let cfg = certs.lib_client()?;
                Dial::LibTls(addrs.map(|a| tls::Connect::new(a, cfg.clone())))
            }
            (Transport::Quic, Side::Lib) => {
                let server = certs.lib_server()?;
                for (i, role) in roles.into_iter().enumerate() {
                    let l = quic::Listener::bind(any_local(), server.clone(), Mode::Stream)?;
                    addrs[i] = l.local_addr()?;
                    tokio::spawn(lib_serve(l, role));
                }
                let cfg = certs.lib_client()?;
                // One client endpoint for both servers, as the raw side has.
                let endpoint = quinn::Endpoint::client(any_local())?;
                Dial::LibQuic(addrs.map(|a| {
                    quic::Connect::new(a, cfg.clone(), Mode::Stream).with_endpoint(endpoint.clone())
                }))
            }
        };
        Ok(Client { side, dial, addrs })
    }

    async fn connect(&mut self, role: Role) -> Result<Conn> {
        let i = role as usize;
        let addr = self.addrs[i];
        Ok(match &mut self.dial {
            Dial::RawTls { connector, name } => {
                let tcp = TcpStream::connect(addr).await?;
                tcp.set_nodelay(true)?;
                let s = connector.connect(name.clone(), tcp).await?;
                Conn::RawTls(RawStream::new(s))
            }
            Dial::RawQuic { endpoint, cfg } => {
                let conn = endpoint
                    .connect_with(cfg.clone(), addr, SERVER_NAME)?
                    .await?;
                let (s, r) = conn.open_bi().await?;
                Conn::RawQuic(RawStream::new(Bi { s, r }), conn)
            }
            Dial::LibTls(c) => Conn::LibTls(c[i].connect_wrap(()).await?),
            Dial::LibQuic(c) => Conn::LibQuic(c[i].connect_wrap(()).await?),
        })
    }

    async fn sample(&mut self, a: &Args, echo_msg: &Bytes, bulk_msg: &Bytes) -> Result<Sample> {
        // 1. connect + first echo.
        let mut lat = Vec::with_capacity(a.conns);
        for _ in 0..a.conns {
            let t = Instant::now();
            let mut c = self.connect(Role::Echo).await?;
            c.echo(echo_msg).await?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            drop(c);
        }
        lat.sort_by(f64::total_cmp);
        let (connect_p50_us, connect_p99_us) = (median(&lat), quantile(&lat, 0.99));

        // 2. echo round trips on one connection.
        let mut c = self.connect(Role::Echo).await?;
        for _ in 0..(a.msgs / 10).max(1) {
            c.echo(echo_msg).await?;
        }
        lat.clear();
        for _ in 0..a.msgs {
            let t = Instant::now();
            c.echo(echo_msg).await?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        lat.sort_by(f64::total_cmp);
        let (echo_p50_us, echo_p99_us) = (median(&lat), quantile(&lat, 0.99));
        c.close().await?;

        // 3. bulk, one direction.
        let mut c = self.connect(Role::Sink).await?;
        let warm = MIB.div_ceil(bulk_msg.len());
        c.bulk(bulk_msg, warm).await?;
        let n = (a.bulk_mib * MIB).div_ceil(bulk_msg.len());
        let (t, cpu) = (Instant::now(), thread_cpu_secs());
        c.bulk(bulk_msg, n).await?;
        let (secs, cpu) = (t.elapsed().as_secs_f64(), thread_cpu_secs() - cpu);
        c.close().await?;
        Ok(Sample {
            connect_p50_us,
            connect_p99_us,
            echo_p50_us,
            echo_p99_us,
            bulk_mib_s: (n * bulk_msg.len()) as f64 / MIB as f64 / secs,
            bulk_mib_cpu_s: (n * bulk_msg.len()) as f64 / MIB as f64 / cpu,
        })
    }
}

/// A connected client.
// A handful at a time; boxing one variant would add an indirection to one side only.
#[allow(clippy::large_enum_variant)]
enum Conn {
    RawTls(RawStream<tokio_rustls::client::TlsStream<TcpStream>>),
    /// The stream and its connection (kept for the close).
    RawQuic(RawStream<Bi>, quinn::Connection),
    LibTls(tls::Connection),
    LibQuic(quic::Connection),
}

impl Conn {
    /// One message there and back.
    async fn echo(&mut self, m: &Bytes) -> Result<()> {
        let got = match self {
            Conn::RawTls(s) => s.echo(m).await?,
            Conn::RawQuic(s, _) => s.echo(m).await?,
            Conn::LibTls(c) => lib_echo(c, m).await?,
            Conn::LibQuic(c) => lib_echo(c, m).await?,
        };
        ensure!(got == m.len(), "echo: sent {} B, got {got} B", m.len());
        Ok(())
    }

    /// `n` messages to the sink, then the empty message; checks the sink's count.
    async fn bulk(&mut self, m: &Bytes, n: usize) -> Result<()> {
        let count = match self {
            Conn::RawTls(s) => s.bulk(m, n).await?,
            Conn::RawQuic(s, _) => s.bulk(m, n).await?,
            Conn::LibTls(c) => lib_bulk(c, m, n).await?,
            Conn::LibQuic(c) => lib_bulk(c, m, n).await?,
        };
        let want = (n * m.len()) as u64;
        ensure!(count == want, "bulk: sent {want} B, sink counted {count} B");
        Ok(())
    }

    async fn close(self) -> Result<()> {
        match self {
            Conn::RawTls(mut s) => s.io.shutdown().await?,
            Conn::RawQuic(mut s, conn) => {
                s.io.shutdown().await?;
                drop(conn);
            }
            Conn::LibTls(c) => c.close().await?,
            Conn::LibQuic(c) => c.close().await?,
        }
        Ok(())
    }
}

async fn lib_echo<C: ChunnelConnection<Data = Bytes>>(c: &C, m: &Bytes) -> Result<usize> {
    c.send_one(m.clone()).await?;
    Ok(c.recv_one().await?.len())
}

async fn lib_bulk<C: ChunnelConnection<Data = Bytes>>(c: &C, m: &Bytes, n: usize) -> Result<u64> {
    for _ in 0..n {
        c.send_one(m.clone()).await?;
    }
    c.send_one(Bytes::new()).await?;
    count_of(&c.recv_one().await?)
}

fn count_of(b: &[u8]) -> Result<u64> {
    let a: [u8; 8] = b
        .try_into()
        .map_err(|_| anyhow!("sink answered {} B, not 8", b.len()))?;
    Ok(u64::from_be_bytes(a))
}

/// The library's servers: accept, and serve each connection in its own task.
async fn lib_serve<L>(mut l: L, role: Role)
where
    L: chunnel::Listener,
    L::Connection: ChunnelConnection<Data = Bytes> + 'static,
{
    while let Ok(c) = l.accept().await {
        tokio::spawn(async move {
            let _ = lib_handle(c, role).await;
        });
    }
}

async fn lib_handle<C: ChunnelConnection<Data = Bytes>>(c: C, role: Role) -> Result<()> {
    let mut slots: Vec<Option<Bytes>> = vec![None; 16];
    let mut sunk = 0u64;
    loop {
        let n = c.recv(&mut slots).await?;
        match role {
            Role::Echo => {
                c.send(slots[..n].iter_mut().filter_map(Option::take))
                    .await?
            }
            Role::Sink => {
                for m in slots[..n].iter_mut().filter_map(Option::take) {
                    if m.is_empty() {
                        c.send_one(Bytes::copy_from_slice(&sunk.to_be_bytes()))
                            .await?;
                        sunk = 0;
                    } else {
                        sunk += m.len() as u64;
                    }
                }
            }
        }
    }
}

/// tokio-rustls: accept TCP, handshake and serve each client in its own task.
async fn raw_tls_serve(l: TcpListener, acceptor: TlsAcceptor, role: Role) {
    while let Ok((tcp, _)) = l.accept().await {
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let _ = tcp.set_nodelay(true);
            if let Ok(s) = acceptor.accept(tcp).await {
                let _ = RawStream::new(s).serve(role).await;
            }
        });
    }
}

/// quinn: accept each connection and its one stream in their own task.
async fn raw_quic_serve(ep: quinn::Endpoint, role: Role) {
    while let Some(incoming) = ep.accept().await {
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            let Ok((s, r)) = conn.accept_bi().await else {
                return;
            };
            let _ = RawStream::new(Bi { s, r }).serve(role).await;
            drop(conn);
        });
    }
}

/// A quinn bidirectional stream as one byte stream.
struct Bi {
    s: quinn::SendStream,
    r: quinn::RecvStream,
}

impl AsyncRead for Bi {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        AsyncRead::poll_read(Pin::new(&mut self.get_mut().r), cx, buf)
    }
}

impl AsyncWrite for Bi {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut self.get_mut().s), cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut self.get_mut().s), cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_shutdown(Pin::new(&mut self.get_mut().s), cx)
    }
}

/// Length-framed messages over a byte stream, written by hand: each frame built in a reusable
/// buffer and written with `write_all` + `flush`; read with `read_exact`.
struct RawStream<S> {
    io: S,
    out: Vec<u8>,
    inb: Vec<u8>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> RawStream<S> {
    fn new(io: S) -> Self {
        RawStream {
            io,
            out: Vec::new(),
            inb: Vec::new(),
        }
    }

    async fn write_frame(&mut self, m: &[u8]) -> io::Result<()> {
        self.out.clear();
        self.out.extend_from_slice(&(m.len() as u32).to_be_bytes());
        self.out.extend_from_slice(m);
        self.io.write_all(&self.out).await
    }

    /// Reads one frame into `self.inb`; returns its length.
    async fn read_frame(&mut self) -> io::Result<usize> {
        let mut h = [0u8; 4];
        self.io.read_exact(&mut h).await?;
        let len = u32::from_be_bytes(h) as usize;
        self.inb.resize(len, 0);
        self.io.read_exact(&mut self.inb).await?;
        Ok(len)
    }

    async fn echo(&mut self, m: &[u8]) -> io::Result<usize> {
        self.write_frame(m).await?;
        self.io.flush().await?;
        self.read_frame().await
    }

    async fn bulk(&mut self, m: &[u8], n: usize) -> Result<u64> {
        for _ in 0..n {
            self.write_frame(m).await?;
        }
        self.write_frame(&[]).await?;
        self.io.flush().await?;
        self.read_frame().await?;
        count_of(&self.inb)
    }

    async fn serve(&mut self, role: Role) -> io::Result<()> {
        let mut sunk = 0u64;
        loop {
            let len = self.read_frame().await?;
            match role {
                Role::Echo => {
                    let m = std::mem::take(&mut self.inb);
                    self.write_frame(&m).await?;
                    self.inb = m;
                    self.io.flush().await?;
                }
                Role::Sink if len == 0 => {
                    self.write_frame(&sunk.to_be_bytes()).await?;
                    self.io.flush().await?;
                    sunk = 0;
                }
                Role::Sink => sunk += len as u64,
            }
        }
    }
}
