//! The reliability Chunnel: [`Reliable`].

use bytes::Bytes;
use chunnel::{Capability, Chunnel, ChunnelConnection, Negotiate};

use super::config::Config;
use super::connection::ReliableConnection;

/// The reliability Chunnel: wraps a best-effort byte connection; see the
/// [module docs](super).
#[derive(Clone, Debug, Default)]
pub struct Reliable {
    cfg: Config,
}

impl Reliable {
    /// A reliable Chunnel with `cfg`.
    pub fn new(cfg: Config) -> Self {
        Reliable { cfg }
    }
}

impl Negotiate for Reliable {
    fn id(&self) -> &'static str {
        "chunnel-std/reliable/1"
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::exact("reliable", ["v1"])]
    }
}

impl<C> Chunnel<C> for Reliable
where
    C: ChunnelConnection<Data = Bytes> + 'static,
{
    type Connection = ReliableConnection<C>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, chunnel::Error> {
        Ok(ReliableConnection::new(inner, self.cfg.clone()))
    }
}
