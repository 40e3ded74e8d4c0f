//! XDP sharding offload: a third way to reach a shard, beside client push and server-side
//! forwarding (`chunnel_std::shard`), where the **server's kernel** picks the shard.
//!
//! [`ShardOffload`] loads `bpf/xdp_shard.c` (built by build.rs with clang) and attaches two
//! programs to the server's interface:
//!
//! * **XDP, ingress** (`xdp_shard`): a UDP datagram to the *steering address*
//!   ([`ShardOffloadConfig::steer`]) holds one bincode request of `chunnel-kv`
//!   (`Msg::Request { client, id, op }`, bincode 2 `standard()` varints); the program reads
//!   the key, computes `fnv1a64(key) % N` — [`shard_of`], the same function as
//!   `chunnel_std::shard::shard_of` — rewrites the UDP destination port to that shard's port,
//!   zeroes the UDP checksum (allowed for IPv4) and returns `XDP_PASS`: the kernel delivers
//!   the request **straight to the shard's own socket**, no forwarding hop. Keys up to
//!   [`MAX_KEY`] bytes; at most [`MAX_SHARDS`] shards.
//! * **tc egress** (`tc_shard_egress`, TCX on kernels ≥ 6.6): the shard's reply leaves from
//!   the shard's port; for peers the XDP program saw on the steering port (an LRU map of
//!   (address, port)) the program rewrites the source port back to the steering port, so the
//!   client — one *connected* UDP socket to the steering address — accepts it. Replies to
//!   other peers (client-push clients, which talk to the shard ports themselves) are left
//!   alone.
//!
//! No socket is bound to the steering port: the XDP program rewrites every request before
//! the kernel looks for one.
//!
//! ## As a negotiation option
//!
//! To a client, XDP sharding *is* client push to a single shard whose address is the
//! steering address: the client's sharding function has nothing to decide (`x % 1 = 0`) and
//! sends every request to one socket; the server's kernel does the rest. So the server offers
//! [`XdpShard`] — a wrapper around the canonical Chunnel (the forwarder, which still serves
//! whatever reaches the canonical address) whose capabilities the caller gives, typically
//! `chunnel_std::shard::advertisement(&[steer])` plus the label [`OFFLOAD_LABEL`]:
//!
//! ```text
//! server: select(XdpShard(forward, advertisement([steer]) + "offload=xdp"),
//!                select(advertise, forward)) | Serialize | Tagged<UDP>
//! client: select(ClientShard, ViaCanonical) | Serialize | Tagged<UDP>   (unchanged)
//! ```
//!
//! A client-push client matches the XDP option (the server's client-push rule accepts it),
//! learns the one steering address from the ACCEPT like any shard set, and never knows that
//! the kernel shards for it. [`XdpShard::check_available`] fails with
//! `Error::NotAvailable` and the reason when the offload is not attached (not root, no
//! clang-built object, the attach failed), so the select falls back to client push or
//! server-side forwarding. (This crate does not depend on `chunnel-std`, hence the
//! capabilities as a parameter.)
//!
//! Counters ([`ShardOffload::counters`], [`ShardOffload::steered`]) show where requests
//! went: per-shard steered counts prove the steering.

use std::borrow::Cow;
use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use aya::Ebpf;
use aya::maps::{Array, HashMap, MapData, PerCpuArray};
use aya::programs::{SchedClassifier, TcAttachType, Xdp, XdpMode};
use chunnel::{Capability, Chunnel, Error, Negotiate};

use crate::AttachMode;

/// Negotiation id of [`XdpShard`].
pub const SHARD_ID: &str = "chunnel-xdp/shard-offload/1";

/// Label added to the advertisement of the XDP option (informational: it tells the two
/// client-push options apart in the server's stack).
pub const OFFLOAD_LABEL: &str = "offload=xdp";

/// The most shards the program steers to (size of its port map).
pub const MAX_SHARDS: usize = 64;

/// The longest key the program hashes; requests with longer keys are not steered.
pub const MAX_KEY: usize = 256;

#[cfg(chunnel_xdp_shard_bpf)]
static EMBEDDED: Option<&[u8]> = Some(include_bytes!(concat!(env!("OUT_DIR"), "/xdp_shard.o")));
#[cfg(not(chunnel_xdp_shard_bpf))]
static EMBEDDED: Option<&[u8]> = None;
#[cfg(not(chunnel_xdp_shard_bpf))]
const EMBEDDED_ERROR: &str = env!("CHUNNEL_XDP_SHARD_BPF_ERROR");
#[cfg(chunnel_xdp_shard_bpf)]
const EMBEDDED_ERROR: &str = "";

/// 64-bit FNV-1a (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`): the function the
/// XDP program computes, identical to `chunnel_std::shard::fnv1a64`.
pub use chunnel::util::fnv1a64;

/// The shard the program picks for `key`: `fnv1a64(key) % shards` (0 when `shards` is 0),
/// identical to `chunnel_std::shard::shard_of`.
pub fn shard_of(key: &[u8], shards: usize) -> usize {
    if shards == 0 {
        return 0;
    }
    (fnv1a64(key) % shards as u64) as usize
}

fn not_available(reason: impl Into<String>) -> Error {
    Error::NotAvailable {
        chunnel: SHARD_ID,
        reason: reason.into(),
    }
}

/// Where and how to attach the offload.
#[derive(Clone, Debug)]
pub struct ShardOffloadConfig {
    /// The server's interface (where requests arrive and replies leave).
    pub interface: String,
    /// The steering address clients send to. Address `0.0.0.0` matches any destination
    /// address on the interface. Nothing should be bound to this port.
    pub steer: SocketAddrV4,
    /// The shards' UDP ports, by index (1..=[`MAX_SHARDS`]), on the same host.
    pub shard_ports: Vec<u16>,
    /// How to attach the XDP program (default: native, falling back to generic).
    pub mode: AttachMode,
    /// A BPF object file to load instead of the one embedded at build time.
    pub bpf_object: Option<PathBuf>,
}

impl ShardOffloadConfig {
    /// Steering `steer` on `interface` to `shard_ports`.
    pub fn new(interface: impl Into<String>, steer: SocketAddrV4, shard_ports: Vec<u16>) -> Self {
        ShardOffloadConfig {
            interface: interface.into(),
            steer,
            shard_ports,
            mode: AttachMode::Auto,
            bpf_object: None,
        }
    }
}

/// The offload's counters (summed over CPUs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardCounters {
    /// Every frame the XDP program saw.
    pub rx_total: u64,
    /// Requests steered to a shard.
    pub steered: u64,
    /// Frames not for the steering address: passed unchanged.
    pub passed: u64,
    /// Datagrams to the steering address that did not parse (or a key over [`MAX_KEY`]).
    pub malformed: u64,
    /// Replies whose source port the egress program rewrote to the steering port.
    pub egress_rewritten: u64,
}

/// The loaded and attached sharding offload; both programs are detached when it is dropped.
pub struct ShardOffload {
    ebpf: Ebpf,
    cfg: ShardOffloadConfig,
    mode: XdpMode,
}

impl std::fmt::Debug for ShardOffload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardOffload")
            .field("cfg", &self.cfg)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

/// Whether the crate was built with the sharding program embedded.
pub fn embedded_shard_program_available() -> bool {
    EMBEDDED.is_some()
}

fn object(path: Option<&Path>) -> Result<Cow<'static, [u8]>, String> {
    match path {
        Some(p) => std::fs::read(p)
            .map(Cow::Owned)
            .map_err(|e| format!("cannot read the XDP object {}: {e}", p.display())),
        None => EMBEDDED.map(Cow::Borrowed).ok_or_else(|| {
            format!(
                "the XDP sharding program was not built into this binary ({EMBEDDED_ERROR}); \
                 install clang and rebuild, or set ShardOffloadConfig::bpf_object"
            )
        }),
    }
}

fn chain(mut s: String, e: &dyn std::error::Error) -> String {
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(&format!(": {x}"));
        src = x.source();
    }
    s
}

impl ShardOffload {
    /// Checks privileges, loads the program, fills its maps and attaches both programs.
    /// Every failure is `Error::NotAvailable` with the reason.
    pub fn attach(cfg: ShardOffloadConfig) -> Result<ShardOffload, Error> {
        if cfg.shard_ports.is_empty() || cfg.shard_ports.len() > MAX_SHARDS {
            return Err(not_available(format!(
                "{} shards (1..={MAX_SHARDS} supported by the XDP program)",
                cfg.shard_ports.len()
            )));
        }
        if cfg.steer.port() == 0 || cfg.shard_ports.contains(&0) {
            return Err(not_available("port 0 cannot be steered"));
        }
        if let Some(caps) = crate::effective_caps() {
            let has = |c: u32| caps & (1u64 << c) != 0;
            if !has(crate::CAP_NET_ADMIN) || !(has(crate::CAP_BPF) || has(crate::CAP_SYS_ADMIN)) {
                return Err(not_available(
                    "the process lacks CAP_NET_ADMIN or CAP_BPF (run as root or grant them)",
                ));
            }
        }
        crate::ifindex(&cfg.interface)
            .map_err(|_| not_available(format!("no interface named {}", cfg.interface)))?;
        let obj = object(cfg.bpf_object.as_deref()).map_err(not_available)?;
        let mut ebpf = Ebpf::load(&obj)
            .map_err(|e| not_available(chain(format!("loading the XDP object: {e}"), &e)))?;
        {
            let mut config: Array<&mut MapData, [u8; 16]> = Array::try_from(
                ebpf.map_mut("config")
                    .ok_or_else(|| not_available("no `config` map"))?,
            )
            .map_err(|e| not_available(format!("map `config`: {e}")))?;
            let mut v = [0u8; 16];
            v[0..4].copy_from_slice(&cfg.steer.ip().octets());
            v[4..6].copy_from_slice(&cfg.steer.port().to_be_bytes());
            v[8..12].copy_from_slice(&(cfg.shard_ports.len() as u32).to_ne_bytes());
            config
                .set(0, v, 0)
                .map_err(|e| not_available(format!("writing map `config`: {e}")))?;
        }
        {
            let mut ports: Array<&mut MapData, u32> = Array::try_from(
                ebpf.map_mut("shard_ports")
                    .ok_or_else(|| not_available("no `shard_ports` map"))?,
            )
            .map_err(|e| not_available(format!("map `shard_ports`: {e}")))?;
            for (i, &p) in cfg.shard_ports.iter().enumerate() {
                let v = u32::from(u16::from_ne_bytes(p.to_be_bytes()));
                ports
                    .set(i as u32, v, 0)
                    .map_err(|e| not_available(format!("writing map `shard_ports`: {e}")))?;
            }
        }
        {
            let mut is: HashMap<&mut MapData, u32, u32> = HashMap::try_from(
                ebpf.map_mut("is_shard_port")
                    .ok_or_else(|| not_available("no `is_shard_port` map"))?,
            )
            .map_err(|e| not_available(format!("map `is_shard_port`: {e}")))?;
            for &p in &cfg.shard_ports {
                let k = u32::from(u16::from_ne_bytes(p.to_be_bytes()));
                is.insert(k, 1, 0)
                    .map_err(|e| not_available(format!("writing map `is_shard_port`: {e}")))?;
            }
        }
        let xdp: &mut Xdp = ebpf
            .program_mut("xdp_shard")
            .ok_or_else(|| not_available("the object has no program `xdp_shard`"))?
            .try_into()
            .map_err(|e| not_available(format!("program `xdp_shard`: {e}")))?;
        xdp.load().map_err(|e| {
            not_available(chain(
                format!("the kernel rejected the XDP program: {e}"),
                &e,
            ))
        })?;
        let modes: &[XdpMode] = match cfg.mode {
            AttachMode::Auto => &[XdpMode::Driver, XdpMode::Skb],
            AttachMode::Driver => &[XdpMode::Driver],
            AttachMode::Skb => &[XdpMode::Skb],
        };
        let mut attached = None;
        let mut last = String::new();
        for &m in modes {
            match xdp.attach(&cfg.interface, m) {
                Ok(_) => {
                    attached = Some(m);
                    break;
                }
                Err(e) => {
                    last = chain(
                        format!("attaching XDP to {} in {m:?} mode: {e}", cfg.interface),
                        &e,
                    );
                }
            }
        }
        let mode = attached.ok_or_else(|| not_available(last))?;
        let tc: &mut SchedClassifier = ebpf
            .program_mut("tc_shard_egress")
            .ok_or_else(|| not_available("the object has no program `tc_shard_egress`"))?
            .try_into()
            .map_err(|e| not_available(format!("program `tc_shard_egress`: {e}")))?;
        tc.load().map_err(|e| {
            not_available(chain(
                format!("the kernel rejected the tc program: {e}"),
                &e,
            ))
        })?;
        if let Err(e) = tc.attach(&cfg.interface, TcAttachType::Egress) {
            // Kernels before 6.6 need a clsact qdisc for netlink attachment.
            let _ = aya::programs::tc::qdisc_add_clsact(&cfg.interface);
            tc.attach(&cfg.interface, TcAttachType::Egress)
                .map_err(|e2| {
                    not_available(chain(
                        format!("attaching tc egress to {}: {e}; then {e2}", cfg.interface),
                        &e2,
                    ))
                })?;
        }
        Ok(ShardOffload { ebpf, cfg, mode })
    }

    /// The configuration.
    pub fn config(&self) -> &ShardOffloadConfig {
        &self.cfg
    }

    /// Whether the XDP program runs in driver (native) mode, else generic.
    pub fn native(&self) -> bool {
        self.mode == XdpMode::Driver
    }

    fn per_cpu_sum(&self, map: &str, i: u32) -> Result<u64, Error> {
        let m: PerCpuArray<&MapData, u64> = PerCpuArray::try_from(
            self.ebpf
                .map(map)
                .ok_or_else(|| not_available(format!("no `{map}` map")))?,
        )
        .map_err(|e| not_available(format!("map `{map}`: {e}")))?;
        Ok(m.get(&i, 0)
            .map_err(|e| not_available(format!("reading {map}[{i}]: {e}")))?
            .iter()
            .sum())
    }

    /// The program's counters.
    pub fn counters(&self) -> Result<ShardCounters, Error> {
        Ok(ShardCounters {
            rx_total: self.per_cpu_sum("counters", 0)?,
            steered: self.per_cpu_sum("counters", 1)?,
            passed: self.per_cpu_sum("counters", 2)?,
            malformed: self.per_cpu_sum("counters", 3)?,
            egress_rewritten: self.per_cpu_sum("counters", 4)?,
        })
    }

    /// Requests steered to each shard, by index.
    pub fn steered(&self) -> Result<Vec<u64>, Error> {
        (0..self.cfg.shard_ports.len() as u32)
            .map(|i| self.per_cpu_sum("steered", i))
            .collect()
    }
}

/// The XDP sharding option of a server's negotiated stack: wraps the canonical Chunnel
/// `inner` (which keeps serving whatever reaches the canonical address), offers the
/// capabilities given (see the [module docs](self)), and is available only while the offload
/// is attached.
#[derive(Clone, Debug)]
pub struct XdpShard<I> {
    inner: I,
    offload: Result<Arc<ShardOffload>, String>,
    caps: Vec<Capability>,
}

impl<I> XdpShard<I> {
    /// The option over `inner`, available when `offload` is `Ok`; `caps` is what it
    /// advertises (e.g. `chunnel_std::shard::advertisement(&[steer])` plus [`OFFLOAD_LABEL`]).
    pub fn new(inner: I, offload: Result<Arc<ShardOffload>, Error>, caps: Vec<Capability>) -> Self {
        XdpShard {
            inner,
            offload: offload.map_err(|e| match e {
                Error::NotAvailable { reason, .. } => reason,
                e => e.to_string(),
            }),
            caps,
        }
    }

    /// The offload, when attached.
    pub fn offload(&self) -> Option<&Arc<ShardOffload>> {
        self.offload.as_ref().ok()
    }
}

impl<I> Negotiate for XdpShard<I> {
    fn id(&self) -> &'static str {
        SHARD_ID
    }

    fn capabilities(&self) -> Vec<Capability> {
        self.caps.clone()
    }

    fn check_available(&self) -> Result<(), Error> {
        match &self.offload {
            Ok(_) => Ok(()),
            Err(reason) => Err(not_available(reason.clone())),
        }
    }
}

impl<C, I> Chunnel<C> for XdpShard<I>
where
    I: Chunnel<C> + Send,
    C: Send,
{
    type Connection = I::Connection;

    fn connect_wrap(
        &mut self,
        inner: C,
    ) -> impl std::future::Future<Output = Result<Self::Connection, Error>> + Send {
        self.inner.connect_wrap(inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_known_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(shard_of(b"x", 0), 0);
    }

    #[test]
    fn unavailable_without_offload() {
        let s = XdpShard::new((), Err(not_available("test reason")), Vec::new());
        match s.check_available() {
            Err(Error::NotAvailable { chunnel, reason }) => {
                assert_eq!(chunnel, SHARD_ID);
                assert_eq!(reason, "test reason");
            }
            r => panic!("{r:?}"),
        }
    }
}
