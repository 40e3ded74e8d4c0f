//! # chunnel-uring: an io_uring UDP datapath
//!
//! A drop-in alternative to the kernel UDP datapath of `chunnel-net` (`chunnel_net::udp`):
//! the same client Chunnel / listener shapes, the same [`chunnel::Error`] cases, and the same
//! wire (one message per UDP datagram, no header), so an io_uring client talks to a kernel
//! UDP server and vice versa.
//!
//! ```text
//!   application
//!      │ send(burst) / recv(&mut slots)            ChunnelConnection<Data = Bytes>
//!   udp::Connection / udp::ServerConnection
//!      │ SendMsg entries (linked, one io_uring_enter per batch)
//!      │ one multishot RecvMsg + a registered provided-buffer ring
//!   io_uring (one ring per socket) ──ring fd readable──▶ tokio (AsyncFd)
//!      │
//!   kernel UDP socket
//! ```
//!
//! ```
//! use chunnel::{Chunnel, ConnectionExt, Listener as _};
//! use chunnel_uring::udp;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! # // Where io_uring cannot run (see below), this example has nothing to show.
//! # if chunnel_uring::check_available().is_err() { return Ok(()); }
//! let mut listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap()).await?;
//! let addr = listener.local_addr()?;
//! let client = udp::Connect::new(addr).connect_wrap(()).await?;
//! client.send_one("hello".into()).await?;
//! let server = listener.accept().await?;
//! assert_eq!(server.recv_one().await?, "hello");
//! # Ok(()) }
//! ```
//!
//! Preferring io_uring and falling back to kernel sockets where it cannot be set up (old
//! kernels, `kernel.io_uring_disabled`, seccomp filters in containers), on either side:
//!
//! ```
//! use chunnel::{Chunnel, ConnectionExt, Listen, Listener as _, select};
//! use chunnel_net::udp as kernel;
//! use chunnel_uring::udp as uring;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
//! // Either::Left (io_uring) or Either::Right (kernel UDP).
//! let mut server = select(uring::Bind::new(any), kernel::Bind::new(any)).listen().await?;
//! let addr = match &server {
//!     chunnel::Either::Left(l) => l.local_addr()?,
//!     chunnel::Either::Right(l) => l.local_addr()?,
//! };
//! let mut c = select(uring::Connect::new(addr), kernel::Connect::new(addr));
//! let conn = c.connect_wrap(()).await?;
//! conn.send_one("hello".into()).await?; // the same wire either way
//! assert_eq!(server.accept().await?.recv_one().await?, "hello");
//! # Ok(()) }
//! ```
//!
//! ## Design
//!
//! * **The `io-uring` crate directly**, not tokio-uring: tokio-uring runs its own
//!   single-threaded runtime (`tokio_uring::start`) and its sockets are `!Send`, while a
//!   `ChunnelConnection` is `Send + Sync` and must work on any tokio runtime beside the other
//!   datapaths. Monoio and compio are runtimes of their own too. Using the raw crate also
//!   gives control over what matters here: a registered provided-buffer ring, multishot
//!   receive, linked send chains.
//! * **One ring per socket, driven inline**: no extra thread. Whichever task needs data (a
//!   `recv`, `accept`, or a `send` waiting for its completion) reaps the completion queue
//!   under the socket's lock. A client keeps what it reaps in one bounded queue; a listener
//!   is `chunnel_net::datagram`'s listener on a [`udp::RingIo`], which hands it the reaped
//!   datagrams as a batch and sorts them into its per-peer queues (peer table, backlog, peer
//!   cap, idle sweep and which task reads are chunnel-net's, as for kernel UDP). The ring's
//!   descriptor is registered with tokio's reactor (`AsyncFd`) and turns readable when
//!   completions are posted; only one task waits on it at a time (the one holding the reader
//!   role). A dedicated ring thread handing
//!   completions to tasks through channels would add a cross-thread wake-up (two context
//!   switches) to every message.
//! * **Receive**: one multishot `RecvMsg` and a registered buffer ring of
//!   [`udp::Config::recv_buffers`] buffers of `max_payload` (+ 44) bytes, never zeroed.
//!   Each payload is **copied once** from the kernel's buffer into a compact block that hands
//!   out `Bytes` (reclaimed in place when the application has dropped them), and the buffer is
//!   returned to the kernel at once by bumping the ring's tail (no system call). This is the
//!   same single copy the kernel datapath makes; steady-state receiving allocates nothing.
//! * **Send**: no copy. Each message's `iovec` points at the caller's `Bytes`, which the
//!   ring keeps in a preallocated slot until the completion is reaped (so a cancelled `send`
//!   never leaves the kernel reading freed memory). A burst of up to `batch` ([`udp::Config::datagram`])
//!   messages is one `io_uring_enter`; the entries are linked so they leave in order even when
//!   the socket buffer is full, and (like `sendmmsg`) the first failure stops the rest.
//! * **Lent buffers** (client [`udp::Connection`]): `chunnel::LendRecv::recv_lent` hands out
//!   the kernel's provided receive buffer itself as a [`UringPayload`] (no copy), given back
//!   to the buffer ring when dropped (any thread; the next reap publishes it); while half the
//!   buffers are lent, further datagrams are copied instead, so the kernel always has buffers
//!   and the connection never stalls. `chunnel::LendBuffer::lend` gives a [`UringBuf`] from a
//!   pool of [`udp::Config::send_buffers`] blocks (allocated on first use) that
//!   `chunnel::Emit::emit` sends from directly, free again once its send completed; `None`
//!   when all are out. Both counted (`chunnel::LendStats`). The kernel still copies a UDP
//!   datagram into and out of its socket buffers (no `SEND_ZC` here); what lending removes is
//!   the datapath's copy and the application's allocation. A listener's connections do not
//!   lend (chunnel-net's datagram listener queues `Bytes` per peer).
//! * **Threads**: io_uring completes socket I/O in the context of the thread that submitted
//!   the request (task work). On a current-thread tokio runtime (or with
//!   [`udp::Config::single_thread`] set) the ring is created disabled and bound, on first use,
//!   to the thread that runs it (`SINGLE_ISSUER` + `DEFER_TASKRUN`): a datagram's arrival then
//!   only signals an eventfd that tokio waits on, and the next reap runs the receive with one
//!   `io_uring_enter`. Otherwise (a multi-thread runtime) any thread may submit, and the
//!   kernel interrupts the submitting thread's `epoll_wait` to run the task work; a multishot
//!   receive that ends because its thread exited (`ECANCELED`) is re-armed by the next reap.
//!   A single-thread ring used from another thread fails with an error saying so (and, if
//!   dropped there, leaks its buffers rather than free memory the kernel may hold).
//!
//! ## Where the time goes
//!
//! On the 2-vCPU VM this was built on, a loopback round trip is dominated by the two
//! cross-core wake-ups. Compared with a raw io_uring echo that blocks in `io_uring_enter`
//! (`chunnel-bench uring`), the library adds per receive: the wake-up through tokio's
//! `epoll_wait` (an eventfd on a single-thread ring; on a shared ring, an interrupted
//! `epoll_wait` and a second one), one more `io_uring_enter` (to run the deferred receive),
//! the tokio task wake-up, the lock and the copy. Linking the sends of a burst (for order)
//! serialises them in the kernel, which costs burst throughput against unlinked entries or
//! `sendmmsg`. The example `pingpong` isolates these costs.
//!
//! ## Availability
//!
//! [`udp::Connect`] implements [`chunnel::Negotiate`] with the id `"chunnel/uring-udp/1"`
//! and no capabilities (it is wire-compatible with kernel UDP, so either end may use it
//! alone). `check_available()` fails with [`chunnel::Error::NotAvailable`] when io_uring
//! cannot be used here; the reason says why (e.g. `io_uring_setup` returned `EPERM` or
//! `ENOSYS`). The check sets up a small ring and receives one datagram through a multishot
//! `RecvMsg` on a loopback socket, once per process (cached).
//!
//! Forcing unavailability (to test a fallback):
//!
//! * per Chunnel: [`udp::Config::with_forced_unavailable`];
//! * per process: the environment variable [`DISABLE_ENV`] (`CHUNNEL_URING_DISABLE`) set to
//!   anything but `0` or the empty string.
//!
//! ## Errors
//!
//! Every connection reports [`chunnel::Error`]; this crate has no error cases of its own
//! (same decision as `chunnel-net`: one taxonomy across datapaths, so `Select` and the
//! conformance suite match on variants).
//!
//! ## Cancel safety
//!
//! `recv` and `accept` are cancel safe: reaped datagrams wait in the connection's queue. A
//! cancelled `send` may have sent part of its burst; its in-flight messages stay owned by the
//! ring until the kernel is done with them.
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

use std::sync::OnceLock;

use chunnel::Error;

mod config;
mod driver;
mod probe;
pub mod udp;

pub use crate::driver::{UringBuf, UringPayload};

/// The stable negotiation id of this datapath.
pub const ID: &str = "chunnel/uring-udp/1";

/// Environment variable that, set to anything but `0` or the empty string, makes this datapath
/// report itself unavailable in every process that sees it.
pub const DISABLE_ENV: &str = "CHUNNEL_URING_DISABLE";

pub(crate) fn not_available(reason: impl Into<String>) -> Error {
    Error::NotAvailable {
        chunnel: ID,
        reason: reason.into(),
    }
}

/// Whether io_uring can carry UDP on this host: `Ok(())`, or
/// [`chunnel::Error::NotAvailable`] with the reason. Honours [`DISABLE_ENV`]; the probe
/// itself runs once per process.
pub fn check_available() -> Result<(), Error> {
    if let Some(v) = std::env::var_os(DISABLE_ENV)
        && !v.is_empty()
        && v != "0"
    {
        return Err(not_available(format!(
            "disabled by the environment ({DISABLE_ENV}={})",
            v.to_string_lossy()
        )));
    }
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE.get_or_init(probe::run).clone().map_err(not_available)
}
