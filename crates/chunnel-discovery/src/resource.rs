//! What an implementation needs from the machine, checked when a select is built.

use std::ffi::CString;
use std::fmt;
use std::path::{Path, PathBuf};

/// A resource an implementation needs (HotNets §4.2: "a set of resource requirements",
/// used when deciding which implementation to use). Each is checked on this host, at the
/// moment a select is built ([`crate::Registry::select`]); a candidate whose resource is
/// missing is skipped with [`crate::Skip::MissingResource`] naming it and why.
///
/// ```
/// use chunnel_discovery::Resource;
/// // A custom check: anything a function can decide.
/// let r = Resource::custom("a license file", || Err("no /etc/license".into()));
/// assert!(r.check().unwrap_err().contains("license"));
/// assert!(Resource::TlsIdentity { cert: "/nonexistent".into(), key: "/nonexistent".into() }
///     .check()
///     .is_err());
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub enum Resource {
    /// The process runs as root (effective uid 0): XDP programs, raw sockets, `ethtool`.
    Root,
    /// A peer that can be co-located: this end's half is a writable shared-memory directory
    /// (a tmpfs). Whether the peer really shares it is decided by negotiation (the
    /// implementation's exact capability must match at both ends), not here.
    CoLocatedPeer {
        /// The shared-memory directory (usually `/dev/shm`).
        dir: PathBuf,
    },
    /// io_uring works in this process (kernel support, not disabled by sysctl or seccomp).
    /// Needs the `uring` feature, which runs chunnel-uring's probe; without it the resource
    /// is reported missing ("built without the `uring` feature").
    IoUring,
    /// An interface AF_XDP can attach to: it exists, and the process is root (loading an XDP
    /// program needs CAP_BPF and CAP_NET_ADMIN). Whether the driver takes the program is only
    /// known when attaching; chunnel-xdp's listener then reports `NotAvailable` and the
    /// select falls back.
    XdpInterface {
        /// The interface name, e.g. `eth0`.
        interface: String,
    },
    /// A TLS identity: a certificate chain and its private key, both readable files.
    TlsIdentity {
        /// PEM certificate chain.
        cert: PathBuf,
        /// PEM private key.
        key: PathBuf,
    },
    /// Anything else: a name for reports and a check (`Err` with the reason).
    Custom {
        /// What the resource is, for reports.
        name: String,
        /// The check.
        check: fn() -> Result<(), String>,
    },
}

impl Resource {
    /// A custom resource (see [`Resource::Custom`]).
    pub fn custom(name: impl Into<String>, check: fn() -> Result<(), String>) -> Self {
        Resource::Custom {
            name: name.into(),
            check,
        }
    }

    /// A co-located peer through `/dev/shm`.
    pub fn co_located_peer() -> Self {
        Resource::CoLocatedPeer {
            dir: PathBuf::from("/dev/shm"),
        }
    }

    /// Whether the resource is here; `Err` says why not.
    pub fn check(&self) -> Result<(), String> {
        match self {
            Resource::Root => {
                // SAFETY: geteuid has no preconditions and cannot fail.
                let euid = unsafe { libc::geteuid() };
                if euid == 0 {
                    Ok(())
                } else {
                    Err(format!("the process is not root (euid {euid})"))
                }
            }
            Resource::CoLocatedPeer { dir } => writable_dir(dir),
            Resource::IoUring => io_uring(),
            Resource::XdpInterface { interface } => {
                let sys = Path::new("/sys/class/net").join(interface);
                if !sys.exists() {
                    return Err(format!("no network interface `{interface}`"));
                }
                Resource::Root.check()
            }
            Resource::TlsIdentity { cert, key } => {
                for p in [cert, key] {
                    std::fs::File::open(p)
                        .map_err(|e| format!("cannot read {}: {e}", p.display()))?;
                }
                Ok(())
            }
            Resource::Custom { check, .. } => check(),
        }
    }
}

fn writable_dir(dir: &Path) -> Result<(), String> {
    let meta = std::fs::metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !meta.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    let c = CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{} contains a NUL byte", dir.display()))?;
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK) } == 0 {
        Ok(())
    } else {
        Err(format!(
            "{} is not writable: {}",
            dir.display(),
            std::io::Error::last_os_error()
        ))
    }
}

#[cfg(feature = "uring")]
fn io_uring() -> Result<(), String> {
    chunnel_uring::check_available().map_err(|e| e.to_string())
}

#[cfg(not(feature = "uring"))]
fn io_uring() -> Result<(), String> {
    Err("built without the `uring` feature".into())
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Resource::Root => f.write_str("root"),
            Resource::CoLocatedPeer { dir } => {
                write!(f, "a co-located peer (shared memory in {})", dir.display())
            }
            Resource::IoUring => f.write_str("io_uring"),
            Resource::XdpInterface { interface } => {
                write!(f, "an XDP-capable interface ({interface})")
            }
            Resource::TlsIdentity { cert, .. } => {
                write!(f, "a TLS identity ({})", cert.display())
            }
            Resource::Custom { name, .. } => f.write_str(name),
        }
    }
}

impl fmt::Debug for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Resource({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_look_at_the_machine() {
        // SAFETY: no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert_eq!(Resource::Root.check().is_ok(), root);
        let e = Resource::XdpInterface {
            interface: "chunnel-none0".into(),
        }
        .check()
        .unwrap_err();
        assert!(e.contains("no network interface `chunnel-none0`"), "{e}");
        assert_eq!(
            Resource::XdpInterface {
                interface: "lo".into()
            }
            .check()
            .is_ok(),
            root
        );

        let dir = std::env::temp_dir().join(format!("chunnel-disc-res-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        let tls = Resource::TlsIdentity {
            cert: cert.clone(),
            key: key.clone(),
        };
        assert!(tls.check().unwrap_err().contains("cert.pem"));
        std::fs::write(&cert, "c").unwrap();
        assert!(tls.check().unwrap_err().contains("key.pem"));
        std::fs::write(&key, "k").unwrap();
        assert_eq!(tls.check(), Ok(()));

        assert_eq!(Resource::CoLocatedPeer { dir: dir.clone() }.check(), Ok(()));
        let e = Resource::CoLocatedPeer {
            dir: dir.join("cert.pem"),
        }
        .check()
        .unwrap_err();
        assert!(e.contains("not a directory"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(Resource::CoLocatedPeer { dir }.check().is_err());

        #[cfg(not(feature = "uring"))]
        assert_eq!(
            Resource::IoUring.check(),
            Err("built without the `uring` feature".into())
        );
        #[cfg(feature = "uring")]
        assert_eq!(
            Resource::IoUring.check().is_ok(),
            chunnel_uring::check_available().is_ok()
        );
        assert_eq!(Resource::IoUring.to_string(), "io_uring");
    }
}
