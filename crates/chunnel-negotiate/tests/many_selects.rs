//! Negotiation at scale over real UDP: a client whose stack has 16 or 64 two-way selects
//! (2^16 and 2^64 concrete stacks) against a server that accepts only the last option of
//! each, 1-RTT and 0-RTT. The hello carries the select structure, so it grows linearly with
//! the number of selects (the figure printed: bytes per select), and the server finds the one
//! compatible stack without enumerating the product.
//!
//! The stacks here are one Chunnel type that describes k selects at run time (its own
//! `Offers`): the negotiation is what is under test, not the compile-time types of a stack of
//! 64 `select`s.

use std::hash::Hasher;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use bytes::Bytes;
use chunnel::negotiate::{ChunnelInfo, PickReader, StackOption};
use chunnel::{
    Capability, Chunnel, ChunnelConnection, ConnectionExt, Error, OfferTree, Offers, Pick,
};
use chunnel_negotiate::proto::Timing;
use chunnel_negotiate::wire::{Hello, VERSION};
use chunnel_negotiate::{Client, Config, listen};
use chunnel_net::udp;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

/// `k` layers, each a select between `layer{i}/fast` (preferred) and `layer{i}/plain`, each
/// with an exact capability `layer{i}` of its own label; with `only_plain`, just the plain
/// layers (no select). A pass-through Chunnel once picked; it records the pick it was given.
#[derive(Clone, Debug)]
struct Selects {
    k: usize,
    only_plain: bool,
    picked: Option<Vec<u8>>,
}

impl Selects {
    fn offering(k: usize) -> Self {
        Selects {
            k,
            only_plain: false,
            picked: None,
        }
    }

    fn plain(k: usize) -> Self {
        Selects {
            k,
            only_plain: true,
            picked: None,
        }
    }

    fn layer(i: usize, label: &'static str) -> OfferTree {
        OfferTree::Leaf(ChunnelInfo {
            id: format!("layer{i}/{label}").into(),
            capabilities: vec![Capability::exact(format!("layer{i}"), [label])],
        })
    }
}

impl Offers for Selects {
    fn offer_tree(&self) -> OfferTree {
        OfferTree::Seq(
            (0..self.k)
                .map(|i| {
                    if self.only_plain {
                        Self::layer(i, "plain")
                    } else {
                        OfferTree::Select(
                            Box::new(Self::layer(i, "fast")),
                            Box::new(Self::layer(i, "plain")),
                        )
                    }
                })
                .collect(),
        )
    }

    /// Exponential in `k`: negotiation never calls it (it uses the tree).
    fn offers(&self) -> Vec<StackOption> {
        assert!(
            self.k <= 12,
            "{} selects have too many options to list",
            self.k
        );
        self.offer_tree().options()
    }

    fn hash_offers(&self, h: &mut dyn Hasher) {
        h.write_usize(self.k);
        h.write_u8(u8::from(self.only_plain));
    }

    fn available(&self) -> Result<(), Error> {
        Ok(())
    }

    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error> {
        let mut d = Vec::new();
        if !self.only_plain {
            for _ in 0..self.k {
                d.push(pick.next_branch()?);
            }
        }
        self.picked = Some(d);
        Ok(())
    }
}

impl<C: ChunnelConnection + Send> Chunnel<C> for Selects {
    type Connection = C;

    async fn connect_wrap(&mut self, inner: C) -> Result<C, Error> {
        // Built only as negotiated: every select on its fallback.
        match &self.picked {
            Some(d) if self.only_plain || d == &vec![1u8; self.k] => Ok(inner),
            other => Err(Error::BadPick {
                what: if other.is_none() {
                    "built without a pick"
                } else {
                    "built with a pick other than every select's fallback"
                },
            }),
        }
    }
}

fn config() -> Config {
    Config {
        timing: Timing {
            initial_rto: Duration::from_millis(50),
            ..Timing::default()
        },
        ..Config::default()
    }
}

async fn echo_server(k: usize) -> Result<SocketAddr> {
    let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let addr = l.local_addr()?;
    let mut server = listen(Selects::plain(k), l, config());
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
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

async fn echo<C: ChunnelConnection<Data = Bytes>>(c: &C, m: &'static str) -> Result<()> {
    c.send_one(Bytes::from(m)).await?;
    let r = timeout(WAIT, c.recv_one())
        .await
        .context("echo timed out")??;
    ensure!(r == m, "echo garbled: sent {m:?}, got {r:?}");
    Ok(())
}

fn hello_len(k: usize) -> usize {
    Hello {
        version: VERSION,
        conn_id: 1,
        offers: Selects::offering(k).offer_tree(),
        zero_rtt: None,
        early: Vec::new(),
        dictated: false,
    }
    .encode()
    .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_and_sixty_four_selects_negotiate_over_udp_1rtt_and_0rtt() -> Result<()> {
    for k in [16usize, 64] {
        let addr = echo_server(k).await?;
        let client = Client::new(config());
        let base = || async { udp::Connect::new(addr).connect_wrap(()).await };
        // 1-RTT.
        let c = timeout(
            WAIT,
            client.connect("s", Selects::offering(k), base().await?),
        )
        .await
        .context("connect in time")??;
        ensure!(c.info().client_pick == Pick::from_slice(&vec![1; k]));
        ensure!(c.info().server_stack.len() == k);
        echo(&c, "1-rtt").await?;
        // 0-RTT: the remembered pick goes with the first message.
        for round in 0..2 {
            let c = timeout(
                WAIT,
                client.connect_0rtt(
                    "s",
                    Selects::offering(k),
                    base().await?,
                    [Bytes::from_static(b"early")],
                ),
            )
            .await
            .context("0-RTT connect in time")??;
            ensure!(
                c.info().zero_rtt == chunnel_negotiate::wire::ZeroRtt::Accepted,
                "{k} selects, round {round}: {:?}",
                c.info().zero_rtt
            );
            let r = timeout(WAIT, c.recv_one()).await.context("early echo")??;
            ensure!(r == "early");
            echo(&c, "after").await?;
        }
    }
    let (h16, h64) = (hello_len(16), hello_len(64));
    let per_select = (h64 - h16) as f64 / 48.0;
    eprintln!("hello: 16 selects {h16} B, 64 selects {h64} B: {per_select:.1} B per select");
    // Linear: each select adds the same bytes (two leaves and a select node).
    assert_eq!((h64 - h16) % 48, 0, "every select costs the same");
    // Two leaves of ~36 bytes (id, kind and label of these names) and a select node.
    assert!(per_select < 100.0, "{per_select} B per select");
    Ok(())
}

/// The hello's size for k selects, against the flattened list of every option (what a hello
/// carried before the tree: 2^k options of k Chunnels each).
#[test]
fn a_hello_grows_linearly_not_with_the_product() {
    let (a, b, c) = (hello_len(100), hello_len(200), hello_len(1000));
    assert_eq!(b - a, (c - b) / 8, "the same bytes per select");
    for k in [4usize, 8, 12] {
        let flat = Hello {
            version: VERSION,
            conn_id: 1,
            offers: OfferTree::Options(Selects::offering(k).offers()),
            zero_rtt: None,
            early: Vec::new(),
            dictated: false,
        }
        .encode()
        .len();
        let tree = hello_len(k);
        eprintln!("{k} selects: tree {tree} B, flattened {flat} B");
        assert!(
            tree < flat,
            "{k} selects: tree {tree} B, flattened {flat} B"
        );
    }
    assert!(hello_len(8) < 1_000, "8 selects in {} B", hello_len(8));
}

/// A client refuses, before sending, a tree past the limits every decoder enforces (513
/// choices); 512 are sent.
#[test]
fn a_client_refuses_a_tree_past_the_decoders_limits() {
    use chunnel_negotiate::proto::ClientHandshake;
    let now = std::time::Instant::now();
    let hs = |k: usize| {
        ClientHandshake::new(
            Selects::offering(k).offer_tree(),
            None,
            1,
            Timing::default(),
            now,
        )
    };
    assert!(hs(512).is_ok());
    let err = hs(513).expect_err("513 choices");
    assert!(err.to_string().contains("too many choices"), "{err}");
}
