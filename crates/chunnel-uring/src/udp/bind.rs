//! The bind config of an io_uring UDP server ([`Bind`]).

use std::net::SocketAddr;

use chunnel::{Error, Negotiate};

use super::Listener;
use crate::config::Config;

/// The bind config of an io_uring UDP server: [`Listen::listen`](chunnel::Listen::listen)
/// binds `addr` ([`Listener::bind_with`]). The server-side counterpart of
/// [`udp::Connect`](crate::udp::Connect): the same id, and the same availability check, so
/// `select(chunnel_uring::udp::Bind, chunnel_net::udp::Bind)` listens on kernel UDP where
/// io_uring cannot run.
#[derive(Clone, Debug)]
pub struct Bind {
    addr: SocketAddr,
    cfg: Config,
}

impl Bind {
    /// Binds `addr` (port 0: the kernel picks one) with the default [`Config`].
    pub fn new(addr: SocketAddr) -> Self {
        Bind {
            addr,
            cfg: Config::default(),
        }
    }

    /// Uses `cfg` instead of the default.
    pub fn with_config(mut self, cfg: Config) -> Self {
        self.cfg = cfg;
        self
    }

    /// The address to bind.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Negotiate for Bind {
    fn id(&self) -> &'static str {
        crate::ID
    }

    /// Where io_uring cannot be used (see [`crate::check_available`]): `NotAvailable`.
    fn check_available(&self) -> Result<(), Error> {
        self.cfg.check()
    }
}

impl chunnel::Listen for Bind {
    type Listener = Listener;

    fn listen(&self) -> impl Future<Output = Result<Listener, Error>> + Send {
        Listener::bind_with(self.addr, self.cfg.clone())
    }
}
