//! # chunnel-net: kernel datapaths as Chunnels
//!
//! Base Chunnels (`Chunnel<()>`) and listeners for the kernel's sockets, on tokio:
//!
//! | module  | client            | server                 | messages                     |
//! |---------|-------------------|------------------------|------------------------------|
//! | [`udp`] | [`udp::Connect`]  | [`udp::Listener`]      | datagrams, `sendmmsg`/`recvmmsg` |
//! | [`tcp`] | [`tcp::Connect`]  | [`tcp::Listener`]      | 4-byte length-framed stream  |
//! | [`uds`] | [`uds::DatagramConnect`], [`uds::StreamConnect`] | [`uds::DatagramListener`], [`uds::StreamListener`] | both forms |
//!
//! Every connection carries [`bytes::Bytes`] and reports errors as [`chunnel::Error`]:
//! [`AddrInUse`](chunnel::Error::AddrInUse), [`ConnectionRefused`](chunnel::Error::ConnectionRefused),
//! [`MessageTooLarge`](chunnel::Error::MessageTooLarge), [`PeerClosed`](chunnel::Error::PeerClosed),
//! [`AddrFamily`](chunnel::Error::AddrFamily) (a UDP client's chosen local address, see
//! [`udp::Connect::with_local_addr`]).
//! The datapaths have no error cases of their own beyond those, so this crate has no error
//! enum of its own.
//!
//! Datagram listeners demultiplex one socket into a connection per peer; see [`datagram`] for
//! the queues, their bounds and how peer state is freed.
//!
//! ## Copies
//!
//! Kernel sockets keep their copy: they do not implement `chunnel::LendRecv` or
//! `chunnel::LendBuffer`, because there is no datapath memory to lend — the kernel copies each
//! message into its socket buffer on send and out of it on receive. Sending adds no copy in
//! user space (`sendmmsg` iovecs point at the caller's `Bytes`); receiving copies each datagram
//! once more, from the reused `recvmmsg` scratch into a block that hands out `Bytes` (no
//! allocation per message); streams copy frames into one write buffer. The shared-memory
//! (`chunnel-shm`) and io_uring (`chunnel-uring`) datapaths lend their buffers instead.
//!
//! ## Cancel safety
//!
//! `recv` is cancel safe on every connection. A cancelled `send` never tears a frame; on
//! streams its burst may still go out with the next `send`.
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

pub mod datagram;
pub mod framed;
mod sys;
pub mod tcp;
pub mod udp;
pub mod uds;
