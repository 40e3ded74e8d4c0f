//! The negotiation part of the tour. A server offers one stack; clients offer theirs; the
//! server picks (or refuses) and both build the picked stack.
//!
//! The layer being negotiated is [`Checksum`], a real byte-to-byte Chunnel defined here: it
//! appends a 4-byte checksum to every message and checks it on receive. Both ends must use
//! the same algorithm, so its capability is exact-match: `checksum = {crc32}` or
//! `checksum = {fnv1a}`.
//!
//! * Client 1 offers `select(Checksum(Crc32), Checksum(Fnv1a))` (prefers crc32) to a server
//!   that only has fnv1a: it falls back to the shared option, then reconnects with 0-RTT.
//! * Client 2 offers only crc32: both ends get a clear `Incompatible` error, and the server
//!   keeps serving the next client.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::{Bytes, BytesMut};
use chunnel::negotiate::ChunnelInfo;
use chunnel::{
    Capability, Chunnel, ChunnelConnection, ConnectionExt, Error as ChunnelError, Match, Negotiate,
    Offers, select,
};
use chunnel_negotiate::proto::Timing;
use chunnel_negotiate::{Client, Config, Error, Info, ZeroRtt, listen};
use chunnel_net::udp;
use tokio::sync::mpsc;
use tokio::time::timeout;

/// Bound on every single step (a connect, an echo, a server report).
const STEP: Duration = Duration::from_secs(2);
/// Echoes per connection when measuring round trips.
const ECHOES: usize = 5;
/// Connections of each kind when comparing 1-RTT with 0-RTT.
const ROUNDS: usize = 20;
/// The largest message of this part. The sockets' receive buffers are sized from it (one
/// slot per datagram of a batch, zeroed when first used): with UDP's default of 64 KiB a new
/// client socket spends about a millisecond on its half-megabyte buffer, which would hide
/// the round trip that 0-RTT saves.
const MAX_PAYLOAD: usize = 2048;

fn udp_config() -> udp::Config {
    udp::Config::default().with_max_payload_bytes(MAX_PAYLOAD)
}

// ---------------------------------------------------------------------------------------
// The Checksum Chunnel.

/// A checksum algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    /// CRC-32 (IEEE 802.3, reflected, as in zlib and Ethernet).
    Crc32,
    /// 32-bit FNV-1a.
    Fnv1a,
}

impl Algo {
    fn label(self) -> &'static str {
        match self {
            Algo::Crc32 => "crc32",
            Algo::Fnv1a => "fnv1a",
        }
    }

    fn sum(self, data: &[u8]) -> u32 {
        match self {
            Algo::Crc32 => crc32(data),
            Algo::Fnv1a => fnv1a(data),
        }
    }

    /// The message with its checksum appended (big-endian).
    fn seal(self, m: &[u8]) -> Bytes {
        let mut out = BytesMut::with_capacity(m.len() + 4);
        out.extend_from_slice(m);
        out.extend_from_slice(&self.sum(m).to_be_bytes());
        out.freeze()
    }

    /// The message without its checksum, or `None` if it is too short or the checksum is
    /// wrong. Does not copy.
    fn open(self, mut m: Bytes) -> Option<Bytes> {
        let body = m.len().checked_sub(4)?;
        let want = u32::from_be_bytes(m[body..].try_into().ok()?);
        if self.sum(&m[..body]) != want {
            return None;
        }
        m.truncate(body);
        Some(m)
    }
}

/// CRC-32, bit by bit (no table): small and plenty fast for a demo.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// 32-bit FNV-1a.
fn fnv1a(data: &[u8]) -> u32 {
    data.iter().fold(0x811c_9dc5, |h, &b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// Appends a 4-byte checksum to every message sent and verifies and strips it on receive.
/// Works over any byte connection.
#[derive(Clone, Copy, Debug)]
pub struct Checksum(pub Algo);

impl Negotiate for Checksum {
    fn id(&self) -> &'static str {
        "demo/checksum/1"
    }

    fn capabilities(&self) -> Vec<Capability> {
        // Both ends must compute the same sum: exact match.
        vec![Capability::exact("checksum", [self.0.label()])]
    }
}

impl<C: ChunnelConnection<Data = Bytes>> Chunnel<C> for Checksum {
    type Connection = ChecksumConn<C>;

    async fn connect_wrap(&mut self, inner: C) -> Result<ChecksumConn<C>, ChunnelError> {
        Ok(ChecksumConn {
            inner,
            algo: self.0,
            corrupt: AtomicBool::new(false),
        })
    }
}

/// A [`Checksum`] connection.
///
/// A message whose checksum is wrong (or that is shorter than one) is dropped and reported
/// as [`ChunnelError::Malformed`]: at once if nothing good arrived with it, else by the next
/// `recv` (so the good messages of the same batch are not lost). The connection stays
/// usable.
#[derive(Debug)]
pub struct ChecksumConn<C> {
    inner: C,
    algo: Algo,
    /// A corrupted message was dropped and not yet reported.
    corrupt: AtomicBool,
}

fn bad_checksum() -> ChunnelError {
    ChunnelError::Malformed {
        what: "checksum mismatch (or message shorter than its checksum)",
    }
}

impl<C: ChunnelConnection<Data = Bytes>> ChunnelConnection for ChecksumConn<C> {
    type Data = Bytes;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), ChunnelError>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        let algo = self.algo;
        self.inner
            .send(burst.into_iter().map(move |m| algo.seal(&m)))
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, ChunnelError> {
        if slots.is_empty() {
            return Ok(0);
        }
        if self.corrupt.swap(false, Ordering::Relaxed) {
            return Err(bad_checksum());
        }
        loop {
            // Cancel safe: no await point after the inner recv returned.
            let n = self.inner.recv(slots).await?;
            let mut good = 0;
            let mut bad = false;
            for i in 0..n {
                let Some(m) = slots[i].take() else { continue };
                match self.algo.open(m) {
                    Some(m) => {
                        slots[good] = Some(m);
                        good += 1;
                    }
                    None => bad = true,
                }
            }
            if bad {
                if good == 0 {
                    return Err(bad_checksum());
                }
                self.corrupt.store(true, Ordering::Relaxed);
            }
            if good > 0 {
                return Ok(good);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The tour.

fn config() -> Config {
    Config {
        timing: Timing {
            initial_rto: Duration::from_millis(50),
            attempts: 5,
            max_message: MAX_PAYLOAD,
            ..Timing::default()
        },
        hello_timeout: STEP,
        ..Config::default()
    }
}

fn caps(list: &[Capability]) -> String {
    list.iter()
        .map(|c| {
            let how = match c.matching {
                Match::Exact => "exact",
                Match::Compositional => "compositional",
            };
            format!(" [{} = {{{}}}, {how}]", c.kind, c.labels.join(","))
        })
        .collect()
}

fn chunnels(list: &[ChunnelInfo]) -> String {
    list.iter()
        .map(|c| format!("{}{}", c.id, caps(&c.capabilities)))
        .collect::<Vec<_>>()
        .join(" > ")
}

fn print_offers(who: &str, expr: &str, stack: &impl Offers) {
    let offers = stack.offers();
    // A pick lists the branch taken at each select: [] for a stack without one.
    println!("{who} offers {expr}: {} option(s)", offers.len());
    for o in &offers {
        println!(
            "    pick {:?}: {}",
            o.pick.branches(),
            chunnels(&o.chunnels)
        );
    }
}

fn us(d: Duration) -> String {
    format!("{:.1} us", d.as_secs_f64() * 1e6)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// What the server's accept loop saw for one client.
type Report = std::result::Result<Info, String>;

/// A negotiating echo server with stack `Checksum(Fnv1a)` on a fresh loopback port; every
/// `accept()` result is reported on the channel.
async fn server() -> Result<(SocketAddr, mpsc::Receiver<Report>)> {
    let listener = udp::Listener::bind_with("127.0.0.1:0".parse()?, udp_config()).await?;
    let addr = listener.local_addr()?;
    let stack = Checksum(Algo::Fnv1a);
    println!("server: negotiating udp echo server on {addr}");
    print_offers("  server", "Checksum(Fnv1a)", &stack);
    let mut l = listen(stack, listener, config());
    // Bounded (every queue is): the tour reads a report for every connection it makes.
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let r = l.accept().await;
            let fatal = matches!(&r, Err(Error::Chunnel(e)) if e.is_closed());
            let report = match &r {
                Ok(c) => Ok(c.info().clone()),
                Err(e) => Err(e.to_string()),
            };
            if tx.send(report).await.is_err() || fatal {
                return;
            }
            if let Ok(conn) = r {
                tokio::spawn(async move {
                    while let Ok(m) = conn.recv_one().await {
                        if conn.send_one(m).await.is_err() {
                            break;
                        }
                    }
                });
            }
        }
    });
    Ok((addr, rx))
}

async fn next_report(rx: &mut mpsc::Receiver<Report>) -> Result<Report> {
    timeout(STEP, rx.recv())
        .await
        .context("the server reported nothing")?
        .context("the server's accept loop ended")
}

async fn base(addr: SocketAddr) -> Result<udp::Connection> {
    Ok(udp::Connect::new(addr)
        .with_config(udp_config())
        .connect_wrap(())
        .await?)
}

/// Sends `m` and waits for it to come back unchanged; returns the round trip.
async fn echo<C: ChunnelConnection<Data = Bytes>>(c: &C, m: &str) -> Result<Duration> {
    let t = Instant::now();
    c.send_one(Bytes::copy_from_slice(m.as_bytes())).await?;
    let r = timeout(STEP, c.recv_one())
        .await
        .context("echo timed out")??;
    let rtt = t.elapsed();
    ensure!(r == m.as_bytes(), "echo garbled: sent {m:?}, got {r:?}");
    Ok(rtt)
}

/// Prints what negotiation decided, as one end sees it (`info()`).
fn print_info(who: &str, info: &Info) {
    // Only the client counts its hellos (the server's count is always 0).
    let hellos = match info.hellos_sent {
        0 => String::new(),
        n => format!(", hellos sent {n}"),
    };
    println!(
        "  {who}: client pick {:?}, server pick {:?}, server stack {}, 0-RTT {:?}{hellos}",
        info.client_pick.branches(),
        info.server_pick.branches(),
        chunnels(&info.server_stack),
        info.zero_rtt
    );
}

/// The negotiation part of the tour.
pub async fn tour() -> Result<()> {
    println!("\n--- negotiation ---------------------------------------------------------");
    let (addr, mut reports) = server().await?;
    let key = addr.to_string(); // the client remembers picks per server under this key

    // Client 1: prefers crc32, can do fnv1a.
    println!("\nclient 1: prefers crc32, falls back to fnv1a");
    let client = Client::new(config());
    let offer1 = select(Checksum(Algo::Crc32), Checksum(Algo::Fnv1a));
    print_offers(
        "  client 1",
        "select(Checksum(Crc32), Checksum(Fnv1a))",
        &offer1,
    );
    let t = Instant::now();
    let conn = timeout(STEP, client.connect(&key, offer1, base(addr).await?))
        .await
        .context("1-RTT connect timed out")??;
    let first_echo = echo(&conn, "hello over the negotiated stack").await?;
    let one_rtt = t.elapsed();
    ensure!(
        conn.info().client_pick.branches() == [1],
        "expected the fallback (fnv1a), got {:?}",
        conn.info().client_pick
    );
    println!("  connected (1-RTT): the server has no crc32, so the shared option fnv1a was picked");
    print_info("client sees", conn.info());
    match next_report(&mut reports).await? {
        Ok(info) => print_info("server sees", &info),
        Err(e) => bail!("the server refused client 1: {e}"),
    }
    let mut rtts = vec![first_echo];
    for i in 1..ECHOES {
        rtts.push(echo(&conn, &format!("ping {i}")).await?);
    }
    println!(
        "  {ECHOES} echoes through Checksum(Fnv1a): round trip median {}, max {}",
        us(median(rtts.clone())),
        us(rtts.iter().copied().max().unwrap_or_default())
    );
    // Every client connection stays open until the end of the tour. The server keeps
    // per-address state for a UDP peer until it idles out (60 s): if a closed client's
    // ephemeral port were handed to a new client, the server would take that client's hello
    // for the old connection's and never answer it.
    let mut open = vec![conn];

    // Client 1 again, 0-RTT: the remembered pick is built at once and the first message
    // rides inside the hello.
    println!("\nclient 1 reconnects with 0-RTT (remembered pick {:?})", {
        client
            .remembered(&key)
            .map(|p| p.branches().to_vec())
            .unwrap_or_default()
    });
    let offer1 = select(Checksum(Algo::Crc32), Checksum(Algo::Fnv1a));
    let early = "hello inside the hello";
    let t = Instant::now();
    let conn = timeout(
        STEP,
        client.connect_0rtt(
            &key,
            offer1,
            base(addr).await?,
            [Bytes::from_static(early.as_bytes())],
        ),
    )
    .await
    .context("0-RTT connect timed out")??;
    let r = timeout(STEP, conn.recv_one())
        .await
        .context("the early message's echo timed out")??;
    let zero_rtt = t.elapsed();
    ensure!(r == early.as_bytes(), "early echo garbled: {r:?}");
    ensure!(
        conn.info().zero_rtt == ZeroRtt::Accepted,
        "0-RTT was not accepted: {:?}",
        conn.info().zero_rtt
    );
    next_report(&mut reports)
        .await?
        .map_err(anyhow::Error::msg)?;
    println!("  0-RTT accepted: the early message was delivered and echoed: {early:?}");
    print_info("client sees", conn.info());
    println!(
        "  connect + first echo: 0-RTT {} vs 1-RTT {} for client 1's first connection \
         (which also paid the server's cold start)",
        us(zero_rtt),
        us(one_rtt)
    );
    open.push(conn);

    // A fairer comparison, over warm connections.
    let (mut one, mut zero) = (Vec::new(), Vec::new());
    for i in 0..ROUNDS {
        let offer = select(Checksum(Algo::Crc32), Checksum(Algo::Fnv1a));
        let t = Instant::now();
        let c = timeout(STEP, client.connect(&key, offer, base(addr).await?))
            .await
            .context("1-RTT connect timed out")??;
        echo(&c, &format!("1rtt {i}")).await?;
        one.push(t.elapsed());
        open.push(c);

        let offer = select(Checksum(Algo::Crc32), Checksum(Algo::Fnv1a));
        let msg = format!("0rtt {i}");
        let t = Instant::now();
        let c = timeout(
            STEP,
            client.connect_0rtt(&key, offer, base(addr).await?, [Bytes::from(msg.clone())]),
        )
        .await
        .context("0-RTT connect timed out")??;
        let r = timeout(STEP, c.recv_one())
            .await
            .context("echo timed out")??;
        zero.push(t.elapsed());
        ensure!(r == msg.as_bytes(), "early echo garbled: {r:?}");
        ensure!(
            c.info().zero_rtt == ZeroRtt::Accepted,
            "0-RTT was not accepted"
        );
        open.push(c);
        for _ in 0..2 {
            next_report(&mut reports)
                .await?
                .map_err(anyhow::Error::msg)?;
        }
    }
    let (one, zero) = (median(one), median(zero));
    println!(
        "  over {ROUNDS} more connections each (warm): median 1-RTT {}, 0-RTT {}",
        us(one),
        us(zero)
    );
    match one.checked_sub(zero) {
        Some(saved) => println!(
            "  0-RTT saves {} per connection: the hello's round trip (an echo's: median {})",
            us(saved),
            us(median(rtts))
        ),
        None => println!("  no saving measured this time (a busy machine)"),
    }

    // Client 2: crc32 only, which the server lacks.
    println!("\nclient 2: crc32 only");
    let client2 = Client::new(config());
    print_offers("  client 2", "Checksum(Crc32)", &Checksum(Algo::Crc32));
    let r = timeout(
        STEP,
        client2.connect(&key, Checksum(Algo::Crc32), base(addr).await?),
    )
    .await
    .context("client 2's connect timed out")?;
    match r {
        Err(e @ Error::Incompatible { .. }) => println!("  client 2 gets: error: {e}"),
        Err(e) => return Err(e).context("client 2 failed, but not as incompatible"),
        Ok(_) => bail!("client 2 connected, but the server has no crc32"),
    }
    // The server reports the same refusal from accept() (skipping any late successes).
    loop {
        match next_report(&mut reports).await? {
            Err(e) => {
                println!("  server accept() gets: error: {e}");
                break;
            }
            Ok(_) => continue,
        }
    }

    // The server keeps serving: the open connection and a new client both work.
    let rtt = echo(&open[1], "still here").await?;
    println!(
        "  server still serves: client 1's open connection echoes in {}",
        us(rtt)
    );
    let client3 = Client::new(config());
    let c = timeout(
        STEP,
        client3.connect(&key, Checksum(Algo::Fnv1a), base(addr).await?),
    )
    .await
    .context("client 3's connect timed out")??;
    let rtt = echo(&c, "new client").await?;
    println!(
        "  and a new client offering Checksum(Fnv1a) connects (to {}) and echoes in {}",
        chunnels(&c.info().server_stack),
        us(rtt)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// An in-memory loopback: what is sent is received.
    #[derive(Debug, Default)]
    struct Loopback(Mutex<VecDeque<Bytes>>);

    impl ChunnelConnection for Loopback {
        type Data = Bytes;

        async fn send<B>(&self, burst: B) -> Result<(), ChunnelError>
        where
            B: IntoIterator<Item = Bytes> + Send,
            B::IntoIter: Send,
        {
            self.0.lock().unwrap().extend(burst);
            Ok(())
        }

        async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, ChunnelError> {
            let mut q = self.0.lock().unwrap();
            if q.is_empty() {
                // Would wait forever: fail instead of hanging the test.
                return Err(ChunnelError::Closed);
            }
            let n = q.len().min(slots.len());
            for (s, m) in slots.iter_mut().zip(q.drain(..n)) {
                *s = Some(m);
            }
            Ok(n)
        }
    }

    async fn recv_all<C: ChunnelConnection<Data = Bytes>>(
        c: &C,
    ) -> Result<Vec<Bytes>, ChunnelError> {
        let mut slots = vec![None; 8];
        let n = c.recv(&mut slots).await?;
        Ok(slots[..n].iter_mut().map(|s| s.take().unwrap()).collect())
    }

    #[test]
    fn known_answers() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(fnv1a(b""), 0x811c_9dc5);
        assert_eq!(fnv1a(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a(b"foobar"), 0xbf9c_f968);
    }

    #[tokio::test]
    async fn round_trip_appends_and_strips_four_bytes() {
        for algo in [Algo::Crc32, Algo::Fnv1a] {
            let conn = Checksum(algo)
                .connect_wrap(Loopback::default())
                .await
                .unwrap();
            let msgs = [
                Bytes::from("hello"),
                Bytes::new(),
                Bytes::from(vec![7u8; 1500]),
            ];
            conn.send(msgs.clone()).await.unwrap();
            {
                let wire = conn.inner.0.lock().unwrap();
                let lens: Vec<_> = wire.iter().map(Bytes::len).collect();
                assert_eq!(lens, [9, 4, 1504], "{algo:?}");
                assert_eq!(&wire[0][..5], b"hello");
                assert_eq!(wire[0][5..], algo.sum(b"hello").to_be_bytes());
            }
            assert_eq!(recv_all(&conn).await.unwrap(), msgs, "{algo:?}");
        }
    }

    #[tokio::test]
    async fn corrupted_message_is_malformed() {
        for algo in [Algo::Crc32, Algo::Fnv1a] {
            let conn = Checksum(algo)
                .connect_wrap(Loopback::default())
                .await
                .unwrap();
            conn.send_one(Bytes::from("hello")).await.unwrap();
            {
                let mut wire = conn.inner.0.lock().unwrap();
                let mut m = wire[0].to_vec();
                m[1] ^= 0x20; // "hEllo"
                wire[0] = m.into();
            }
            let r = conn.recv_one().await;
            assert!(
                matches!(r, Err(ChunnelError::Malformed { .. })),
                "{algo:?}: {r:?}"
            );

            // Shorter than a checksum.
            conn.inner.0.lock().unwrap().push_back(Bytes::from("abc"));
            let r = conn.recv_one().await;
            assert!(
                matches!(r, Err(ChunnelError::Malformed { .. })),
                "{algo:?}: {r:?}"
            );

            // The connection stays usable.
            conn.send_one(Bytes::from("after")).await.unwrap();
            assert_eq!(conn.recv_one().await.unwrap(), "after");
        }
    }

    #[tokio::test]
    async fn good_messages_of_a_corrupted_batch_are_kept_and_the_error_follows() {
        let conn = Checksum(Algo::Crc32)
            .connect_wrap(Loopback::default())
            .await
            .unwrap();
        conn.send([Bytes::from("one"), Bytes::from("two"), Bytes::from("three")])
            .await
            .unwrap();
        {
            let mut wire = conn.inner.0.lock().unwrap();
            let mut m = wire[1].to_vec();
            *m.last_mut().unwrap() ^= 1; // a flipped checksum bit
            wire[1] = m.into();
        }
        assert_eq!(recv_all(&conn).await.unwrap(), ["one", "three"]);
        assert!(matches!(
            recv_all(&conn).await,
            Err(ChunnelError::Malformed { .. })
        ));
    }

    #[tokio::test]
    async fn different_algorithms_do_not_interoperate() {
        // Why the capability is exact-match: a crc32 sender and an fnv1a receiver fail.
        let wire = Arc::new(Loopback::default());
        let tx = Checksum(Algo::Crc32)
            .connect_wrap(Arc::clone(&wire))
            .await
            .unwrap();
        let rx = Checksum(Algo::Fnv1a).connect_wrap(wire).await.unwrap();
        tx.send_one(Bytes::from("hello")).await.unwrap();
        assert!(matches!(
            rx.recv_one().await,
            Err(ChunnelError::Malformed { .. })
        ));
    }

    #[test]
    fn capability_is_exact_and_names_the_algorithm() {
        let c = Checksum(Algo::Crc32).capabilities();
        assert_eq!(c, [Capability::exact("checksum", ["crc32"])]);
        assert!(!c[0].compatible(&Checksum(Algo::Fnv1a).capabilities()[0]));
        assert_eq!(Checksum(Algo::Fnv1a).id(), "demo/checksum/1");
    }
}
