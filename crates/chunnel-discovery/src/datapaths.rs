//! The datapaths of this workspace as registered implementations of the function
//! [`FUNCTION`] (`"datapath"`), for [`crate::Registry::for_hint`].
//!
//! | name | Chunnel in the select | placement | endpoints | scope | priority | needs |
//! |---|---|---|---|---|---|---|
//! | [`SHM`] | chunnel-shm's `LocalFastPath` (feature `shm`) | layer | both | host | 30 | a co-located peer |
//! | [`AF_XDP`] | [`OnBase`] `chunnel/af-xdp-udp/1` (servers only) | base | one | host | 20 | root, an XDP interface |
//! | [`IO_URING`] | [`OnBase`] `chunnel/uring-udp/1` | base | one | process | 10 | io_uring (feature `uring`) |
//! | [`KERNEL_UDP`] | [`OnBase`] `chunnel/udp/1` | base | one | process | 0 | nothing |
//!
//! Shared memory is a layer that moves a negotiated connection onto rings; it needs the
//! peer on the same host with the same `/dev/shm`, which its exact `host-shm` capability
//! lets negotiation decide. The others are the socket the connection is negotiated over
//! (wire-compatible with one another): each end chooses its own, and a pass-through leaf
//! ([`OnBase`]) names it in the select, so the negotiated stack says what each end runs on.
//! The application builds the base the plan names ([`crate::QosPlan::base`]): for
//! `io-uring`, `chunnel_uring::udp::Connect` / `Listener`; for `af-xdp`,
//! `chunnel_xdp::AfXdpUdp` (not a dependency of this crate); for `kernel-udp`,
//! `chunnel_net::udp`.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ChunnelExt, End, Negotiate};

use crate::registry::{Implementation, Placement, Registry};
use crate::{Error, Resource, Scope};

pub use crate::policy::{AF_XDP, FUNCTION, IO_URING, KERNEL_UDP, SHM};

type Check = Arc<dyn Fn() -> Result<(), chunnel::Error> + Send + Sync>;

/// A pass-through leaf naming the base datapath this end runs on: its connection is the
/// inner one, unchanged; its id is the datapath's; it has no capabilities (the peer may run
/// any wire-compatible base); its availability is the datapath's.
#[derive(Clone)]
pub struct OnBase {
    id: &'static str,
    check: Option<Check>,
}

impl fmt::Debug for OnBase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OnBase").field("id", &self.id).finish()
    }
}

impl OnBase {
    /// A leaf with `id`, always available.
    pub fn new(id: &'static str) -> Self {
        OnBase { id, check: None }
    }

    /// A leaf with `id`, available when `check` passes.
    pub fn with_check(
        id: &'static str,
        check: impl Fn() -> Result<(), chunnel::Error> + Send + Sync + 'static,
    ) -> Self {
        OnBase {
            id,
            check: Some(Arc::new(check)),
        }
    }
}

impl Negotiate for OnBase {
    fn id(&self) -> &'static str {
        self.id
    }

    fn check_available(&self) -> Result<(), chunnel::Error> {
        match &self.check {
            Some(c) => c(),
            None => Ok(()),
        }
    }
}

impl<C: ChunnelConnection + Send> Chunnel<C> for OnBase {
    type Connection = C;

    async fn connect_wrap(&mut self, inner: C) -> Result<C, chunnel::Error> {
        Ok(inner)
    }
}

/// Which datapaths to register, and their settings.
///
/// ```
/// use bytes::Bytes;
/// use chunnel::{BoxConnection, End};
/// use chunnel_discovery::{datapaths::Datapaths, Hint, Registry};
/// # fn main() -> Result<(), chunnel_discovery::Error> {
/// let reg = Registry::<BoxConnection<Bytes>, Bytes>::new();
/// Datapaths::new(End::Client).register(&reg)?;
/// let plan = reg.for_hint("datapath", Hint::Frugal)?;
/// assert_eq!(plan.base(), Some("kernel-udp"));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Datapaths {
    end: End,
    #[cfg(feature = "shm")]
    shm: chunnel_shm::Config,
    #[cfg(feature = "uring")]
    uring: chunnel_uring::udp::Config,
    xdp_interface: Option<String>,
}

impl Datapaths {
    /// The datapaths of end `end`, default settings.
    pub fn new(end: End) -> Self {
        Datapaths {
            end,
            #[cfg(feature = "shm")]
            shm: chunnel_shm::Config::default(),
            #[cfg(feature = "uring")]
            uring: chunnel_uring::udp::Config::default(),
            xdp_interface: None,
        }
    }

    /// The shared-memory settings.
    #[cfg(feature = "shm")]
    pub fn with_shm_config(mut self, cfg: chunnel_shm::Config) -> Self {
        self.shm = cfg;
        self
    }

    /// The io_uring settings, whose availability check is the `io-uring` datapath's
    /// (`Config::with_forced_unavailable` makes it report itself unavailable).
    #[cfg(feature = "uring")]
    pub fn with_uring_config(mut self, cfg: chunnel_uring::udp::Config) -> Self {
        self.uring = cfg;
        self
    }

    /// The interface an AF_XDP server would attach to (without one, `af-xdp` is skipped).
    pub fn with_xdp_interface(mut self, interface: impl Into<String>) -> Self {
        self.xdp_interface = Some(interface.into());
        self
    }

    /// Registers [`SHM`] (with feature `shm`), [`AF_XDP`] (servers), [`IO_URING`] and
    /// [`KERNEL_UDP`] in `reg`. Without feature `uring`, `io-uring` is registered but
    /// reported missing ("built without the `uring` feature").
    pub fn register<I>(&self, reg: &Registry<I, Bytes>) -> Result<(), Error>
    where
        I: ChunnelConnection<Data = Bytes> + Send + Sync + 'static,
    {
        #[cfg(feature = "shm")]
        {
            let role = match self.end {
                End::Client => chunnel_shm::Role::Client,
                End::Server => chunnel_shm::Role::Server,
            };
            let cfg = self.shm.clone();
            let dir = cfg.dir.clone();
            reg.register(
                Implementation::new(SHM, FUNCTION, move || {
                    chunnel_shm::LocalFastPath::new(role, cfg.clone()).boxed()
                })
                .with_priority(30)
                .with_scope(Scope::Host)
                .with_endpoints(crate::Endpoints::Both)
                .requires(Resource::CoLocatedPeer { dir }),
            )?;
        }
        if self.end == End::Server {
            let xdp = match &self.xdp_interface {
                Some(i) => Resource::XdpInterface {
                    interface: i.clone(),
                },
                None => Resource::custom("an XDP interface", || {
                    Err("none configured (Datapaths::with_xdp_interface)".into())
                }),
            };
            reg.register(
                Implementation::new(AF_XDP, FUNCTION, || {
                    OnBase::new("chunnel/af-xdp-udp/1").boxed()
                })
                .with_priority(20)
                .with_scope(Scope::Host)
                .with_placement(Placement::Base)
                .requires(Resource::Root)
                .requires(xdp),
            )?;
        }
        reg.register(
            Implementation::new(IO_URING, FUNCTION, self.uring_leaf())
                .with_priority(10)
                .with_placement(Placement::Base)
                .requires(Resource::IoUring),
        )?;
        reg.register(
            Implementation::new(KERNEL_UDP, FUNCTION, || {
                OnBase::new("chunnel/udp/1").boxed()
            })
            .with_placement(Placement::Base),
        )
    }

    /// The base datapath `hint` makes this end run on under `policy` (what
    /// [`crate::QosPlan::base`] will say), before a registry typed on that base's connection
    /// exists; logs nothing. `None` if the hint names no usable base.
    pub fn base_for(
        &self,
        policy: &crate::Policy,
        hint: crate::Hint,
    ) -> Result<Option<String>, Error> {
        let reg = Registry::<chunnel::BoxConnection<Bytes>, Bytes>::new();
        reg.set_policy(policy.clone());
        self.register(&reg)?;
        Ok(reg.plan(FUNCTION, hint, false)?.report().base.clone())
    }

    #[cfg(feature = "uring")]
    fn uring_leaf<I>(&self) -> impl Fn() -> chunnel::BoxChunnel<I, Bytes> + Send + Sync + 'static
    where
        I: ChunnelConnection<Data = Bytes> + Send + Sync + 'static,
    {
        let cfg = self.uring.clone();
        move || {
            let cfg = cfg.clone();
            OnBase::with_check(chunnel_uring::ID, move || {
                let any = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
                chunnel_uring::udp::Connect::new(any)
                    .with_config(cfg.clone())
                    .check_available()
            })
            .boxed()
        }
    }

    #[cfg(not(feature = "uring"))]
    fn uring_leaf<I>(&self) -> impl Fn() -> chunnel::BoxChunnel<I, Bytes> + Send + Sync + 'static
    where
        I: ChunnelConnection<Data = Bytes> + Send + Sync + 'static,
    {
        || OnBase::new("chunnel/uring-udp/1").boxed()
    }
}
