//! Minimal Ethernet II / IPv4 / UDP: parse a received frame, build a reply frame.
//!
//! Received frames: IPv4 without options beyond what IHL says, no fragments (the XDP program
//! passes those to the kernel), UDP length checked against the IP length (Ethernet padding
//! of short frames is cut off). The IPv4 header checksum is verified; the UDP checksum is
//! not, because a kernel sender on veth hands over frames with `CHECKSUM_PARTIAL` whose UDP
//! checksum field is not filled in (PLATFORM.md §2b).
//!
//! Sent frames: IPv4 header checksum computed, DF set, TTL 64; the UDP checksum is computed
//! (so a receiver that verifies it, as the kernel does, accepts it).

use std::net::{Ipv4Addr, SocketAddrV4};

/// Ethernet + IPv4 (no options) + UDP header bytes.
pub(crate) const HEADERS: usize = 14 + 20 + 8;

/// Both ends of a datagram at layer 2 and 4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Endpoints {
    pub(crate) src_mac: [u8; 6],
    pub(crate) dst_mac: [u8; 6],
    pub(crate) src: SocketAddrV4,
    pub(crate) dst: SocketAddrV4,
}

/// Why a frame was not a datagram for us.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reject {
    NotIpv4Udp,
    Truncated,
    BadIpChecksum,
    Fragment,
}

/// Parses an Ethernet/IPv4/UDP frame: its endpoints and the payload's byte range.
pub(crate) fn parse(f: &[u8]) -> Result<(Endpoints, std::ops::Range<usize>), Reject> {
    if f.len() < 14 + 20 {
        return Err(Reject::Truncated);
    }
    if f[12..14] != [0x08, 0x00] {
        return Err(Reject::NotIpv4Udp);
    }
    let ip = &f[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    if ip[0] >> 4 != 4 || ihl < 20 || ip[9] != 17 {
        return Err(Reject::NotIpv4Udp);
    }
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    if total < ihl + 8 || total > ip.len() {
        return Err(Reject::Truncated);
    }
    if u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0 {
        return Err(Reject::Fragment);
    }
    if checksum(&ip[..ihl], 0) != 0 {
        return Err(Reject::BadIpChecksum);
    }
    let udp = &ip[ihl..total];
    let ulen = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    if ulen < 8 || ulen > udp.len() {
        return Err(Reject::Truncated);
    }
    let ep = Endpoints {
        dst_mac: f[0..6].try_into().expect("6 bytes"),
        src_mac: f[6..12].try_into().expect("6 bytes"),
        src: SocketAddrV4::new(
            Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
            u16::from_be_bytes([udp[0], udp[1]]),
        ),
        dst: SocketAddrV4::new(
            Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
            u16::from_be_bytes([udp[2], udp[3]]),
        ),
    };
    let start = 14 + ihl + 8;
    Ok((ep, start..start + ulen - 8))
}

/// Writes a frame from `ep.src` to `ep.dst` carrying `parts` (concatenated) into `buf`;
/// returns its length. `buf` must hold `HEADERS + payload` bytes.
pub(crate) fn build(buf: &mut [u8], ep: &Endpoints, ip_id: u16, parts: &[&[u8]]) -> usize {
    let payload: usize = parts.iter().map(|p| p.len()).sum();
    let mut at = HEADERS;
    for p in parts {
        buf[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
    headers(buf, ep, ip_id, payload)
}

/// Writes the headers of a frame from `ep.src` to `ep.dst` whose `payload` bytes are already
/// in place after [`HEADERS`] bytes of `buf`; returns the frame's length.
pub(crate) fn headers(buf: &mut [u8], ep: &Endpoints, ip_id: u16, payload: usize) -> usize {
    let len = HEADERS + payload;
    let f = &mut buf[..len];
    f[0..6].copy_from_slice(&ep.dst_mac);
    f[6..12].copy_from_slice(&ep.src_mac);
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    let (src_ip, dst_ip) = (ep.src.ip().octets(), ep.dst.ip().octets());
    {
        let ip = &mut f[14..34];
        ip[0] = 0x45;
        ip[1] = 0;
        ip[2..4].copy_from_slice(&((20 + 8 + payload) as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&ip_id.to_be_bytes());
        ip[6..8].copy_from_slice(&0x4000u16.to_be_bytes()); // DF
        ip[8] = 64;
        ip[9] = 17;
        ip[10..12].copy_from_slice(&[0, 0]);
        ip[12..16].copy_from_slice(&src_ip);
        ip[16..20].copy_from_slice(&dst_ip);
        let c = checksum(ip, 0);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
    }
    let ulen = (8 + payload) as u16;
    {
        let udp = &mut f[34..42];
        udp[0..2].copy_from_slice(&ep.src.port().to_be_bytes());
        udp[2..4].copy_from_slice(&ep.dst.port().to_be_bytes());
        udp[4..6].copy_from_slice(&ulen.to_be_bytes());
        udp[6..8].copy_from_slice(&[0, 0]);
    }
    // Pseudo-header: addresses, protocol, UDP length.
    let mut pseudo = 0u32;
    for w in src_ip.chunks(2).chain(dst_ip.chunks(2)) {
        pseudo += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    pseudo += 17 + u32::from(ulen);
    let mut c = checksum(&f[34..], pseudo);
    if c == 0 {
        c = 0xffff; // 0 means "no checksum" in UDP over IPv4
    }
    f[40..42].copy_from_slice(&c.to_be_bytes());
    len
}

/// The Internet checksum (RFC 1071) of `data`, starting from the partial sum `initial`.
pub(crate) fn checksum(data: &[u8], initial: u32) -> u16 {
    let mut sum = u64::from(initial);
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        sum += u64::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u64::from(u16::from_be_bytes([*last, 0]));
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep() -> Endpoints {
        Endpoints {
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            src: "10.0.0.1:5000".parse().unwrap(),
            dst: "10.0.0.2:6000".parse().unwrap(),
        }
    }

    #[test]
    fn build_then_parse_round_trips() {
        for n in [0usize, 1, 17, 18, 100, 1472] {
            let payload: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let mut buf = vec![0u8; 2048];
            let len = build(&mut buf, &ep(), 7, &[&payload[..n / 2], &payload[n / 2..]]);
            // Pad like Ethernet does for short frames.
            let flen = len.max(60);
            let (got, range) = parse(&buf[..flen]).unwrap();
            assert_eq!(got, Endpoints { ..ep() });
            assert_eq!(&buf[range], &payload[..]);
            // The UDP checksum verifies (sum over pseudo-header + segment == 0).
            let seg = &buf[34..len];
            let mut pseudo = 0u32;
            for w in [10u16 << 8, 1, 10 << 8, 2] {
                pseudo += u32::from(w);
            }
            pseudo += 17 + seg.len() as u32;
            assert_eq!(checksum(seg, pseudo), 0);
        }
    }

    #[test]
    fn known_ipv4_checksum() {
        // Example header from RFC 1071 discussions (Wikipedia "IPv4 header checksum").
        let h = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&h, 0), 0xb861);
    }

    #[test]
    fn rejects() {
        let mut buf = vec![0u8; 2048];
        let len = build(&mut buf, &ep(), 1, &[b"hi"]);
        let mut bad = buf[..len].to_vec();
        bad[24] ^= 1; // IP checksum
        assert_eq!(parse(&bad).unwrap_err(), Reject::BadIpChecksum);
        let mut arp = buf[..len].to_vec();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        assert_eq!(parse(&arp).unwrap_err(), Reject::NotIpv4Udp);
        assert_eq!(parse(&buf[..len - 1]).unwrap_err(), Reject::Truncated);
        let mut frag = buf[..len].to_vec();
        frag[20] = 0x20; // MF
        assert_eq!(parse(&frag).unwrap_err(), Reject::Fragment);
    }
}
