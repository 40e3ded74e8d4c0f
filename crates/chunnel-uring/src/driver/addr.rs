//! Socket addresses as bytes, as the kernel reads and writes them through pointers (no
//! unsafe code here).

use std::mem;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use super::*;

/// Encodes `addr` as a `sockaddr_in` / `sockaddr_in6` into `out`; returns its length.
pub(crate) fn encode_addr(addr: &SocketAddr, out: &mut [u8; NAME_LEN]) -> u32 {
    *out = [0; NAME_LEN];
    match addr {
        SocketAddr::V4(a) => {
            out[0..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
            out[2..4].copy_from_slice(&a.port().to_be_bytes());
            out[4..8].copy_from_slice(&a.ip().octets());
            mem::size_of::<libc::sockaddr_in>() as u32
        }
        SocketAddr::V6(a) => {
            out[0..2].copy_from_slice(&(libc::AF_INET6 as u16).to_ne_bytes());
            out[2..4].copy_from_slice(&a.port().to_be_bytes());
            // sin6_flowinfo is stored as given, like the standard library does.
            out[4..8].copy_from_slice(&a.flowinfo().to_ne_bytes());
            out[8..24].copy_from_slice(&a.ip().octets());
            out[24..28].copy_from_slice(&a.scope_id().to_ne_bytes());
            mem::size_of::<libc::sockaddr_in6>() as u32
        }
    }
}

/// Decodes a `sockaddr_in` / `sockaddr_in6` written by the kernel.
pub(crate) fn decode_addr(b: &[u8]) -> Option<SocketAddr> {
    let family = u16::from_ne_bytes(b.get(0..2)?.try_into().ok()?);
    let port = u16::from_be_bytes(b.get(2..4)?.try_into().ok()?);
    match i32::from(family) {
        libc::AF_INET => {
            let ip: [u8; 4] = b.get(4..8)?.try_into().ok()?;
            Some(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(ip), port)))
        }
        libc::AF_INET6 => {
            let flow = u32::from_ne_bytes(b.get(4..8)?.try_into().ok()?);
            let ip: [u8; 16] = b.get(8..24)?.try_into().ok()?;
            let scope = u32::from_ne_bytes(b.get(24..28)?.try_into().ok()?);
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(ip),
                port,
                flow,
                scope,
            )))
        }
        _ => None,
    }
}
