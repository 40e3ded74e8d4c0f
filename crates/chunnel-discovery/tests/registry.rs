//! The registry without real datapaths underneath the negotiation layer: ranking, policy,
//! skip reasons, the select's negotiation metadata, hooks, and negotiation between a client
//! and a server (chunnel-negotiate's connect/bind over kernel UDP) built from registries.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use chunnel::{
    BoxConnection, Capability, Chunnel, ChunnelConnection, ChunnelExt, ConnectionExt, Negotiate,
    OfferTree, Offers,
};
use chunnel_discovery::{
    Candidate, Error, Implementation, Policy, Registry, Resource, Scope, Selection, Skip,
};

/// A pass-through layer with an id and an exact capability `impl` {label}: two ends agree on
/// it only if both have the same label.
#[derive(Clone, Debug)]
struct Tag {
    id: &'static str,
    label: &'static str,
    fail: Option<&'static str>,
}

fn tag(id: &'static str, label: &'static str) -> Tag {
    Tag {
        id,
        label,
        fail: None,
    }
}

impl Negotiate for Tag {
    fn id(&self) -> &'static str {
        self.id
    }
    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::exact("impl", [self.label])]
    }
    fn check_available(&self) -> Result<(), chunnel::Error> {
        match self.fail {
            None => Ok(()),
            Some(r) => Err(chunnel::Error::NotAvailable {
                chunnel: self.id,
                reason: r.into(),
            }),
        }
    }
}

impl<C: ChunnelConnection + Send> Chunnel<C> for Tag {
    type Connection = C;
    async fn connect_wrap(&mut self, inner: C) -> Result<C, chunnel::Error> {
        Ok(inner)
    }
}

const NAMES: [&str; 10] = ["i0", "i1", "i2", "i3", "i4", "i5", "i6", "i7", "i8", "i9"];
const IDS: [&str; 10] = [
    "test/i0/1",
    "test/i1/1",
    "test/i2/1",
    "test/i3/1",
    "test/i4/1",
    "test/i5/1",
    "test/i6/1",
    "test/i7/1",
    "test/i8/1",
    "test/i9/1",
];

type Local = BoxConnection<Bytes>;

fn imp<I: ChunnelConnection + Send + 'static>(i: usize) -> Implementation<I, I::Data>
where
    I::Data: Send + 'static,
{
    Implementation::new(NAMES[i], "reliable", move || tag(IDS[i], NAMES[i]).boxed())
}

/// The ids of a chain of selects' leaves, in order; panics on any other shape.
fn chain_ids(t: &OfferTree) -> Vec<String> {
    match t {
        OfferTree::Leaf(c) => vec![c.id.to_string()],
        OfferTree::Select(a, b) => {
            let mut v = chain_ids(a);
            v.extend(chain_ids(b));
            v
        }
        other => panic!("not a chain of selects: {other:?}"),
    }
}

fn ids(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| format!("test/{n}/1")).collect()
}

#[test]
fn many_implementations_rank_by_priority_and_report_skips() -> anyhow::Result<()> {
    let reg = Registry::<Local, Bytes>::new();
    // Ten implementations of one function, registered out of priority order.
    let prio = [5, 90, 40, 70, 10, 60, 20, 80, 30, 50];
    for (i, p) in prio.iter().enumerate() {
        let mut m = imp::<Local>(i).with_priority(*p);
        if i == 3 {
            m = m.requires(Resource::custom("a SmartNIC", || Err("no device".into())));
        }
        reg.register(m)?;
    }
    // One whose Chunnel reports itself unavailable.
    reg.register(
        Implementation::new("broken", "reliable", || {
            Tag {
                id: "test/broken/1",
                label: "broken",
                fail: Some("no hardware"),
            }
            .boxed()
        })
        .with_priority(100),
    )?;
    // Another function's implementation is not a candidate.
    reg.register(Implementation::new("other", "secure", || {
        tag("test/o/1", "o").boxed()
    }))?;
    reg.set_policy(Policy::default().forbid("i7"));

    let sel = reg.select("reliable")?;
    let want = ["i1", "i5", "i9", "i2", "i8", "i6", "i4", "i0"];
    assert_eq!(sel.names(), want);
    // The select negotiates like any select: its offer tree is the chain, in policy order,
    // each implementation's own id and capability preserved.
    assert_eq!(chain_ids(&sel.offer_tree()), ids(&want));
    let offers = sel.offers();
    assert_eq!(offers.len(), 8);
    for (o, name) in offers.iter().zip(want) {
        assert_eq!(o.chunnels.len(), 1);
        assert_eq!(
            o.chunnels[0].capabilities,
            vec![Capability::exact("impl", [name])]
        );
    }
    // Every candidate, in policy order, with why it was skipped.
    let by_name = |n: &str| -> Candidate {
        sel.candidates()
            .iter()
            .find(|c| c.name == n)
            .cloned()
            .unwrap()
    };
    assert!(matches!(
        by_name("broken").outcome,
        Err(Skip::Unavailable { ref reason }) if reason.contains("no hardware")
    ));
    assert_eq!(by_name("i7").outcome, Err(Skip::Forbidden));
    assert_eq!(
        by_name("i3").outcome,
        Err(Skip::MissingResource {
            resource: "a SmartNIC".into(),
            reason: "no device".into()
        })
    );
    assert_eq!(by_name("i1").outcome, Ok(0));
    assert_eq!(by_name("i0").outcome, Ok(7));
    assert_eq!(sel.candidates().len(), 11);
    assert!(sel.candidates().iter().all(|c| c.name != "other"));
    // The pick's decisions name implementations: 1 per one passed over, then 0.
    assert_eq!(sel.picked(&[0]), Some("i1"));
    assert_eq!(sel.picked(&[1, 1, 0]), Some("i9"));
    assert_eq!(sel.picked(&[1; 7]), Some("i0"));
    assert_eq!(sel.picked(&[1, 1]), None);
    Ok(())
}

#[test]
fn policy_changes_at_run_time_reorder_new_selects_only() -> anyhow::Result<()> {
    let reg = Registry::<Local, Bytes>::new();
    reg.register(imp(0).with_priority(1).with_scope(Scope::Process))?;
    reg.register(imp(1).with_priority(2).with_scope(Scope::Network))?;
    reg.register(imp(2).with_priority(3).with_scope(Scope::Host))?;
    let before = reg.select("reliable")?;
    assert_eq!(before.names(), ["i2", "i1", "i0"]);

    reg.set_policy(Policy::default().with_priority("i0", 10));
    assert_eq!(reg.select("reliable")?.names(), ["i0", "i2", "i1"]);
    reg.set_policy(Policy::default().prefer_scopes([Scope::Network, Scope::Process]));
    assert_eq!(reg.select("reliable")?.names(), ["i1", "i0", "i2"]);
    reg.set_policy(Policy::default().forbid("i2").forbid("i1"));
    let only = reg.select("reliable")?;
    assert_eq!(only.names(), ["i0"]);
    assert!(matches!(only.offer_tree(), OfferTree::Leaf(_)));

    // A select built earlier, and its copies, keep the order their peers were offered.
    assert_eq!(
        chain_ids(&before.clone().offer_tree()),
        ids(&["i2", "i1", "i0"])
    );

    reg.set_policy(Policy::default().forbid("i0").forbid("i1").forbid("i2"));
    match reg.select("reliable") {
        Err(Error::NoImplementation {
            function,
            candidates,
        }) => {
            assert_eq!(function, "reliable");
            assert_eq!(candidates.len(), 3);
            assert!(candidates.iter().all(|c| c.outcome == Err(Skip::Forbidden)));
        }
        other => panic!("expected NoImplementation, got {other:?}"),
    }
    assert!(matches!(
        reg.select("nothing"),
        Err(Error::NoImplementation { ref candidates, .. }) if candidates.is_empty()
    ));
    assert!(matches!(
        reg.register(imp(0)),
        Err(Error::Duplicate { ref name }) if name == "i0"
    ));
    // "Both ends" must be visible to negotiation: an exact capability.
    reg.register(imp(5).with_endpoints(chunnel_discovery::Endpoints::Both))?;
    let r = reg.register(
        Implementation::new("plain", "reliable", || chunnel::Noop.boxed())
            .with_endpoints(chunnel_discovery::Endpoints::Both),
    );
    assert!(
        matches!(r, Err(Error::NotBothEnds { ref name }) if name == "plain"),
        "{r:?}"
    );
    Ok(())
}

const WAIT: Duration = Duration::from_secs(10);

type ClientReg = Registry<chunnel_negotiate::Tagged<chunnel_net::udp::Connection>, Bytes>;
type ServerReg = Registry<chunnel_negotiate::Tagged<chunnel_net::udp::ServerConnection>, Bytes>;

/// Serves `sel` (echo) and returns its address; each connection's pick goes to `picks`.
async fn echo_server(
    sel: Selection<chunnel_negotiate::Tagged<chunnel_net::udp::ServerConnection>, Bytes>,
    picks: tokio::sync::mpsc::Sender<Vec<u8>>,
) -> anyhow::Result<std::net::SocketAddr> {
    let mut server = chunnel_negotiate::bind("127.0.0.1:0", sel).await?;
    let addr = server.local_addr();
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            let _ = picks
                .send(conn.info().server_pick.branches().to_vec())
                .await;
            tokio::spawn(async move {
                while let Ok(m) = conn.recv_one().await {
                    if conn.send_one(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negotiation_picks_the_servers_best_implementation_the_client_has() -> anyhow::Result<()> {
    // The server has eight implementations, the client three of them; each carries an exact
    // capability, so only implementations both ends have can be picked.
    let server_reg = ServerReg::new();
    for i in 0..8 {
        server_reg.register(imp(i).with_priority(i as i32))?;
    }
    let server_sel = server_reg.select("reliable")?;
    assert_eq!(
        server_sel.names(),
        ["i7", "i6", "i5", "i4", "i3", "i2", "i1", "i0"]
    );
    let (tx, mut picks) = tokio::sync::mpsc::channel(8);
    let addr = echo_server(server_sel.clone(), tx).await?;

    let client_reg = ClientReg::new();
    for i in [1, 4, 2] {
        client_reg.register(imp(i).with_priority(10 - i as i32))?;
    }
    let client_sel = client_reg.select("reliable")?;
    assert_eq!(client_sel.names(), ["i1", "i2", "i4"]);
    let conn =
        tokio::time::timeout(WAIT, chunnel_negotiate::connect(addr, client_sel.clone())).await??;
    conn.send_one(Bytes::from_static(b"ping")).await?;
    assert_eq!(tokio::time::timeout(WAIT, conn.recv_one()).await??, "ping");
    // The server's preference among what both have: i4.
    assert_eq!(
        client_sel.picked(conn.info().client_pick.branches()),
        Some("i4")
    );
    let server_pick = tokio::time::timeout(WAIT, picks.recv()).await?.unwrap();
    assert_eq!(server_sel.picked(&server_pick), Some("i4"));
    assert_eq!(conn.info().server_stack[0].id, "test/i4/1");

    // The operator forbids i4 at the client: the next select negotiates i2.
    client_reg.set_policy(Policy::default().forbid("i4"));
    let conn2 = tokio::time::timeout(
        WAIT,
        chunnel_negotiate::connect(addr, client_reg.select("reliable")?),
    )
    .await??;
    assert_eq!(conn2.info().server_stack[0].id, "test/i2/1");
    conn2.send_one(Bytes::from_static(b"pong")).await?;
    assert_eq!(tokio::time::timeout(WAIT, conn2.recv_one()).await??, "pong");

    // Nothing in common: negotiation fails, as with any select.
    let lonely = ClientReg::new();
    lonely.register(imp(9))?;
    let r = tokio::time::timeout(
        WAIT,
        chunnel_negotiate::connect(addr, lonely.select("reliable")?),
    )
    .await?;
    assert!(
        matches!(r, Err(chunnel_negotiate::Error::Incompatible { .. })),
        "{r:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_run_on_first_use_and_once_when_the_last_connection_drops() -> anyhow::Result<()> {
    let setups = Arc::new(AtomicUsize::new(0));
    let teardowns = Arc::new(AtomicUsize::new(0));
    let reg = ClientReg::new();
    let (s, t) = (Arc::clone(&setups), Arc::clone(&teardowns));
    reg.register(
        imp(0)
            .on_setup(move || {
                s.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .on_teardown(move || {
                t.fetch_add(1, Ordering::SeqCst);
            }),
    )?;
    let server_reg = ServerReg::new();
    server_reg.register(imp(0))?;
    let (tx, _picks) = tokio::sync::mpsc::channel(16);
    let addr = echo_server(server_reg.select("reliable")?, tx).await?;

    let mut conns = Vec::new();
    for _ in 0..3 {
        let c = tokio::time::timeout(
            WAIT,
            chunnel_negotiate::connect(addr, reg.select("reliable")?),
        )
        .await??;
        c.send_one(Bytes::from_static(b"x")).await?;
        assert_eq!(tokio::time::timeout(WAIT, c.recv_one()).await??, "x");
        conns.push(c);
    }
    assert_eq!(
        setups.load(Ordering::SeqCst),
        1,
        "set-up runs on first use only"
    );
    assert_eq!(reg.usage("i0").unwrap().live, 3);
    conns.pop();
    conns.pop();
    assert_eq!(
        teardowns.load(Ordering::SeqCst),
        0,
        "two connections dropped, one is live"
    );
    conns.pop();
    assert_eq!(
        teardowns.load(Ordering::SeqCst),
        1,
        "the last connection dropped"
    );
    let u = reg.usage("i0").unwrap();
    assert_eq!((u.live, u.setups, u.teardowns), (0, 1, 1));

    // Used again: set up again, torn down again, exactly once each.
    let c = tokio::time::timeout(
        WAIT,
        chunnel_negotiate::connect(addr, reg.select("reliable")?),
    )
    .await??;
    assert_eq!(setups.load(Ordering::SeqCst), 2);
    drop(c);
    assert_eq!(teardowns.load(Ordering::SeqCst), 2);
    assert_eq!(reg.usage("i0").unwrap().teardowns, 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_setup_fails_the_connection() -> anyhow::Result<()> {
    let reg = Registry::<chunnel_net::udp::Connection, Bytes>::new();
    let torn = Arc::new(AtomicUsize::new(0));
    let t = Arc::clone(&torn);
    reg.register(
        imp(0)
            .on_setup(|| Err("ethtool failed".into()))
            .on_teardown(move || {
                t.fetch_add(1, Ordering::SeqCst);
            }),
    )?;
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    let base = chunnel_net::udp::Connect::new(sock.local_addr()?)
        .connect_wrap(())
        .await?;
    let mut sel = reg.select("reliable")?;
    match sel.connect_wrap(base).await {
        Err(chunnel::Error::Layer { layer, source }) => {
            assert_eq!(layer, "chunnel/discovery");
            let e = source.downcast::<Error>().expect("a discovery error");
            assert!(
                matches!(*e, Error::Setup { ref name, ref reason } if name == "i0" && reason == "ethtool failed")
            );
        }
        other => panic!("expected a set-up failure, got {:?}", other.map(|_| ())),
    }
    let u = reg.usage("i0").unwrap();
    assert_eq!((u.live, u.setups, u.teardowns), (0, 0, 0));
    assert_eq!(
        torn.load(Ordering::SeqCst),
        0,
        "nothing was set up, nothing torn down"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_copies_share_the_hooks_of_their_implementation() -> anyhow::Result<()> {
    // The server copies its stack for every connection; the copies count as one
    // implementation: one set-up for two live connections, one tear-down after both end.
    let setups = Arc::new(AtomicUsize::new(0));
    let teardowns = Arc::new(AtomicUsize::new(0));
    let server_reg = ServerReg::new();
    let (s, t) = (Arc::clone(&setups), Arc::clone(&teardowns));
    server_reg.register(
        imp(0)
            .on_setup(move || {
                s.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .on_teardown(move || {
                t.fetch_add(1, Ordering::SeqCst);
            }),
    )?;
    let (tx, _picks) = tokio::sync::mpsc::channel(16);
    let addr = echo_server(server_reg.select("reliable")?, tx).await?;
    let client_reg = ClientReg::new();
    client_reg.register(imp(0))?;
    let mut conns = Vec::new();
    for _ in 0..2 {
        let c = tokio::time::timeout(
            WAIT,
            chunnel_negotiate::connect(addr, client_reg.select("reliable")?),
        )
        .await??;
        c.send_one(Bytes::from_static(b"x")).await?;
        assert_eq!(tokio::time::timeout(WAIT, c.recv_one()).await??, "x");
        conns.push(c);
    }
    assert_eq!(server_reg.usage("i0").unwrap().live, 2);
    assert_eq!(setups.load(Ordering::SeqCst), 1);
    // Each client closes; the server's echo task sees the end and drops its connection.
    conns.pop().unwrap().close().await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    while server_reg.usage("i0").unwrap().live != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "server connection not dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(teardowns.load(Ordering::SeqCst), 0);
    conns.pop().unwrap().close().await?;
    while server_reg.usage("i0").unwrap().live != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "server connection not dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(teardowns.load(Ordering::SeqCst), 1);
    assert_eq!(setups.load(Ordering::SeqCst), 1);
    Ok(())
}
