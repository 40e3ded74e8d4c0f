//! Builds the XDP programs with clang when clang is available: bpf/xdp_udp_steer.c (the
//! AF_XDP datapath) and bpf/xdp_shard.c (the sharding offload, `src/shard.rs`).
//!
//! Each object is embedded in the library (`include_bytes!`) under `cfg(chunnel_xdp_bpf)`
//! (resp. `cfg(chunnel_xdp_shard_bpf)`, failure reason in `CHUNNEL_XDP_SHARD_BPF_ERROR`). If
//! clang is missing or fails, the crate still builds: the datapath then reports
//! `Error::NotAvailable` with the reason recorded here (`CHUNNEL_XDP_BPF_ERROR`), unless a
//! prebuilt object is given at run time (`Config::bpf_object`, built by scripts/build-bpf.sh).
//!
//! Environment: `CHUNNEL_XDP_CLANG` (default `clang`), `CHUNNEL_XDP_NO_BPF=1` (skip, to test
//! the fallback build).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(chunnel_xdp_bpf)");
    println!("cargo::rustc-check-cfg=cfg(chunnel_xdp_shard_bpf)");
    println!("cargo::rerun-if-changed=bpf/xdp_udp_steer.c");
    println!("cargo::rerun-if-changed=bpf/xdp_shard.c");
    println!("cargo::rerun-if-env-changed=CHUNNEL_XDP_CLANG");
    println!("cargo::rerun-if-env-changed=CHUNNEL_XDP_NO_BPF");

    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let obj = out.join("xdp_udp_steer.o");
    let _ = std::fs::remove_file(&obj);
    let error = if std::env::var_os("CHUNNEL_XDP_NO_BPF").is_some() {
        Some("built with CHUNNEL_XDP_NO_BPF set".to_string())
    } else {
        build("bpf/xdp_udp_steer.c", &obj).err()
    };
    match error {
        None => println!("cargo::rustc-cfg=chunnel_xdp_bpf"),
        Some(e) => {
            println!(
                "cargo::warning=chunnel-xdp: XDP program not built ({e}); the AF_XDP datapath will report NotAvailable"
            );
            let e = e.replace(['\n', '\r'], " ");
            println!("cargo::rustc-env=CHUNNEL_XDP_BPF_ERROR={e}");
        }
    }

    // The sharding offload (bpf/xdp_shard.c, src/shard.rs): same rules, its own cfg.
    let shard_obj = out.join("xdp_shard.o");
    let _ = std::fs::remove_file(&shard_obj);
    let error = if std::env::var_os("CHUNNEL_XDP_NO_BPF").is_some() {
        Some("built with CHUNNEL_XDP_NO_BPF set".to_string())
    } else {
        build("bpf/xdp_shard.c", &shard_obj).err()
    };
    match error {
        None => println!("cargo::rustc-cfg=chunnel_xdp_shard_bpf"),
        Some(e) => {
            println!(
                "cargo::warning=chunnel-xdp: XDP sharding program not built ({e}); the sharding offload will report NotAvailable"
            );
            let e = e.replace(['\n', '\r'], " ");
            println!("cargo::rustc-env=CHUNNEL_XDP_SHARD_BPF_ERROR={e}");
        }
    }
}

fn build(src: &str, obj: &std::path::Path) -> Result<(), String> {
    let clang = std::env::var("CHUNNEL_XDP_CLANG").unwrap_or_else(|_| "clang".into());
    let mut cmd = Command::new(&clang);
    cmd.args(["-O2", "-g", "-target", "bpf", "-Wall"]);
    // Debian/Ubuntu keep asm/types.h under the multiarch directory.
    if let Ok(arch) = std::env::var("CARGO_CFG_TARGET_ARCH") {
        let multiarch = format!("/usr/include/{arch}-linux-gnu");
        if std::path::Path::new(&multiarch).is_dir() {
            cmd.arg(format!("-I{multiarch}"));
        }
    }
    cmd.arg("-c").arg(src).arg("-o").arg(obj);
    let output = cmd
        .output()
        .map_err(|e| format!("cannot run `{clang}` (install clang): {e}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let first = stderr.lines().find(|l| l.contains("error")).unwrap_or("");
        return Err(format!("`{clang}` failed: {first}"));
    }
    Ok(())
}
