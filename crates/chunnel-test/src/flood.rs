//! A flood of new source addresses for listener tests: datagrams that are no protocol message
//! from many distinct (address, port) pairs, with file descriptors bounded.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use tokio::net::UdpSocket;

/// Sockets open at once; each round binds a fresh pool on another loopback address, so every
/// socket is a distinct source.
pub const POOL: usize = 500;
/// Rounds, one loopback address each (127.0.0.2 upwards).
pub const ROUNDS: u8 = 5;
/// Datagrams each source sends.
pub const PER_SOURCE: usize = 8;

/// Sends [`PER_SOURCE`] non-empty datagrams (`ee k 01 02 03`) from each of
/// `ROUNDS * POOL` distinct sources to `to`, paced so that loopback keeps up (1 ms every ten
/// datagrams). Returns the number of sources.
///
/// # Panics
///
/// If a socket cannot be bound or a datagram not sent (a test harness, not a library).
pub async fn from_distinct_sources(to: SocketAddr) -> usize {
    let mut sources = 0;
    for r in 0..ROUNDS {
        let ip = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2 + r));
        let mut pool = Vec::with_capacity(POOL);
        for _ in 0..POOL {
            pool.push(UdpSocket::bind(SocketAddr::new(ip, 0)).await.unwrap());
        }
        for k in 0..PER_SOURCE {
            for (i, s) in pool.iter().enumerate() {
                s.send_to(&[0xee, k as u8, 1, 2, 3], to).await.unwrap();
                if i % 10 == 9 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
        sources += pool.len();
    }
    sources
}
