//! Acknowledged delivery over a best-effort datagram connection.
//!
//! [`Reliable`] is a Chunnel over any byte connection (`Data = Bytes`) that may lose,
//! duplicate or reorder messages (UDP). Its connection delivers every message sent **exactly
//! once**, as long as the peer stays reachable; the delivery *order* may differ from the send
//! order (put [`crate::ordered::Ordered`] on top for in-order delivery).
//!
//! * Every message carries a sequence number. The receiver acknowledges with a cumulative
//!   ack (every sequence number below it arrived) plus up to [`MAX_SACK`] selective ranges
//!   above it. Acks ride on data frames going the other way, or go alone.
//! * The sender keeps at most [`Config::window`] unacknowledged messages; `send` waits while
//!   the window is full (backpressure: nothing is queued without bound).
//! * Retransmission: a message unacknowledged for one retransmission timeout (RTO) is sent
//!   again. The RTO follows RFC 6298 (SRTT/RTTVAR from RTT samples, `RTO = SRTT +
//!   max(G, 4·RTTVAR)`, clamped to [`Config::min_rto`]..[`Config::max_rto`], doubled on each
//!   expiry until a fresh sample arrives), with Karn's rule: retransmitted messages give no
//!   samples. A message with [`Config::dupthresh`] later messages selectively acked is
//!   retransmitted at once (fast retransmit), once.
//! * The receiver suppresses duplicates (a sequence number below the cumulative ack or
//!   already seen), remembers at most [`Config::recv_window`] sequence numbers above the
//!   cumulative ack, and buffers at most [`Config::recv_buffer`] messages the application has
//!   not received yet. A data message that does not fit is dropped *unacknowledged* and comes
//!   again later.
//! * After [`Config::max_timeouts`] consecutive timeouts with no ack at all from the peer, the
//!   connection fails with [`chunnel::Error::PeerClosed`](::chunnel::Error::PeerClosed).
//!
//! # Wire format (version 1)
//!
//! ```text
//! offset  size  field
//! 0       1     version = 0x01
//! 1       1     flags: 0x01 DATA, 0x02 ACK (at least one set; other bits must be zero)
//!               if DATA:
//! +0      8     seq (u64, big endian)
//!               if ACK:
//! +0      8     cumulative (u64 BE): every seq < cumulative was received
//! +8      1     n: number of selective ranges (0..=16)
//! +9      8·n   ranges: start (u32 BE), len (u32 BE): seqs cumulative+start ..
//!               cumulative+start+len were received; start >= 1, len >= 1, ascending, with a
//!               gap of at least one seq between ranges (so an ack has one encoding)
//! rest          payload (DATA frames); an ACK-only frame has no payload
//! ```
//!
//! Decoders ([`decode_frame`], [`Machine::handle_frame`]) return
//! [`crate::Error::Header`] on malformed input and never panic.
//!
//! # Timers and tasks
//!
//! The protocol is a sans-IO state machine, [`Machine`]: frames and time in; frames to send
//! ([`Machine::poll_transmit`]), the next timer deadline ([`Machine::poll_timeout`]) and
//! delivered messages ([`Machine::poll_deliver`]) out. [`ReliableConnection`] drives it with
//! **one background task per connection** (spawned on the current tokio runtime by
//! `connect_wrap`, aborted when the connection is dropped): the task is the only reader of
//! the inner connection; it feeds received frames to the machine, fires the retransmission
//! timer, and sends acks and retransmissions. So retransmission happens even when the
//! application only sends. `send` puts messages into the window and transmits them itself;
//! `recv` takes from the machine's delivery queue (cancel safe: it never awaits after taking
//! a message). Dropping the connection drops unacknowledged messages: call
//! [`ReliableConnection::flush`] first to wait until the peer has them.
//! The task starts reading at the connection's first `send`, `recv` or `flush`.
//!
//! # Reconfiguration
//!
//! A `ReliableConnection` can be a branch of a reconfigurable select (e.g. between two
//! window sizes). At the switch point it hands its successor everything
//! ([`ReliableState`]): messages received but not delivered yet, both sequence spaces, the
//! unacknowledged messages and the RTT estimate. A `Reliable` successor goes on where it
//! stopped, so each end can switch on its own without losing or duplicating a message. The
//! successor's driver starts only when it takes over, so it never reads frames its
//! predecessor should have.
//!
//! # Example
//!
//! ```
//! use chunnel::{Chunnel, ChunnelExt, ConnectionExt, Listener};
//! use chunnel_net::udp;
//! use chunnel_std::reliable::Reliable;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! let listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap()).await?;
//! let addr = listener.local_addr()?;
//! let mut server = Reliable::default().serve(listener);
//! let mut client = chunnel::stack![Reliable::default(), udp::Connect::new(addr)];
//!
//! let conn = client.connect_wrap(()).await?;
//! conn.send_one("hello".into()).await?;
//! let peer = server.accept().await?;
//! assert_eq!(peer.recv_one().await?, "hello");
//! conn.flush().await?; // the server acknowledged everything
//! # Ok(()) }
//! ```

mod chunnel;
mod config;
mod connection;
#[cfg(feature = "metrics")]
mod export;
mod machine;
mod wire;

pub use self::chunnel::Reliable;
pub use self::config::Config;
pub use self::connection::{ReliableConnection, ReliableState};
pub use self::machine::{Machine, Stats};
pub use self::wire::{
    Ack, FLAG_ACK, FLAG_DATA, Header, MAX_HEADER, MAX_SACK, VERSION, decode_frame,
};

const LAYER: &str = "chunnel-std/reliable";

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use bytes::Bytes;

    use super::machine::Rtt;
    use super::*;

    #[test]
    fn rto_follows_rfc6298() {
        let cfg = Config::default();
        let mut r = Rtt::new(&cfg);
        assert_eq!(r.rto(), cfg.initial_rto);
        r.sample(Duration::from_millis(40));
        // SRTT = 40, RTTVAR = 20: RTO = 40 + 80.
        assert_eq!(r.rto(), Duration::from_millis(120));
        r.backoff = 2;
        assert_eq!(r.rto(), Duration::from_millis(480));
        r.backoff = 10;
        assert_eq!(r.rto(), cfg.max_rto);
        r.sample(Duration::from_millis(40));
        assert_eq!(r.backoff, 0);
    }

    #[test]
    fn karn_and_backoff() {
        let cfg = Config::default();
        let mut a = Machine::new(cfg.clone());
        let mut b = Machine::new(cfg);
        let t0 = Instant::now();
        a.send(Bytes::from_static(b"x")).unwrap();
        let f = a.poll_transmit(t0).unwrap();
        assert_eq!(a.poll_timeout(), Some(t0 + Duration::from_millis(100)));
        // Lost; the timer fires and the RTO doubles.
        drop(f);
        let t1 = t0 + Duration::from_millis(100);
        a.handle_timeout(t1);
        let f = a.poll_transmit(t1).unwrap();
        assert_eq!(a.stats().rto, Duration::from_millis(200));
        b.handle_frame(f, t1).unwrap();
        assert_eq!(b.poll_deliver().as_deref(), Some(&b"x"[..]));
        let ack = b.poll_transmit(t1).unwrap();
        a.handle_frame(ack, t1 + Duration::from_millis(5)).unwrap();
        // Karn: the retransmitted message gave no sample; the backoff stays.
        assert_eq!(a.stats().srtt, None);
        assert_eq!(a.unacked(), 0);
        assert_eq!(a.poll_timeout(), None);
    }
}
