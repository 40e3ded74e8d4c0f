//! The few rtnetlink requests the AF_XDP client needs, by hand (no netlink crate): the route
//! to a peer (`RTM_GETROUTE`: output interface, gateway, preferred source address), one
//! neighbour entry (`RTM_GETNEIGH`), starting the kernel's resolution of one
//! (`RTM_NEWNEIGH` with `NTF_USE`: the kernel sends its ARP request, nothing reaches any
//! application), and an interface's MAC address and whether an XDP program is attached to it
//! (`RTM_GETLINK`).
//!
//! A netlink socket answers for the network namespace of the thread that created it, so these
//! work in whatever namespace the caller runs in (unlike `/sys/class/net`, which shows the
//! namespace that mounted `/sys`). Every reply is parsed with bounds checks: a short or
//! inconsistent message is an `InvalidData` error, never a panic. The socket calls are this
//! module's only unsafe code.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const NLMSG_HDR: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_TYPE_MASK: u16 = 0x3fff;

const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_PREFSRC: u16 = 7;
const RTN_UNICAST: u8 = 1;

const NDA_DST: u16 = 1;
const NDA_LLADDR: u16 = 2;

const IFLA_ADDRESS: u16 = 1;
const IFLA_XDP: u16 = 43;
const IFLA_XDP_ATTACHED: u16 = 2;

/// Neighbour states whose link-layer address can be used (`NUD_VALID`).
const NUD_VALID: u16 = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80;
/// Resolution failed (`NUD_FAILED`).
pub(crate) const NUD_FAILED: u16 = 0x20;

fn invalid(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("netlink: {what}"))
}

/// The route the kernel would use to reach an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Route {
    /// Output interface.
    pub(crate) oif: u32,
    /// Next hop, when the destination is not on the link.
    pub(crate) gateway: Option<Ipv4Addr>,
    /// The source address the kernel would pick.
    pub(crate) prefsrc: Option<Ipv4Addr>,
}

impl Route {
    /// The address whose MAC address frames to the destination carry.
    pub(crate) fn next_hop(&self, dst: Ipv4Addr) -> Ipv4Addr {
        self.gateway.unwrap_or(dst)
    }
}

/// One neighbour entry: its state and link-layer address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Neighbour {
    pub(crate) state: u16,
    pub(crate) mac: Option<[u8; 6]>,
}

impl Neighbour {
    /// The MAC address, if the entry is resolved.
    pub(crate) fn usable(&self) -> Option<[u8; 6]> {
        if self.state & NUD_VALID != 0 {
            self.mac
        } else {
            None
        }
    }
}

/// What the client needs to know about its interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Link {
    pub(crate) mac: Option<[u8; 6]>,
    /// An XDP program (of any mode) is attached.
    pub(crate) xdp_attached: bool,
}

/// A `NETLINK_ROUTE` socket; requests are answered in order.
pub(crate) struct Netlink {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl Netlink {
    /// Opens a socket in the calling thread's network namespace; replies wait at most 1 s.
    pub(crate) fn open() -> io::Result<Netlink> {
        // SAFETY: plain socket(2); the descriptor is owned by OwnedFd from here on.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just returned by socket(2) and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let tv = libc::timeval {
            tv_sec: 1,
            tv_usec: 0,
        };
        // SAFETY: `tv` is a valid timeval for the duration of the call.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Netlink {
            fd,
            seq: 0,
            buf: vec![0; 64 * 1024],
        })
    }

    /// Sends one request (`header` then `attrs` as (type, value)) and returns the payload
    /// of the answer of type `want` (an `NLMSG_ERROR` with code 0, an acknowledgement, gives
    /// an empty payload; another code is that errno).
    fn request(
        &mut self,
        kind: u16,
        flags: u16,
        header: &[u8],
        attrs: &[(u16, &[u8])],
        want: u16,
    ) -> io::Result<Vec<u8>> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let mut msg = Vec::with_capacity(64);
        msg.extend_from_slice(&[0; NLMSG_HDR]);
        msg.extend_from_slice(header);
        pad4(&mut msg);
        for (t, v) in attrs {
            msg.extend_from_slice(&((4 + v.len()) as u16).to_ne_bytes());
            msg.extend_from_slice(&t.to_ne_bytes());
            msg.extend_from_slice(v);
            pad4(&mut msg);
        }
        let len = msg.len() as u32;
        msg[0..4].copy_from_slice(&len.to_ne_bytes());
        msg[4..6].copy_from_slice(&kind.to_ne_bytes());
        msg[6..8].copy_from_slice(&(flags | libc::NLM_F_REQUEST as u16).to_ne_bytes());
        msg[8..12].copy_from_slice(&seq.to_ne_bytes());
        // SAFETY: sockaddr_nl is plain data; zeroed is valid (pid 0: the kernel).
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `msg` and `sa` are valid for the lengths given during the call.
        let r = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&raw const sa).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        // Bounded: each recv waits at most SO_RCVTIMEO, and stale answers are few.
        for _ in 0..16 {
            // SAFETY: `buf` is valid for writes of its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr().cast(),
                    self.buf.len(),
                    0,
                )
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let got = &self.buf[..n as usize];
            for m in Messages(got) {
                let (t, mseq, payload) = m?;
                if mseq != seq {
                    continue; // an answer to an earlier request that timed out
                }
                match t {
                    NLMSG_ERROR => {
                        let code = payload
                            .get(0..4)
                            .ok_or_else(|| invalid("short error message"))?;
                        let code = i32::from_ne_bytes(code.try_into().expect("4 bytes"));
                        return if code == 0 {
                            Ok(Vec::new())
                        } else {
                            Err(io::Error::from_raw_os_error(-code))
                        };
                    }
                    NLMSG_DONE => return Err(invalid("no answer")),
                    t if t == want => return Ok(payload.to_vec()),
                    _ => {}
                }
            }
        }
        Err(invalid("no answer to the request"))
    }

    /// The kernel's route to `dst`.
    pub(crate) fn route(&mut self, dst: Ipv4Addr) -> io::Result<Route> {
        // rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags (u32).
        let mut rtm = [0u8; 12];
        rtm[0] = libc::AF_INET as u8;
        rtm[1] = 32;
        let p = self.request(
            libc::RTM_GETROUTE,
            0,
            &rtm,
            &[(RTA_DST, &dst.octets())],
            libc::RTM_NEWROUTE,
        )?;
        parse_route(&p)
    }

    /// The neighbour entry for `ip` on `ifindex`, `None` if there is none.
    pub(crate) fn neighbour(
        &mut self,
        ifindex: u32,
        ip: Ipv4Addr,
    ) -> io::Result<Option<Neighbour>> {
        match self.request(
            libc::RTM_GETNEIGH,
            0,
            &ndmsg(ifindex, 0),
            &[(NDA_DST, &ip.octets())],
            libc::RTM_NEWNEIGH,
        ) {
            Ok(p) => parse_neighbour(&p).map(Some),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Asks the kernel to resolve `ip` on `ifindex` (creating the entry if needed): it sends
    /// its own ARP request, as it would for a datagram of its own.
    pub(crate) fn solicit(&mut self, ifindex: u32, ip: Ipv4Addr) -> io::Result<()> {
        let flags = (libc::NLM_F_CREATE | libc::NLM_F_REPLACE | libc::NLM_F_ACK) as u16;
        self.request(
            libc::RTM_NEWNEIGH,
            flags,
            &ndmsg(ifindex, libc::NTF_USE),
            &[(NDA_DST, &ip.octets())],
            NLMSG_ERROR,
        )
        .map(drop)
    }

    /// The interface's MAC address and whether an XDP program is attached to it.
    pub(crate) fn link(&mut self, ifindex: u32) -> io::Result<Link> {
        // ifinfomsg: family, pad, type (u16), index (i32), flags (u32), change (u32).
        let mut ifi = [0u8; 16];
        ifi[4..8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
        let p = self.request(libc::RTM_GETLINK, 0, &ifi, &[], libc::RTM_NEWLINK)?;
        parse_link(&p)
    }
}

/// ndmsg: family, pad, pad (u16), ifindex (i32), state (u16), flags, type.
fn ndmsg(ifindex: u32, flags: u8) -> [u8; 12] {
    let mut m = [0u8; 12];
    m[0] = libc::AF_INET as u8;
    m[4..8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
    m[10] = flags;
    m
}

fn pad4(v: &mut Vec<u8>) {
    while !v.len().is_multiple_of(4) {
        v.push(0);
    }
}

const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// The messages of one datagram: (type, sequence number, payload).
struct Messages<'a>(&'a [u8]);

impl<'a> Iterator for Messages<'a> {
    type Item = io::Result<(u16, u32, &'a [u8])>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let b = self.0;
        self.0 = &[];
        if b.len() < NLMSG_HDR {
            return Some(Err(invalid("short message header")));
        }
        let len = u32::from_ne_bytes(b[0..4].try_into().expect("4 bytes")) as usize;
        if len < NLMSG_HDR || len > b.len() {
            return Some(Err(invalid("message length out of bounds")));
        }
        let t = u16::from_ne_bytes([b[4], b[5]]);
        let seq = u32::from_ne_bytes(b[8..12].try_into().expect("4 bytes"));
        self.0 = b.get(align4(len)..).unwrap_or(&[]);
        Some(Ok((t, seq, &b[NLMSG_HDR..len])))
    }
}

/// The attributes in `b`: (type without flags, value).
struct Attrs<'a>(&'a [u8]);

impl<'a> Iterator for Attrs<'a> {
    type Item = io::Result<(u16, &'a [u8])>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let b = self.0;
        self.0 = &[];
        if b.len() < 4 {
            return Some(Err(invalid("short attribute header")));
        }
        let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
        if len < 4 || len > b.len() {
            return Some(Err(invalid("attribute length out of bounds")));
        }
        let t = u16::from_ne_bytes([b[2], b[3]]) & NLA_TYPE_MASK;
        self.0 = b.get(align4(len)..).unwrap_or(&[]);
        Some(Ok((t, &b[4..len])))
    }
}

fn ipv4(v: &[u8]) -> io::Result<Ipv4Addr> {
    let o: [u8; 4] = v
        .try_into()
        .map_err(|_| invalid("IPv4 address of the wrong length"))?;
    Ok(Ipv4Addr::from(o))
}

fn mac(v: &[u8]) -> Option<[u8; 6]> {
    v.try_into().ok()
}

fn parse_route(p: &[u8]) -> io::Result<Route> {
    let body = p.get(12..).ok_or_else(|| invalid("short rtmsg"))?;
    if p[7] != RTN_UNICAST {
        return Err(io::Error::new(
            io::ErrorKind::HostUnreachable,
            format!("the route is not unicast (type {})", p[7]),
        ));
    }
    let mut r = Route {
        oif: 0,
        gateway: None,
        prefsrc: None,
    };
    for a in Attrs(body) {
        let (t, v) = a?;
        match t {
            RTA_OIF => {
                let o: [u8; 4] = v.try_into().map_err(|_| invalid("RTA_OIF length"))?;
                r.oif = u32::from_ne_bytes(o);
            }
            RTA_GATEWAY => r.gateway = Some(ipv4(v)?),
            RTA_PREFSRC => r.prefsrc = Some(ipv4(v)?),
            _ => {}
        }
    }
    if r.oif == 0 {
        return Err(invalid("route without an output interface"));
    }
    Ok(r)
}

fn parse_neighbour(p: &[u8]) -> io::Result<Neighbour> {
    let body = p.get(12..).ok_or_else(|| invalid("short ndmsg"))?;
    let state = u16::from_ne_bytes([p[8], p[9]]);
    let mut n = Neighbour { state, mac: None };
    for a in Attrs(body) {
        let (t, v) = a?;
        if t == NDA_LLADDR {
            n.mac = mac(v);
        }
    }
    Ok(n)
}

fn parse_link(p: &[u8]) -> io::Result<Link> {
    let body = p.get(16..).ok_or_else(|| invalid("short ifinfomsg"))?;
    let mut l = Link {
        mac: None,
        xdp_attached: false,
    };
    for a in Attrs(body) {
        let (t, v) = a?;
        match t {
            IFLA_ADDRESS => l.mac = mac(v),
            IFLA_XDP => {
                for x in Attrs(v) {
                    let (t, v) = x?;
                    if t == IFLA_XDP_ATTACHED {
                        l.xdp_attached = v.first().is_some_and(|&m| m != 0);
                    }
                }
            }
            _ => {}
        }
    }
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(t: u16, v: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&((4 + v.len()) as u16).to_ne_bytes());
        a.extend_from_slice(&t.to_ne_bytes());
        a.extend_from_slice(v);
        pad4(&mut a);
        a
    }

    #[test]
    fn parses_a_route() {
        let mut p = vec![2, 32, 0, 0, 254, 0, 0, RTN_UNICAST, 0, 0, 0, 0];
        p.extend(attr(RTA_DST, &[10, 0, 0, 2]));
        p.extend(attr(RTA_OIF, &7u32.to_ne_bytes()));
        p.extend(attr(RTA_PREFSRC, &[10, 0, 0, 1]));
        let r = parse_route(&p).unwrap();
        assert_eq!(r.oif, 7);
        assert_eq!(r.gateway, None);
        assert_eq!(r.prefsrc, Some(Ipv4Addr::new(10, 0, 0, 1)));
        assert_eq!(
            r.next_hop(Ipv4Addr::new(10, 0, 0, 2)),
            Ipv4Addr::new(10, 0, 0, 2)
        );
        p.extend(attr(RTA_GATEWAY, &[10, 0, 0, 254]));
        let r = parse_route(&p).unwrap();
        assert_eq!(
            r.next_hop(Ipv4Addr::new(8, 8, 8, 8)),
            Ipv4Addr::new(10, 0, 0, 254)
        );
    }

    #[test]
    fn parses_a_link_with_xdp() {
        let mut p = vec![0u8; 16];
        p.extend(attr(IFLA_ADDRESS, &[2, 0, 0, 0, 0, 9]));
        let nested = attr(IFLA_XDP_ATTACHED, &[1]);
        p.extend(attr(IFLA_XDP | 0x8000, &nested));
        let l = parse_link(&p).unwrap();
        assert_eq!(l.mac, Some([2, 0, 0, 0, 0, 9]));
        assert!(l.xdp_attached);
    }

    #[test]
    fn neighbour_states() {
        let mut p = vec![0u8; 12];
        p[8..10].copy_from_slice(&0x01u16.to_ne_bytes()); // NUD_INCOMPLETE
        p.extend(attr(NDA_LLADDR, &[2, 0, 0, 0, 0, 1]));
        assert_eq!(parse_neighbour(&p).unwrap().usable(), None);
        p[8..10].copy_from_slice(&0x02u16.to_ne_bytes()); // NUD_REACHABLE
        assert_eq!(
            parse_neighbour(&p).unwrap().usable(),
            Some([2, 0, 0, 0, 0, 1])
        );
    }

    /// Truncated or inconsistent input from the kernel is an error, never a panic.
    #[test]
    fn malformed_replies_are_errors() {
        let mut p = vec![2, 32, 0, 0, 254, 0, 0, RTN_UNICAST, 0, 0, 0, 0];
        p.extend(attr(RTA_OIF, &7u32.to_ne_bytes()));
        for cut in 0..p.len() {
            let _ = parse_route(&p[..cut]);
            let _ = parse_link(&p[..cut]);
            let _ = parse_neighbour(&p[..cut]);
        }
        let mut bad = p.clone();
        bad[12] = 200; // attribute longer than the message
        assert!(parse_route(&bad).is_err());
        bad[12] = 2; // shorter than its header
        assert!(parse_route(&bad).is_err());
        assert!(parse_route(&p[..8]).is_err());
        let mut oif_len = p.clone();
        oif_len[12] = 6;
        assert!(parse_route(&oif_len).is_err());
        for m in Messages(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]) {
            assert!(m.is_err());
        }
        for m in Messages(&[8]) {
            assert!(m.is_err());
        }
    }
}
