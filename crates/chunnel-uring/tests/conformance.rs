//! The conformance suite (chunnel-test) against the io_uring UDP datapath, bare and with a
//! `Noop` layer on both ends, over real loopback sockets.

use std::time::Duration;

use chunnel::{Error, Noop};
use chunnel_test::{Datapath, Layered, run_all};
use chunnel_uring::udp;

const IDLE: Option<Duration> = Some(Duration::from_secs(2));

struct Uring;
impl Datapath for Uring {
    type Listener = udp::Listener;
    type Server = udp::ServerConnection;
    type Connect = udp::Connect;
    type Client = udp::Connection;
    fn name(&self) -> String {
        "uring-udp".into()
    }
    fn max_payload(&self) -> usize {
        udp::MAX_PAYLOAD
    }
    async fn bind(&self) -> Result<(Self::Listener, Self::Connect), Error> {
        let cfg = udp::Config::default().with_datagram(|d| d.with_idle_timeout(IDLE));
        let l = udp::Listener::bind_with("127.0.0.1:0".parse().unwrap(), cfg.clone()).await?;
        let addr = l.local_addr()?;
        Ok((l, udp::Connect::new(addr).with_config(cfg)))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uring_conformance() {
    run_all(&Uring).await;
}

#[tokio::test(flavor = "current_thread")]
async fn uring_conformance_current_thread() {
    run_all(&Uring).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noop_layer_conformance() {
    run_all(&Layered {
        datapath: Uring,
        layer: Noop,
    })
    .await;
}
