//! The tokio socket types the datagram machinery runs on ([`DgramSocket`]): UDP and Unix
//! datagram sockets.

use std::future::Future;
use std::io;
use std::os::fd::AsRawFd;
use std::task::Poll;

use tokio::io::{Interest, Ready};

use crate::sys::{self, DgramAddr};

/// The tokio socket types the datagram machinery runs on.
pub(crate) trait DgramSocket: AsRawFd + Send + Sync + 'static {
    type Addr: DgramAddr;
    /// Waits until the socket is ready for any of `interest`; returns what it is ready for.
    /// (Writability, and a client's read or error; a listener's reader uses
    /// [`DgramSocket::poll_read_ready`].)
    fn ready(&self, interest: Interest) -> impl Future<Output = io::Result<Ready>> + Send;
    fn try_io_with<R>(
        &self,
        interest: Interest,
        f: impl FnOnce() -> io::Result<R>,
    ) -> io::Result<R>;
    /// Takes the pending socket error (`SO_ERROR`).
    fn take_error(&self) -> io::Result<Option<io::Error>>;
    /// Polls for readability, registering `cx` in the socket's one receive-waker slot (the
    /// task of the latest call is the one woken). Only a listener's reader calls it, under
    /// [`Shared::read_register`](super::listener::Shared::read_register).
    fn poll_read_ready(&self, cx: &mut std::task::Context<'_>) -> Poll<io::Result<()>>;

    /// Sends with `f` at once, before asking the runtime whether the socket is writable;
    /// only if the kernel says it is full does `f` run again under the runtime's readiness
    /// protocol ([`DgramSocket::try_io_with`], which then clears the stale readiness).
    ///
    /// A datagram socket's send buffer is almost never full, and the runtime knows nothing
    /// of a fresh socket until its first event: asking it first made every new
    /// connection's first send wait for an event-loop turn (an `epoll_wait` and a task
    /// wake-up) before its first datagram could leave.
    fn try_send_with<R>(&self, mut f: impl FnMut() -> io::Result<R>) -> io::Result<R> {
        match f() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.try_io_with(Interest::WRITABLE, f)
            }
            r => r,
        }
    }
}

impl DgramSocket for tokio::net::UdpSocket {
    type Addr = std::net::SocketAddr;
    async fn ready(&self, interest: Interest) -> io::Result<Ready> {
        tokio::net::UdpSocket::ready(self, interest).await
    }
    fn try_io_with<R>(
        &self,
        interest: Interest,
        f: impl FnOnce() -> io::Result<R>,
    ) -> io::Result<R> {
        self.try_io(interest, f)
    }
    fn take_error(&self) -> io::Result<Option<io::Error>> {
        tokio::net::UdpSocket::take_error(self)
    }
    fn poll_read_ready(&self, cx: &mut std::task::Context<'_>) -> Poll<io::Result<()>> {
        self.poll_recv_ready(cx)
    }
}

impl DgramSocket for tokio::net::UnixDatagram {
    type Addr = sys::UnixAddr;
    async fn ready(&self, interest: Interest) -> io::Result<Ready> {
        tokio::net::UnixDatagram::ready(self, interest).await
    }
    fn try_io_with<R>(
        &self,
        interest: Interest,
        f: impl FnOnce() -> io::Result<R>,
    ) -> io::Result<R> {
        self.try_io(interest, f)
    }
    fn take_error(&self) -> io::Result<Option<io::Error>> {
        tokio::net::UnixDatagram::take_error(self)
    }
    fn poll_read_ready(&self, cx: &mut std::task::Context<'_>) -> Poll<io::Result<()>> {
        self.poll_recv_ready(cx)
    }
}
