//! The serialization Chunnel over real loopback sockets: typed echo in both formats,
//! negotiation that never pairs two formats, and malformed messages that are reported
//! without losing the connection or the good messages around them.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use chunnel::negotiate::End;
use chunnel::{Chunnel, ChunnelConnection, ChunnelExt, ConnectionExt, Listener, Offers, select};
use chunnel_negotiate::proto::Timing;
use chunnel_negotiate::{Client, Config, Error as NegError, Tagged, listen};
use chunnel_net::udp;
use chunnel_std::serialize::{Bincode, Format, Json, Serialize};
use tokio::sync::mpsc;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// The message type: strings, vectors, options and nested enums.

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Order {
    id: u64,
    customer: String,
    items: Vec<Item>,
    status: Status,
    note: Option<String>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Item {
    sku: String,
    qty: u32,
    tags: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
enum Status {
    Pending,
    Shipped { carrier: String, tracking: Vec<u8> },
    Cancelled(Reason),
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
enum Reason {
    Customer,
    OutOfStock { missing: Vec<String> },
}

fn order(id: u64) -> Order {
    let status = match id % 3 {
        0 => Status::Pending,
        1 => Status::Shipped {
            carrier: "Ünïcode Post ✉".into(),
            tracking: (0..=id as u8).collect(),
        },
        _ => Status::Cancelled(if id.is_multiple_of(2) {
            Reason::Customer
        } else {
            Reason::OutOfStock {
                missing: vec!["sku-1".into(), String::new(), "\"quoted\"\n".into()],
            }
        }),
    };
    Order {
        id: id * 1_000_003,
        customer: format!("customer #{id}"),
        items: (0..id % 4)
            .map(|i| Item {
                sku: format!("sku-{i}"),
                qty: i as u32 * 7,
                tags: vec!["a".into(); i as usize],
            })
            .collect(),
        status,
        note: (id % 2 == 1).then(|| "leave at the door".into()),
    }
}

// ---------------------------------------------------------------------------------------
// Harness.

fn fast() -> Config {
    Config {
        timing: Timing {
            initial_rto: Duration::from_millis(30),
            attempts: 8,
            ..Timing::default()
        },
        hello_timeout: Duration::from_secs(5),
        ..Config::default()
    }
}

async fn base(addr: SocketAddr) -> Result<udp::Connection> {
    Ok(udp::Connect::new(addr).connect_wrap(()).await?)
}

/// Echoes every message back, in bursts as received.
async fn echo_loop<C: ChunnelConnection<Data = Order>>(conn: C) {
    let mut slots = vec![None; 8];
    while let Ok(n) = conn.recv(&mut slots).await {
        let burst: Vec<Order> = slots[..n].iter_mut().filter_map(Option::take).collect();
        if conn.send(burst).await.is_err() {
            return;
        }
    }
}

/// Sends `msgs` as one burst and checks they come back, in order.
async fn check_echo<C: ChunnelConnection<Data = Order>>(c: &C, msgs: Vec<Order>) -> Result<()> {
    c.send(msgs.clone()).await?;
    let mut got = Vec::new();
    while got.len() < msgs.len() {
        got.push(
            timeout(WAIT, c.recv_one())
                .await
                .context("echo timed out")??,
        );
    }
    ensure!(got == msgs, "echo garbled: sent {msgs:?}, got {got:?}");
    Ok(())
}

/// What a negotiating server saw: the server pick of each accepted connection, or its error.
type Seen = mpsc::Receiver<Result<Vec<u8>, NegError>>;

/// A negotiating typed echo server offering `stack` on a fresh loopback UDP port.
async fn negotiating_server<S>(stack: S) -> Result<(SocketAddr, Seen)>
where
    S: Chunnel<Tagged<udp::ServerConnection>> + Offers + Clone + Send + Sync + 'static,
    S::Connection: ChunnelConnection<Data = Order> + 'static,
{
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let mut server = listen(stack, l, fast());
    let (tx, seen) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let r = server.accept().await;
            let fatal = matches!(&r, Err(NegError::Chunnel(e)) if e.is_closed());
            let report = match r {
                Ok(conn) => {
                    let pick = conn.info().server_pick.branches().to_vec();
                    tokio::spawn(echo_loop(conn));
                    Ok(pick)
                }
                Err(e) => Err(e),
            };
            if tx.send(report).await.is_err() || fatal {
                return;
            }
        }
    });
    Ok((addr, seen))
}

async fn next_seen(seen: &mut Seen) -> Result<Result<Vec<u8>, NegError>> {
    timeout(WAIT, seen.recv())
        .await
        .context("the server reported nothing")?
        .context("the server's accept loop ended")
}

/// Checks `e` is an incompatibility over the `serialization` capability, with these labels.
fn check_incompatible(e: &NegError, client: &str, server: &str) -> Result<()> {
    let NegError::Incompatible { mismatches, .. } = e else {
        bail!("not an incompatibility: {e}");
    };
    ensure!(!mismatches.is_empty(), "no mismatch reported: {e}");
    for m in mismatches {
        ensure!(m.kind == "serialization", "wrong capability: {e}");
        ensure!(
            m.client.as_deref() == Some(&[client.to_owned()][..])
                && m.server.as_deref() == Some(&[server.to_owned()][..]),
            "wrong labels: {e}"
        );
    }
    let text = e.to_string();
    ensure!(text.contains("`serialization` differs"), "{text}");
    Ok(())
}

/// Checks `r` failed with a decode error of format `F`.
fn check_decode_error<T: std::fmt::Debug, F: Format>(r: Result<T, chunnel::Error>) -> Result<()> {
    let e = match r {
        Ok(v) => bail!("{} decoded a malformed message as {v:?}", F::NAME),
        Err(e) => e,
    };
    let chunnel::Error::Layer { layer, source } = &e else {
        bail!("not a layer error: {e}");
    };
    ensure!(*layer == "chunnel-std/serialize", "wrong layer: {e}");
    match source.downcast_ref::<chunnel_std::Error>() {
        Some(chunnel_std::Error::Decode { format, .. }) if *format == F::NAME => Ok(()),
        _ => bail!("not a {} decode error: {e}", F::NAME),
    }
}

// ---------------------------------------------------------------------------------------
// (1) Typed echo over UDP loopback.

async fn typed_echo<F: Format>() -> Result<()> {
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let mut server = Serialize::<Order, F>::new().serve(l);
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            tokio::spawn(echo_loop(conn));
        }
    });
    let c = Serialize::<Order, F>::new()
        .connect_wrap(base(addr).await?)
        .await?;
    check_echo(&c, vec![order(0)]).await?;
    check_echo(&c, (1..8).map(order).collect()).await?;
    Ok(())
}

#[tokio::test]
async fn typed_echo_bincode() -> Result<()> {
    typed_echo::<Bincode>().await
}

#[tokio::test]
async fn typed_echo_json() -> Result<()> {
    typed_echo::<Json>().await
}

#[test]
fn the_formats_differ_on_the_wire() -> Result<()> {
    let o = order(5);
    let b = Bincode::to_bytes(&o)?;
    let j = Json::to_bytes(&o)?;
    assert!(b.len() < j.len(), "bincode {} vs json {}", b.len(), j.len());
    assert!(j.starts_with(b"{\"id\":5000015,"), "{j:?}");
    // Not self-describing: JSON bytes are not bincode, and the other way round.
    assert!(Bincode::decode::<Order>(&j).is_err());
    assert!(Json::decode::<Order>(&b).is_err());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// (2) Negotiation never pairs two formats.

#[tokio::test]
async fn bincode_client_and_json_server_are_incompatible_on_both_sides() -> Result<()> {
    let (addr, mut seen) = negotiating_server(Serialize::<Order, _>::json()).await?;
    let client = Client::new(fast());
    let err = match client
        .connect("s", Serialize::<Order, _>::bincode(), base(addr).await?)
        .await
    {
        Ok(_) => bail!("a bincode client connected to a json-only server"),
        Err(e) => e,
    };
    check_incompatible(&err, "bincode", "json")?;
    ensure!(
        matches!(
            err,
            NegError::Incompatible {
                found_by: End::Server,
                ..
            }
        ),
        "{err}"
    );
    let server_side = match next_seen(&mut seen).await? {
        Ok(pick) => bail!("the server accepted (pick {pick:?})"),
        Err(e) => e,
    };
    check_incompatible(&server_side, "bincode", "json")?;

    // The server keeps serving a json client.
    let c = client
        .connect("s", Serialize::<Order, _>::json(), base(addr).await?)
        .await?;
    check_echo(&c, vec![order(1), order(2)]).await?;
    Ok(())
}

#[tokio::test]
async fn client_select_falls_back_to_the_servers_format() -> Result<()> {
    let (addr, mut seen) = negotiating_server(Serialize::<Order, _>::json()).await?;
    let client = Client::new(fast());
    let offer = select(
        Serialize::<Order, _>::bincode(),
        Serialize::<Order, _>::json(),
    );
    let c = client.connect("s", offer, base(addr).await?).await?;
    assert_eq!(c.info().client_pick.branches(), [1], "json is branch 1");
    check_echo(&c, (0..6).map(order).collect()).await?;
    assert_eq!(next_seen(&mut seen).await?.ok(), Some(vec![]));
    Ok(())
}

#[tokio::test]
async fn both_selects_agree_on_the_servers_preference() -> Result<()> {
    // The server prefers json, the client bincode: the server decides, so json.
    let server_offer = select(
        Serialize::<Order, _>::json(),
        Serialize::<Order, _>::bincode(),
    );
    let (addr, mut seen) = negotiating_server(server_offer).await?;
    let client = Client::new(fast());
    let offer = select(
        Serialize::<Order, _>::bincode(),
        Serialize::<Order, _>::json(),
    );
    let c = client.connect("s", offer, base(addr).await?).await?;
    assert_eq!(c.info().client_pick.branches(), [1], "client: json");
    assert_eq!(c.info().server_pick.branches(), [0], "server: json");
    check_echo(&c, (0..6).map(order).collect()).await?;
    assert_eq!(next_seen(&mut seen).await?.ok(), Some(vec![0]));
    Ok(())
}

// ---------------------------------------------------------------------------------------
// (3) Malformed messages from a raw socket.

/// Receives until `want` good messages and `errors` decode errors arrived (a bad message in
/// a batch with good ones is reported by the following `recv`, so the order may vary).
async fn collect<F: Format, C: ChunnelConnection<Data = Order>>(
    c: &C,
    want: usize,
    errors: usize,
) -> Result<Vec<Order>> {
    let (mut got, mut errs) = (Vec::new(), 0);
    while got.len() < want || errs < errors {
        let mut slots = vec![None; 8];
        match timeout(WAIT, c.recv(&mut slots))
            .await
            .with_context(|| format!("got {got:?} and {errs} errors, want {want} and {errors}"))?
        {
            Ok(n) => got.extend(slots[..n].iter_mut().filter_map(Option::take)),
            Err(e) => {
                check_decode_error::<(), F>(Err(e))?;
                errs += 1;
            }
        }
    }
    ensure!(
        got.len() == want && errs == errors,
        "{got:?}, {errs} errors"
    );
    Ok(got)
}

async fn malformed_is_reported<F: Format, G: Format>(garbage: &[u8]) -> Result<()> {
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let mut server = Serialize::<Order, F>::new().serve(l);
    let raw = std::net::UdpSocket::bind("127.0.0.1:0")?;
    raw.connect(addr)?;
    let good = |id| F::to_bytes(&order(id));

    raw.send(&good(1)?)?;
    let conn = timeout(WAIT, server.accept()).await??;
    assert_eq!(timeout(WAIT, conn.recv_one()).await??, order(1));

    // Garbage, a truncated message, one with a trailing byte, and the other format's
    // encoding: each a clear decode error.
    let mut trailing = good(2)?.to_vec();
    trailing.push(b'x');
    let full = good(3)?;
    let bad: [&[u8]; 4] = [
        garbage,
        &full[..full.len() / 2],
        &trailing,
        &G::to_bytes(&order(4))?,
    ];
    for b in bad {
        raw.send(b)?;
        check_decode_error::<_, F>(timeout(WAIT, conn.recv_one()).await?)
            .with_context(|| format!("message {b:?}"))?;
        // The connection keeps working.
        raw.send(&good(5)?)?;
        assert_eq!(timeout(WAIT, conn.recv_one()).await??, order(5));
    }

    // Good and bad back to back (likely one batch): both good ones arrive, in order, and
    // the bad one is reported once.
    raw.send(&good(6)?)?;
    raw.send(garbage)?;
    raw.send(&good(7)?)?;
    assert_eq!(collect::<F, _>(&conn, 2, 1).await?, [order(6), order(7)]);

    // Two bad ones, then good ones: one error per batch that held a bad message (one or
    // two here), never a message, and the good ones in order.
    raw.send(garbage)?;
    raw.send(garbage)?;
    raw.send(&good(8)?)?;
    raw.send(&good(9)?)?;
    let (mut got, mut errs) = (Vec::new(), 0);
    while got.last() != Some(&order(9)) {
        match timeout(WAIT, conn.recv_one()).await? {
            Ok(m) => got.push(m),
            Err(e) => {
                check_decode_error::<(), F>(Err(e))?;
                errs += 1;
            }
        }
    }
    assert_eq!(got, [order(8), order(9)]);
    assert!((1..=2).contains(&errs), "{errs} errors");
    Ok(())
}

#[tokio::test]
async fn malformed_bincode_is_a_decode_error_and_the_connection_survives() -> Result<()> {
    malformed_is_reported::<Bincode, Json>(&[0xff; 40]).await
}

#[tokio::test]
async fn malformed_json_is_a_decode_error_and_the_connection_survives() -> Result<()> {
    malformed_is_reported::<Json, Bincode>(b"{\"id\": 1, \"customer\": \xff garbage").await
}
