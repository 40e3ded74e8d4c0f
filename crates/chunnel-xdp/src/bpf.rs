//! Loading and attaching the XDP program (bpf/xdp_udp_steer.c) with aya, and reading its
//! counters.

use std::borrow::Cow;
use std::net::SocketAddrV4;
use std::os::fd::RawFd;
use std::path::Path;

use aya::Ebpf;
use aya::maps::{Array, MapData, PerCpuArray, XskMap};
use aya::programs::{Xdp, XdpMode};

/// The program's name in the object (its function name).
const PROGRAM: &str = "xdp_udp_steer";

/// The object built by build.rs, if clang was available.
#[cfg(chunnel_xdp_bpf)]
static EMBEDDED: Option<&[u8]> = Some(include_bytes!(concat!(env!("OUT_DIR"), "/xdp_udp_steer.o")));
#[cfg(not(chunnel_xdp_bpf))]
static EMBEDDED: Option<&[u8]> = None;

/// Why the embedded object is missing (set by build.rs).
#[cfg(not(chunnel_xdp_bpf))]
const EMBEDDED_ERROR: &str = env!("CHUNNEL_XDP_BPF_ERROR");
#[cfg(chunnel_xdp_bpf)]
const EMBEDDED_ERROR: &str = "";

/// Whether the crate was built with the XDP program embedded.
pub fn embedded_program_available() -> bool {
    EMBEDDED.is_some()
}

/// The object's bytes: `path` if given, else the embedded one.
pub(crate) fn object(path: Option<&Path>) -> Result<Cow<'static, [u8]>, String> {
    match path {
        Some(p) => std::fs::read(p)
            .map(Cow::Owned)
            .map_err(|e| format!("cannot read the XDP object {}: {e}", p.display())),
        None => EMBEDDED.map(Cow::Borrowed).ok_or_else(|| {
            format!(
                "the XDP program was not built into this binary ({EMBEDDED_ERROR}); install \
                 clang and rebuild, or set Config::bpf_object to an object built by \
                 crates/chunnel-xdp/scripts/build-bpf.sh"
            )
        }),
    }
}

/// The per-verdict counters of the XDP program (summed over CPUs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Every frame the program saw on the interface.
    pub rx_total: u64,
    /// Frames steered to the AF_XDP socket.
    pub redirected: u64,
    /// Frames that were not this datapath's (ARP, other ports...): passed to the kernel.
    pub passed: u64,
    /// Frames that matched but found no socket on their queue: passed to the kernel.
    pub no_socket: u64,
}

/// How to attach the program.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttachMode {
    /// Native (driver) mode, falling back to generic (skb) mode.
    #[default]
    Auto,
    /// Native (driver) mode only.
    Driver,
    /// Generic (skb) mode only.
    Skb,
}

/// A loaded and attached program; detached when dropped.
pub(crate) struct Program {
    ebpf: Ebpf,
    pub(crate) mode: XdpMode,
}

impl std::fmt::Debug for Program {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Program").field("mode", &self.mode).finish()
    }
}

impl Program {
    /// Loads `obj`, configures it to steer UDP to `local`, registers `xsk_fd` for `queue`
    /// and attaches to `ifname`.
    pub(crate) fn load(
        obj: &[u8],
        ifname: &str,
        mode: AttachMode,
        local: SocketAddrV4,
        queue: u32,
        xsk_fd: RawFd,
    ) -> Result<Program, String> {
        let mut ebpf = Ebpf::load(obj).map_err(|e| format!("loading the XDP object: {e}"))?;
        {
            let mut cfg: Array<&mut MapData, [u8; 8]> = Array::try_from(
                ebpf.map_mut("config")
                    .ok_or("the object has no `config` map")?,
            )
            .map_err(|e| format!("map `config`: {e}"))?;
            let mut v = [0u8; 8];
            v[0..4].copy_from_slice(&local.ip().octets());
            v[4..6].copy_from_slice(&local.port().to_be_bytes());
            cfg.set(0, v, 0)
                .map_err(|e| format!("writing map `config`: {e}"))?;
        }
        {
            let mut xsks = XskMap::try_from(ebpf.map_mut("xsks").ok_or("no `xsks` map")?)
                .map_err(|e| format!("map `xsks`: {e}"))?;
            xsks.set(queue, xsk_fd, 0)
                .map_err(|e| format!("registering the AF_XDP socket in `xsks`: {e}"))?;
        }
        let prog: &mut Xdp = ebpf
            .program_mut(PROGRAM)
            .ok_or_else(|| format!("the object has no program `{PROGRAM}`"))?
            .try_into()
            .map_err(|e| format!("program `{PROGRAM}`: {e}"))?;
        prog.load()
            .map_err(|e| format!("the kernel rejected the XDP program: {e}"))?;
        let modes: &[XdpMode] = match mode {
            AttachMode::Auto => &[XdpMode::Driver, XdpMode::Skb],
            AttachMode::Driver => &[XdpMode::Driver],
            AttachMode::Skb => &[XdpMode::Skb],
        };
        let mut last = String::new();
        for &m in modes {
            match prog.attach(ifname, m) {
                Ok(_link) => return Ok(Program { ebpf, mode: m }),
                Err(e) => {
                    last = format!("attaching to {ifname} in {m:?} mode: {e}");
                    // aya's error Display hides the errno; keep the chain.
                    let mut src = std::error::Error::source(&e);
                    while let Some(s) = src {
                        last.push_str(&format!(": {s}"));
                        src = s.source();
                    }
                }
            }
        }
        Err(last)
    }

    /// Reads the counters.
    pub(crate) fn counters(&self) -> Result<Counters, String> {
        let map: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(self.ebpf.map("counters").ok_or("no `counters` map")?)
                .map_err(|e| format!("map `counters`: {e}"))?;
        let get = |i: u32| -> Result<u64, String> {
            Ok(map
                .get(&i, 0)
                .map_err(|e| format!("reading counter {i}: {e}"))?
                .iter()
                .sum())
        };
        Ok(Counters {
            rx_total: get(0)?,
            redirected: get(1)?,
            passed: get(2)?,
            no_socket: get(3)?,
        })
    }
}
