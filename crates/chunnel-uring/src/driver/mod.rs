//! The io_uring driver behind every socket of this crate: one ring per socket, driven inline by
//! whichever task needs it. This module holds all of the crate's `unsafe` code.
//!
//! * **Receive**: one multishot `RecvMsg` request (`IORING_RECV_MULTISHOT`) draws buffers from
//!   a provided-buffer ring (`IORING_REGISTER_PBUF_RING`) registered once at set-up. Each
//!   datagram posts one completion naming its buffer; the reaper copies the payload into a
//!   compact `BytesMut` block (the one copy on the receive path) and hands the buffer straight
//!   back to the kernel by bumping the buffer ring's tail — no system call, no allocation.
//!   A single multishot request also keeps datagrams in socket order (several one-shot
//!   requests completing on different threads could reorder them).
//! * **Send**: every message of a burst becomes a `SendMsg` entry whose `iovec` points at the
//!   caller's `Bytes` (no copy); the entries are linked (`IOSQE_IO_LINK`) so they go out in
//!   order even when the socket buffer is full, and the whole batch is submitted with one
//!   `io_uring_enter`. The `msghdr`, `iovec`s, address and the `Bytes` live in a preallocated
//!   slot owned by the ring until the completion is reaped, so a cancelled `send` future never
//!   leaves the kernel pointing at freed memory.
//! * **Readiness**: the ring's file descriptor is registered with tokio (`AsyncFd`); it turns
//!   readable when completions are posted. Only the task holding the reader role waits on it
//!   (one task at a time, as in `chunnel_net::datagram`); the others wait for their own
//!   notification, or for the reader role to fall vacant.

mod addr;
mod buf;
mod readiness;
mod ring;
mod rx;

use std::time::Duration;

#[cfg(test)]
pub(crate) use addr::{decode_addr, encode_addr};
pub(crate) use buf::SendPool;
pub use buf::{UringBuf, UringPayload};
pub(crate) use readiness::{Driver, conn_err};
pub(crate) use ring::Inner;
pub(crate) use rx::{ClientRx, Rx, Stats};

pub(crate) use crate::config::MAX_BATCH;

/// `user_data` of the multishot receive.
const RECV_TAG: u64 = u64::MAX;
/// `user_data` of cancellations (set-up probe and teardown).
const CANCEL_TAG: u64 = u64::MAX - 1;
/// The provided-buffer group id (one group per ring).
const BGID: u16 = 0;
/// `struct io_uring_recvmsg_out`, which starts every multishot `RecvMsg` buffer.
const RECVMSG_OUT: usize = 16;
/// Room for a socket address in a receive buffer and a send slot (`sockaddr_in6`).
const NAME_LEN: usize = 28;
/// Header bytes a send slot holds inline (`SendHeader` tags are 1 byte).
const INLINE_HEADER: usize = 32;
/// How long teardown waits for the kernel to give back memory before leaking it instead.
const TEARDOWN_WAIT: Duration = Duration::from_secs(2);

use chunnel::util::lock;
