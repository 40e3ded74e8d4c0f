//! The conformance suite (chunnel-test) against every kernel datapath, bare and with a `Noop`
//! layer on both ends, over real loopback sockets.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chunnel::{Error, Noop};
use chunnel_net::{tcp, udp, uds};
use chunnel_test::{Datapath, Layered, run_all};

const IDLE: Option<Duration> = Some(Duration::from_secs(2));

struct Udp;
impl Datapath for Udp {
    type Listener = udp::Listener;
    type Server = udp::ServerConnection;
    type Connect = udp::Connect;
    type Client = udp::Connection;
    fn name(&self) -> String {
        "udp".into()
    }
    fn max_payload(&self) -> usize {
        udp::MAX_PAYLOAD
    }
    async fn bind(&self) -> Result<(Self::Listener, Self::Connect), Error> {
        let cfg = udp::Config::default().with_idle_timeout(IDLE);
        let l = udp::Listener::bind_with("127.0.0.1:0".parse().unwrap(), cfg).await?;
        let addr = l.local_addr()?;
        Ok((l, udp::Connect::new(addr)))
    }
}

struct Tcp;
impl Datapath for Tcp {
    type Listener = tcp::Listener;
    type Server = tcp::Connection;
    type Connect = tcp::Connect;
    type Client = tcp::Connection;
    fn name(&self) -> String {
        "tcp".into()
    }
    fn max_payload(&self) -> usize {
        // Smaller than the default so the test stays quick; the limit logic is the same.
        1 << 20
    }
    async fn bind(&self) -> Result<(Self::Listener, Self::Connect), Error> {
        let cfg = tcp::Config::default().with_max_payload_bytes(self.max_payload());
        let l = tcp::Listener::bind_with("127.0.0.1:0".parse().unwrap(), cfg.clone()).await?;
        let addr = l.local_addr()?;
        Ok((l, tcp::Connect::new(addr).with_config(cfg)))
    }
}

fn unique(kind: &str) -> uds::UnixAddr {
    static N: AtomicU64 = AtomicU64::new(0);
    uds::UnixAddr::Abstract(
        format!(
            "chunnel-conf-{kind}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        )
        .into_bytes(),
    )
}

struct UnixDgram;
impl Datapath for UnixDgram {
    type Listener = uds::DatagramListener;
    type Server = uds::DatagramServerConnection;
    type Connect = uds::DatagramConnect;
    type Client = uds::DatagramConnection;
    fn name(&self) -> String {
        "unix-dgram".into()
    }
    fn max_payload(&self) -> usize {
        uds::MAX_DATAGRAM
    }
    async fn bind(&self) -> Result<(Self::Listener, Self::Connect), Error> {
        let addr = unique("dgram");
        let cfg = udp::Config::default()
            .with_max_payload_bytes(uds::MAX_DATAGRAM)
            .with_idle_timeout(IDLE);
        let l = uds::DatagramListener::bind_with(addr.clone(), cfg.clone()).await?;
        Ok((l, uds::DatagramConnect::new(addr).with_config(cfg)))
    }
}

struct UnixStream;
impl Datapath for UnixStream {
    type Listener = uds::StreamListener;
    type Server = uds::StreamConnection;
    type Connect = uds::StreamConnect;
    type Client = uds::StreamConnection;
    fn name(&self) -> String {
        "unix-stream".into()
    }
    fn max_payload(&self) -> usize {
        1 << 20
    }
    async fn bind(&self) -> Result<(Self::Listener, Self::Connect), Error> {
        // A filesystem path here (abstract names are covered by the datagram case).
        let dir = std::env::temp_dir();
        static N: AtomicU64 = AtomicU64::new(0);
        let path = dir.join(format!(
            "chunnel-conf-{}-{}.sock",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let cfg = uds::StreamConfig::default().with_max_payload_bytes(self.max_payload());
        let l = uds::StreamListener::bind_with(path.clone(), cfg.clone()).await?;
        Ok((l, uds::StreamConnect::new(path).with_config(cfg)))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_conformance() {
    run_all(&Udp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_conformance() {
    run_all(&Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_dgram_conformance() {
    run_all(&UnixDgram).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_stream_conformance() {
    run_all(&UnixStream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noop_layer_conformance() {
    run_all(&Layered {
        datapath: Udp,
        layer: Noop,
    })
    .await;
    run_all(&Layered {
        datapath: Tcp,
        layer: Noop,
    })
    .await;
    run_all(&Layered {
        datapath: UnixDgram,
        layer: Noop,
    })
    .await;
    run_all(&Layered {
        datapath: UnixStream,
        layer: Noop,
    })
    .await;
}
