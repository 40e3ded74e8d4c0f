//! The lent-buffer rows of `datapaths` (`result.lent`, from `lent.rs`).

use std::fmt::Write as _;

use serde_json::Value;

use super::{Section, med, met, rate, ratio, spread, us_sp};

pub(super) fn lent(r: &Value, s: &mut Section) {
    let l = &r["lent"];
    let Some(rows) = l["results"].as_array() else {
        let why = l["skipped"]
            .as_str()
            .unwrap_or("this run has no lent-buffer figures");
        s.part("lent", format!("Lent buffers: not measured ({why})."));
        return;
    };
    let mut t = String::from(HEADER);
    for x in rows {
        row(&mut t, x);
    }
    // The AF_XDP client's row, when this run has it (`af_xdp.lent`, from `xdp.rs`).
    if let Some(xs) = r["datapaths"]["af_xdp"]["lent"]["results"].as_array() {
        for x in xs {
            row(&mut t, x);
        }
    }
    if let Some(skip) = l["io_uring_skipped"].as_str() {
        let _ = write!(t, "\nio_uring not measured: {skip}.\n");
    }
    s.part("lent", t);
}

const HEADER: &str = "| datapath | size | copying msg/s | lent msg/s | lent / copying | raw p50 µs | lent \
                      p50 µs | bar |\n|---|---:|---:|---:|---:|---:|---:|---|\n";

/// One row of the lent table.
fn row(t: &mut String, x: &Value) {
    let raw = spread(&x["raw_rtt_p50_us"]);
    let lent = spread(&x["lent_rtt_p50_us"]);
    let small = med(raw) < 10.0;
    let bar = if small {
        format!(
            "{} ({:+.2} µs; ≤ 1 µs above)",
            met(x["meets_bar"].as_bool()),
            x["p50_lent_minus_raw_us"].as_f64().unwrap_or(f64::NAN)
        )
    } else {
        format!(
            "{} ({}; ≤ 1.10)",
            met(x["meets_bar"].as_bool()),
            ratio(spread(&x["p50_ratio_lent_over_raw"]))
        )
    };
    let _ = writeln!(
        t,
        "| {} | {} B | {} | {} | {} | {} | {} | {bar} |",
        x["datapath"].as_str().unwrap_or("?").replace('_', " "),
        x["size"],
        rate(med(spread(&x["copy_msgs_per_s"]))),
        rate(med(spread(&x["lent_msgs_per_s"]))),
        ratio(spread(&x["throughput_ratio_lent_over_copy"])),
        us_sp(raw),
        us_sp(lent),
    );
}

/// `{{xdp.lent}}`: the AF_XDP client's lent buffers (`af_xdp.lent` of `chunnel-bench xdp`).
pub(super) fn xdp_lent(x: &Value, s: &mut Section) {
    let l = &x["lent"];
    let Some(rows) = l["results"].as_array() else {
        let why = l["skipped"]
            .as_str()
            .or(x["skipped"].as_str())
            .unwrap_or("this run predates the AF_XDP lent variant");
        s.part(
            "lent",
            format!("AF_XDP lent buffers: not measured ({why})."),
        );
        return;
    };
    let mut t = String::from(HEADER);
    for r in rows {
        row(&mut t, r);
    }
    for r in rows {
        let st = |k: &str, f: &str| r[k][f].as_u64().map_or("?".into(), |v| v.to_string());
        let _ = write!(
            t,
            "\nAF_XDP client, {} B, copying p50 {} µs; datapath copies over the lent runs: {} on \
             receive, {} on send ({} received and {} sent lent); {}.\n",
            r["size"],
            us_sp(spread(&r["copy_rtt_p50_us"])),
            st("lend_stats_lent_path", "rx_copied"),
            st("lend_stats_lent_path", "tx_copied"),
            st("lend_stats_lent_path", "rx_lent"),
            st("lend_stats_lent_path", "tx_lent"),
            l["sizes_note"]
                .as_str()
                .unwrap_or("UMEM frames are 2048 B: no 8 KiB"),
        );
    }
    s.part("lent", t);
}
