//! Keeps `docs/chunnels.md`'s table of every shipped Chunnel true: its id, what kind of Chunnel
//! it is, and the capabilities it offers in negotiation, rendered from the real Chunnels.
//!
//! The table sits between `<!-- chunnel-table -->` and `<!-- /chunnel-table -->`; with
//! `CHUNNEL_TABLE_WRITE=1` the test writes it instead of checking it.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use chunnel::{Capability, Match, Negotiate, Noop};
use chunnel_net::{tcp, udp, uds};
use chunnel_std::ordered::Ordered;
use chunnel_std::reliable::Reliable;
use chunnel_std::serialize::Serialize;
use chunnel_std::shard;

const DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/chunnels.md");
const BEGIN: &str = "<!-- chunnel-table -->";
const END: &str = "<!-- /chunnel-table -->";

fn caps(list: &[Capability], host_specific: &[&str]) -> String {
    if list.is_empty() {
        return "—".into();
    }
    list.iter()
        .map(|c| {
            let how = match c.matching {
                Match::Exact => "exact",
                Match::Compositional => "compositional",
            };
            let labels = if host_specific.contains(&c.kind.as_ref()) {
                "&lt;per host&gt;".to_string()
            } else {
                c.labels.join(", ")
            };
            format!("`{}` {how} {{{labels}}}", c.kind)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn row(c: &dyn Negotiate, crate_name: &str, kind: &str, host_specific: &[&str]) -> String {
    let mut list = c.capabilities();
    if list.is_empty() && host_specific.contains(&chunnel_shm::CAPABILITY) {
        // Where shared memory cannot run the Chunnel offers nothing; the table shows what it
        // offers where it can.
        list = vec![Capability::exact(chunnel_shm::CAPABILITY, ["host"])];
    }
    format!(
        "| `{}` | {crate_name} | {kind} | {} |",
        c.id(),
        caps(&list, host_specific)
    )
}

/// A TLS client Chunnel (its trust roots do not matter for the table).
fn client_config() -> chunnel_secure::ClientConfig {
    use chunnel_secure::rustls;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3 with ring")
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    chunnel_secure::ClientConfig::from_rustls(std::sync::Arc::new(cfg), "localhost")
        .expect("a valid server name")
}

fn table() -> String {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 9));
    let v4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9);
    let shm =
        chunnel_shm::LocalFastPath::new(chunnel_shm::Role::Client, chunnel_shm::Config::default());
    let rows = [
        row(
            &udp::Connect::new(addr),
            "chunnel-net",
            "datapath: kernel UDP",
            &[],
        ),
        row(
            &tcp::Connect::new(addr),
            "chunnel-net",
            "datapath: kernel TCP (length-framed)",
            &[],
        ),
        row(
            &chunnel_secure::tls::Connect::new(addr, client_config()),
            "chunnel-secure",
            "datapath: TLS 1.3 over TCP (length-framed, rustls)",
            &[],
        ),
        row(
            &chunnel_secure::quic::Connect::new(
                addr,
                client_config(),
                chunnel_secure::quic::Mode::Stream,
            ),
            "chunnel-secure",
            "datapath: QUIC, messages on one stream (length-framed, quinn)",
            &[],
        ),
        row(
            &chunnel_secure::quic::Connect::new(
                addr,
                client_config(),
                chunnel_secure::quic::Mode::Datagram,
            ),
            "chunnel-secure",
            "datapath: QUIC, a message per DATAGRAM frame (quinn)",
            &[],
        ),
        row(
            &uds::DatagramConnect::new(uds::UnixAddr::Abstract(b"x".to_vec())),
            "chunnel-net",
            "datapath: Unix datagram",
            &[],
        ),
        row(
            &uds::StreamConnect::new(uds::UnixAddr::Abstract(b"x".to_vec())),
            "chunnel-net",
            "datapath: Unix stream (length-framed)",
            &[],
        ),
        row(
            &chunnel_uring::udp::Connect::new(addr),
            "chunnel-uring",
            "datapath: UDP through io_uring (same wire as kernel UDP)",
            &[],
        ),
        row(
            &chunnel_xdp::AfXdpUdp::new(chunnel_xdp::Config::new("veth0", v4)),
            "chunnel-xdp",
            "datapath: UDP through AF_XDP (client and server; same wire as kernel UDP)",
            &[],
        ),
        row(
            &shm,
            "chunnel-shm",
            "datapath: shared memory (co-located peers)",
            &["host-shm"],
        ),
        row(
            &chunnel_pubsub::Offer {
                broker: "kafka",
                ordering: chunnel_pubsub::Ordering::PerKey,
                delivery: chunnel_pubsub::Delivery::AtLeastOnce,
            },
            "chunnel-pubsub",
            "datapath: pub/sub over Kafka (feature `kafka`; ordering `total` with one partition)",
            &[],
        ),
        row(
            &chunnel_pubsub::Offer {
                broker: "nats",
                ordering: chunnel_pubsub::Ordering::None,
                delivery: chunnel_pubsub::Delivery::AtLeastOnce,
            },
            "chunnel-pubsub",
            "datapath: pub/sub over NATS JetStream (feature `nats`)",
            &[],
        ),
        row(
            &chunnel_pubsub::Offer {
                broker: "redis",
                ordering: chunnel_pubsub::Ordering::None,
                delivery: chunnel_pubsub::Delivery::AtLeastOnce,
            },
            "chunnel-pubsub",
            "datapath: pub/sub over Redis Streams (feature `redis`)",
            &[],
        ),
        row(
            &chunnel_pubsub::order::OrderOffer {
                mode: chunnel_pubsub::order::Mode::Service,
                lanes: 4,
            },
            "chunnel-pubsub",
            "transform: ordering by the broker (one lane; a group's select, with 4 lanes here)",
            &[],
        ),
        row(
            &chunnel_pubsub::order::OrderOffer {
                mode: chunnel_pubsub::order::Mode::Receiver,
                lanes: 4,
            },
            "chunnel-pubsub",
            "transform: ordering at each receiver (sequence numbers over 4 lanes)",
            &[],
        ),
        row(
            &Noop,
            "chunnel",
            "transform: pass-through (measures composition)",
            &[],
        ),
        row(
            &Serialize::<u32, _>::bincode(),
            "chunnel-std",
            "transform: serialization (bincode)",
            &[],
        ),
        row(
            &Serialize::<u32, _>::json(),
            "chunnel-std",
            "transform: serialization (JSON)",
            &[],
        ),
        row(
            &Reliable::default(),
            "chunnel-std",
            "transform: retransmission, exactly once",
            &[],
        ),
        row(
            &Ordered::default(),
            "chunnel-std",
            "transform: in-order delivery",
            &[],
        ),
        row(
            &shard::ViaCanonical::new(),
            "chunnel-std",
            "routing: client of server-side sharding",
            &[],
        ),
        row(
            &shard::ClientShard::new((), ()),
            "chunnel-std",
            "routing: client-push sharding",
            &[],
        ),
        row(
            &shard::Balance::<Noop>::new(Vec::new()),
            "chunnel-std",
            "routing: load balancing over replicas",
            &[],
        ),
    ];
    let mut out = String::from(
        "| id | crate | kind | capabilities (kind, matching, labels) |\n|---|---|---|---|\n",
    );
    for r in rows {
        out.push_str(&r);
        out.push('\n');
    }
    out
}

#[test]
fn the_chunnel_table_is_the_real_one() {
    let doc = std::fs::read_to_string(DOC).expect("docs/chunnels.md");
    let (Some(b), Some(e)) = (doc.find(BEGIN), doc.find(END)) else {
        panic!("docs/chunnels.md lacks the {BEGIN} … {END} markers");
    };
    let start = b + BEGIN.len() + 1;
    let want = table();
    if std::env::var_os("CHUNNEL_TABLE_WRITE").is_some() {
        let new = format!("{}{want}{}", &doc[..start], &doc[e..]);
        std::fs::write(DOC, new).expect("write docs/chunnels.md");
        return;
    }
    assert_eq!(
        &doc[start..e],
        want,
        "docs/chunnels.md is stale: run CHUNNEL_TABLE_WRITE=1 cargo test -p chunnel-bench --test chunnel_table"
    );
}
