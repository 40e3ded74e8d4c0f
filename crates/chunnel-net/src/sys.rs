//! Batched datagram system calls (`sendmmsg(2)` / `recvmmsg(2)`) and socket-address
//! conversions. This is the only module with `unsafe` code.

use std::hash::Hash;
use std::io;
use std::mem::{self, MaybeUninit};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// The most messages one system call moves. Arrays of this size live on the stack.
pub(crate) const MAX_BATCH: usize = 64;

/// A raw socket address as the kernel reads and writes it.
#[derive(Clone, Copy)]
pub(crate) struct RawAddr {
    pub(crate) storage: libc::sockaddr_storage,
    pub(crate) len: libc::socklen_t,
}

impl RawAddr {
    pub(crate) fn zeroed() -> Self {
        // SAFETY: sockaddr_storage is plain old data; all-zero is a valid (AF_UNSPEC) value.
        RawAddr {
            storage: unsafe { mem::zeroed() },
            len: mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t,
        }
    }
}

/// An address type a datagram socket can be demultiplexed by.
pub(crate) trait DgramAddr:
    Clone + Eq + Hash + Send + Sync + std::fmt::Debug + 'static
{
    /// Parses a kernel address; `None` for a family or form this socket type does not use.
    fn from_raw(raw: &RawAddr) -> Option<Self>;
    /// Encodes for the kernel.
    fn to_raw(&self) -> RawAddr;
}

impl DgramAddr for SocketAddr {
    fn from_raw(raw: &RawAddr) -> Option<Self> {
        match raw.storage.ss_family as libc::c_int {
            libc::AF_INET if raw.len as usize >= mem::size_of::<libc::sockaddr_in>() => {
                // SAFETY: the family says the storage holds a sockaddr_in, and it is long enough.
                let sin: &libc::sockaddr_in =
                    unsafe { &*(&raw.storage as *const _ as *const libc::sockaddr_in) };
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                    u16::from_be(sin.sin_port),
                )))
            }
            libc::AF_INET6 if raw.len as usize >= mem::size_of::<libc::sockaddr_in6>() => {
                // SAFETY: as above, for sockaddr_in6.
                let sin6: &libc::sockaddr_in6 =
                    unsafe { &*(&raw.storage as *const _ as *const libc::sockaddr_in6) };
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                    u16::from_be(sin6.sin6_port),
                    sin6.sin6_flowinfo,
                    sin6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }

    fn to_raw(&self) -> RawAddr {
        let mut raw = RawAddr::zeroed();
        match self {
            SocketAddr::V4(a) => {
                // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr type.
                let sin = unsafe { &mut *(&mut raw.storage as *mut _ as *mut libc::sockaddr_in) };
                sin.sin_family = libc::AF_INET as libc::sa_family_t;
                sin.sin_port = a.port().to_be();
                sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
                raw.len = mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            }
            SocketAddr::V6(a) => {
                // SAFETY: as above.
                let sin6 = unsafe { &mut *(&mut raw.storage as *mut _ as *mut libc::sockaddr_in6) };
                sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sin6.sin6_port = a.port().to_be();
                sin6.sin6_addr.s6_addr = a.ip().octets();
                sin6.sin6_flowinfo = a.flowinfo();
                sin6.sin6_scope_id = a.scope_id();
                raw.len = mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
            }
        }
        raw
    }
}

/// A Unix-domain socket address: a filesystem path or a Linux abstract name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum UnixAddr {
    /// A socket file.
    Path(PathBuf),
    /// A Linux abstract-namespace name (no file; scoped to the network namespace).
    Abstract(Vec<u8>),
}

impl std::fmt::Display for UnixAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UnixAddr::Path(p) => write!(f, "{}", p.display()),
            UnixAddr::Abstract(n) => write!(f, "@{}", String::from_utf8_lossy(n)),
        }
    }
}

impl From<PathBuf> for UnixAddr {
    fn from(p: PathBuf) -> Self {
        UnixAddr::Path(p)
    }
}

impl From<&std::path::Path> for UnixAddr {
    fn from(p: &std::path::Path) -> Self {
        UnixAddr::Path(p.to_path_buf())
    }
}

const SUN_PATH_OFFSET: usize = mem::offset_of!(libc::sockaddr_un, sun_path);

impl UnixAddr {
    /// Longest name the kernel accepts (`sun_path` is 108 bytes; paths need a NUL).
    pub(crate) fn check(&self) -> io::Result<()> {
        let (len, max) = match self {
            UnixAddr::Path(p) => (p.as_os_str().len(), 107),
            UnixAddr::Abstract(n) => (n.len(), 107),
        };
        if len == 0 || len > max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("unix socket name must be 1..={max} bytes, got {len}"),
            ));
        }
        Ok(())
    }
}

impl DgramAddr for UnixAddr {
    fn from_raw(raw: &RawAddr) -> Option<Self> {
        if raw.storage.ss_family as libc::c_int != libc::AF_UNIX {
            return None;
        }
        let len = (raw.len as usize).checked_sub(SUN_PATH_OFFSET)?;
        // SAFETY: the family says the storage holds a sockaddr_un.
        let sun: &libc::sockaddr_un =
            unsafe { &*(&raw.storage as *const _ as *const libc::sockaddr_un) };
        let path: &[u8] =
            // SAFETY: c_char and u8 have the same size and alignment.
            unsafe { std::slice::from_raw_parts(sun.sun_path.as_ptr().cast(), sun.sun_path.len()) };
        let path = &path[..len.min(path.len())];
        match path.split_first() {
            None => None, // unnamed peer: it cannot receive replies
            Some((0, name)) => Some(UnixAddr::Abstract(name.to_vec())),
            Some(_) => {
                let end = path.iter().position(|&b| b == 0).unwrap_or(path.len());
                Some(UnixAddr::Path(PathBuf::from(std::ffi::OsStr::from_bytes(
                    &path[..end],
                ))))
            }
        }
    }

    fn to_raw(&self) -> RawAddr {
        let mut raw = RawAddr::zeroed();
        // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_un.
        let sun = unsafe { &mut *(&mut raw.storage as *mut _ as *mut libc::sockaddr_un) };
        sun.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let (bytes, lead): (&[u8], usize) = match self {
            UnixAddr::Path(p) => (p.as_os_str().as_bytes(), 0),
            UnixAddr::Abstract(n) => (n.as_slice(), 1),
        };
        // Paths need a terminating NUL; abstract names use the leading NUL instead.
        let n = bytes.len().min(sun.sun_path.len() - 1);
        for (dst, &src) in sun.sun_path[lead..lead + n].iter_mut().zip(bytes) {
            *dst = src as libc::c_char;
        }
        raw.len = (SUN_PATH_OFFSET + lead + n + usize::from(lead == 0)) as libc::socklen_t;
        raw
    }
}

/// One received datagram's metadata.
#[derive(Clone, Copy)]
pub(crate) struct RecvMeta {
    /// Bytes in the slot (at most the slot's size).
    pub(crate) len: usize,
    /// The datagram's whole length (`MSG_TRUNC` makes the kernel report it): more than
    /// `len` when the datagram did not fit its slot.
    pub(crate) wire_len: usize,
    pub(crate) truncated: bool,
    pub(crate) addr: RawAddr,
}

/// Receive memory the kernel writes into. It is never zeroed (a fresh client socket would
/// otherwise pay a memset of `batch * max_payload` bytes); only bytes the kernel reported
/// writing are ever read, through [`Scratch::filled`].
///
/// The `recvmmsg` headers, their iovecs and address buffers live here too and are wired to
/// the slots once, then reused by every call: building 64-byte headers afresh for every slot
/// on every call (most calls on a quiet socket find one datagram, or none) would cost more
/// than the rest of the receive path.
#[derive(Default)]
pub(crate) struct Scratch {
    buf: Vec<MaybeUninit<u8>>,
    /// Per slot, how many leading bytes the last `recv_batch` wrote.
    written: Vec<usize>,
    slot: usize,
    hdrs: Vec<libc::mmsghdr>,
    iovs: Vec<libc::iovec>,
    addrs: Vec<MaybeUninit<libc::sockaddr_storage>>,
    /// The (slot buffer address, slot size, headers wired) the headers point into; rewired
    /// when the buffer moves, the slot size changes or more headers are needed.
    wired: (usize, usize, usize),
    /// Headers whose address length the last `recv_batch` let the kernel change.
    dirty: usize,
}

impl Scratch {
    /// Makes room for `slots` slots of `slot` bytes.
    pub(crate) fn ensure(&mut self, slots: usize, slot: usize) {
        // Only the layout changes with `slot`: the bytes are never read before being written.
        self.slot = slot;
        if self.buf.len() < slots * slot {
            self.buf.resize(slots * slot, MaybeUninit::uninit());
        }
        self.written.clear();
    }

    /// The bytes the kernel wrote into slot `i` (at most `len`).
    pub(crate) fn filled(&self, i: usize, len: usize) -> &[u8] {
        let len = len.min(self.written.get(i).copied().unwrap_or(0));
        let start = i * self.slot;
        let part = &self.buf[start..start + len];
        // SAFETY: `written[i]` bytes at the start of slot `i` were written by `recvmmsg` (it
        // reported that length), so they are initialised; `len` never exceeds that.
        unsafe { &*(part as *const [MaybeUninit<u8>] as *const [u8]) }
    }

    /// Points the first `count` headers at their slot, iovec and address buffer (a no-op when
    /// nothing moved since the last call).
    fn wire(&mut self, count: usize) {
        let key = (self.buf.as_ptr() as usize, self.slot, count);
        if (self.wired.0, self.wired.1) == (key.0, key.1) && self.wired.2 >= count {
            return;
        }
        // The vectors are sized once to the largest batch and never shrink or grow again
        // afterwards, so the pointers into `iovs` and `addrs` stay valid.
        if self.hdrs.len() < count {
            self.hdrs.clear();
            self.iovs.clear();
            self.addrs.clear();
            // SAFETY: mmsghdr is plain old data; zero is a valid starting value.
            self.hdrs.resize(count, unsafe { mem::zeroed() });
            self.iovs.resize(
                count,
                libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                },
            );
            self.addrs.resize(count, MaybeUninit::uninit());
        }
        let slot = self.slot;
        for i in 0..count {
            self.iovs[i] = libc::iovec {
                iov_base: self.buf[i * slot..].as_mut_ptr().cast(),
                iov_len: slot,
            };
            let h = &mut self.hdrs[i].msg_hdr;
            h.msg_name = self.addrs[i].as_mut_ptr().cast();
            h.msg_namelen = mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_iov = &mut self.iovs[i];
            h.msg_iovlen = 1;
            h.msg_control = std::ptr::null_mut();
            h.msg_controllen = 0;
        }
        self.wired = key;
    }
}

/// Receives up to `metas.len()` datagrams with one `recvmmsg` call. Datagram `i` lands in
/// slot `i` of `scratch` (see [`Scratch::ensure`]). Non-blocking: returns `WouldBlock` when
/// none is queued.
///
/// With `want_addr` false (a connected socket: every datagram is from its peer) the senders'
/// addresses are not copied out (`metas[i].addr` is left as it was).
pub(crate) fn recv_batch(
    fd: RawFd,
    sc: &mut Scratch,
    metas: &mut [RecvMeta],
    want_addr: bool,
) -> io::Result<usize> {
    sc.written.clear();
    let count = metas
        .len()
        .min(MAX_BATCH)
        .min(sc.buf.len() / sc.slot.max(1));
    if count == 1 {
        return recv_one(fd, sc, metas, want_addr);
    }
    sc.wire(count);
    // The kernel writes back only the address length (and the flags and lengths it reports),
    // and only into the headers of the datagrams it returned: those of the last call are
    // reset (fresh headers are wired with it).
    for h in &mut sc.hdrs[..sc.dirty] {
        h.msg_hdr.msg_namelen = mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    }
    sc.dirty = 0;
    // SAFETY: the first `count` headers point at live, disjoint buffers owned by `sc` (slots
    // of `buf`, `iovs`, `addrs`; wired by `wire` for the current `buf` and slot size), which
    // outlive the call.
    let n = unsafe {
        libc::recvmmsg(
            fd,
            sc.hdrs.as_mut_ptr(),
            count as libc::c_uint,
            // MSG_TRUNC: each `msg_len` is the datagram's whole length, also when it was cut
            // to its slot (UDP and Unix datagram sockets).
            libc::MSG_DONTWAIT | libc::MSG_TRUNC,
            std::ptr::null_mut(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = n as usize;
    sc.dirty = n;
    let slot = sc.slot;
    for (i, (h, m)) in sc.hdrs.iter().zip(metas.iter_mut()).take(n).enumerate() {
        if want_addr {
            let alen =
                (h.msg_hdr.msg_namelen as usize).min(mem::size_of::<libc::sockaddr_storage>());
            m.addr.storage = zeroed_storage();
            // SAFETY: the kernel wrote `alen` bytes of address into addrs[i]; the rest of
            // `m.addr.storage` stays zeroed. Copying bytes between two sockaddr_storage is sound.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    sc.addrs[i].as_ptr().cast::<u8>(),
                    (&mut m.addr.storage as *mut libc::sockaddr_storage).cast::<u8>(),
                    alen,
                );
            }
            m.addr.len = alen as libc::socklen_t;
        }
        m.wire_len = h.msg_len as usize;
        m.len = m.wire_len.min(slot);
        m.truncated = h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0 || m.wire_len > slot;
        sc.written.push(m.len);
    }
    Ok(n)
}

/// [`recv_batch`] of one datagram: `recvfrom` into slot 0, without the message headers
/// (`recvmmsg` copies and checks a header and imports an iovec per call, and its loop and
/// timeout handling run for one datagram too). A datagram longer than the slot comes back
/// cut to the slot, with its whole length in `wire_len`.
fn recv_one(
    fd: RawFd,
    sc: &mut Scratch,
    metas: &mut [RecvMeta],
    want_addr: bool,
) -> io::Result<usize> {
    let Some(m) = metas.first_mut() else {
        return Ok(0);
    };
    let slot = sc.slot.min(sc.buf.len());
    let mut storage = MaybeUninit::<libc::sockaddr_storage>::uninit();
    let mut alen = mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let (addr_ptr, alen_ptr) = if want_addr {
        (
            storage.as_mut_ptr().cast::<libc::sockaddr>(),
            &mut alen as *mut _,
        )
    } else {
        (std::ptr::null_mut(), std::ptr::null_mut())
    };
    // SAFETY: slot 0 of `buf` is `slot` writable bytes owned by `sc`; the address buffer
    // (when asked for) is a live sockaddr_storage with its size in `alen`.
    let r = unsafe {
        libc::recvfrom(
            fd,
            sc.buf.as_mut_ptr().cast(),
            slot,
            // MSG_TRUNC: the return value is the datagram's whole length (see recv_batch).
            libc::MSG_DONTWAIT | libc::MSG_TRUNC,
            addr_ptr,
            alen_ptr,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    if want_addr {
        let alen = (alen as usize).min(mem::size_of::<libc::sockaddr_storage>());
        m.addr.storage = zeroed_storage();
        // SAFETY: the kernel wrote `alen` bytes of address into `storage`; the rest of
        // `m.addr.storage` stays zeroed.
        unsafe {
            std::ptr::copy_nonoverlapping(
                storage.as_ptr().cast::<u8>(),
                (&mut m.addr.storage as *mut libc::sockaddr_storage).cast::<u8>(),
                alen,
            );
        }
        m.addr.len = alen as libc::socklen_t;
    }
    m.wire_len = r as usize;
    m.len = m.wire_len.min(slot);
    m.truncated = m.wire_len > slot;
    sc.written.push(m.len);
    Ok(1)
}

fn zeroed_storage() -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid (AF_UNSPEC) value.
    unsafe { mem::zeroed() }
}

/// Sends `msgs` with one `sendmmsg` call, to `dest` (or the connected peer when `None`).
/// Returns how many were sent (a prefix); non-blocking.
/// Empty slots (`None`) are sent as empty datagrams; callers pass filled ones only.
pub(crate) fn send_batch<M: AsRef<[u8]>>(
    fd: RawFd,
    header: &[u8],
    msgs: &[Option<M>],
    dest: Option<&RawAddr>,
) -> io::Result<usize> {
    let count = msgs.len().min(MAX_BATCH);
    if count == 0 {
        return Ok(0);
    }
    if count == 1 {
        return send_one(
            fd,
            header,
            msgs[0].as_ref().map_or(&[], AsRef::as_ref),
            dest,
        );
    }
    // Each message is gathered from up to two iovecs: the shared header, then the payload.
    let parts = if header.is_empty() { 1 } else { 2 };
    let mut iovs = [[MaybeUninit::<libc::iovec>::uninit(); 2]; MAX_BATCH];
    let mut hdrs = [MaybeUninit::<libc::mmsghdr>::uninit(); MAX_BATCH];
    for i in 0..count {
        let mut k = 0;
        if parts == 2 {
            iovs[i][0].write(libc::iovec {
                iov_base: header.as_ptr() as *mut libc::c_void,
                iov_len: header.len(),
            });
            k = 1;
        }
        let msg: &[u8] = msgs[i].as_ref().map_or(&[], AsRef::as_ref);
        iovs[i][k].write(libc::iovec {
            iov_base: msg.as_ptr() as *mut libc::c_void,
            iov_len: msg.len(),
        });
        // SAFETY: plain old data.
        let mut h: libc::mmsghdr = unsafe { mem::zeroed() };
        if let Some(d) = dest {
            h.msg_hdr.msg_name = &d.storage as *const _ as *mut libc::c_void;
            h.msg_hdr.msg_namelen = d.len;
        }
        h.msg_hdr.msg_iov = iovs[i].as_mut_ptr().cast();
        h.msg_hdr.msg_iovlen = parts;
        hdrs[i].write(h);
    }
    // SAFETY: the first `count` headers are initialised and point at buffers that outlive the
    // call; the kernel only reads the message bytes and address.
    let n = unsafe {
        libc::sendmmsg(
            fd,
            hdrs.as_mut_ptr().cast(),
            count as libc::c_uint,
            // MSG_TRUNC: each `msg_len` is the datagram's whole length, also when it was cut
            // to its slot (UDP and Unix datagram sockets).
            libc::MSG_DONTWAIT | libc::MSG_TRUNC,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// A header and message up to this size are sent from one stack copy (`sendto`) rather than
/// gathered by the kernel (`sendmsg`, which copies in a header and imports an iovec array).
const COALESCE: usize = 512;

/// [`send_batch`] of one message: `sendto`, or `sendmsg` when there is a header too large to
/// copy (see [`recv_one`] for what `sendmmsg` costs on top).
pub(crate) fn send_one(
    fd: RawFd,
    header: &[u8],
    msg: &[u8],
    dest: Option<&RawAddr>,
) -> io::Result<usize> {
    let (name, namelen) = match dest {
        Some(d) => (&d.storage as *const libc::sockaddr_storage, d.len),
        None => (std::ptr::null(), 0),
    };
    let total = header.len() + msg.len();
    let r = if !header.is_empty() && total <= COALESCE {
        let mut buf = [MaybeUninit::<u8>::uninit(); COALESCE];
        let start = buf.as_mut_ptr().cast::<u8>();
        // SAFETY: `buf` has room for both (`total <= COALESCE`); the first `total` bytes are
        // written here before the kernel reads them; source and destination do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(header.as_ptr(), start, header.len());
            std::ptr::copy_nonoverlapping(msg.as_ptr(), start.add(header.len()), msg.len());
            libc::sendto(
                fd,
                start.cast(),
                total,
                libc::MSG_DONTWAIT,
                name.cast(),
                namelen,
            )
        }
    } else if header.is_empty() {
        // SAFETY: `msg` and the address (when given) are live for the call; the kernel only
        // reads them.
        unsafe {
            libc::sendto(
                fd,
                msg.as_ptr().cast(),
                msg.len(),
                libc::MSG_DONTWAIT,
                name.cast(),
                namelen,
            )
        }
    } else {
        let mut iovs = [
            libc::iovec {
                iov_base: header.as_ptr() as *mut libc::c_void,
                iov_len: header.len(),
            },
            libc::iovec {
                iov_base: msg.as_ptr() as *mut libc::c_void,
                iov_len: msg.len(),
            },
        ];
        // SAFETY: plain old data.
        let mut h: libc::msghdr = unsafe { mem::zeroed() };
        h.msg_name = name as *mut libc::c_void;
        h.msg_namelen = namelen;
        h.msg_iov = iovs.as_mut_ptr();
        h.msg_iovlen = 2;
        // SAFETY: the header points at `iovs`, the two buffers and the address, all live for
        // the call; the kernel only reads them.
        unsafe { libc::sendmsg(fd, &h, libc::MSG_DONTWAIT) }
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(1)
}

/// A non-blocking UDP socket connected to `peer`, without an explicit `bind`: `connect(2)`
/// on an unbound datagram socket binds it to an ephemeral port, with the local address the
/// route to `peer` uses (one system call fewer than `bind` to the wildcard, then `connect`).
pub(crate) fn connected_udp(peer: &SocketAddr) -> io::Result<std::net::UdpSocket> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let family = match peer {
        SocketAddr::V4(_) => libc::AF_INET,
        SocketAddr::V6(_) => libc::AF_INET6,
    };
    // SAFETY: plain system call; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else; `OwnedFd` closes it on
    // every path below.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let raw = peer.to_raw();
    // SAFETY: `raw` holds a valid sockaddr of `raw.len` bytes for the socket's family.
    let rc = unsafe {
        libc::connect(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &raw.storage as *const _ as *const libc::sockaddr,
            raw.len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(std::net::UdpSocket::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inet_round_trip() {
        for a in ["127.0.0.1:9", "[::1]:65535", "10.1.2.3:0"] {
            let a: SocketAddr = a.parse().unwrap();
            assert_eq!(SocketAddr::from_raw(&a.to_raw()), Some(a));
        }
    }

    #[test]
    fn unix_round_trip() {
        for a in [
            UnixAddr::Path("/tmp/x.sock".into()),
            UnixAddr::Abstract(b"chunnel-test".to_vec()),
        ] {
            assert_eq!(UnixAddr::from_raw(&a.to_raw()), Some(a));
        }
    }

    #[test]
    fn unix_rejects_other_families() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(UnixAddr::from_raw(&a.to_raw()), None);
        assert!(UnixAddr::Path(PathBuf::new()).check().is_err());
        assert!(UnixAddr::Abstract(vec![b'x'; 200]).check().is_err());
    }
}
