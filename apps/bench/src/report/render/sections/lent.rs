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
    let mut t = String::from(
        "| datapath | size | copying msg/s | lent msg/s | lent / copying | raw p50 µs | lent \
         p50 µs | bar |\n|---|---:|---:|---:|---:|---:|---:|---|\n",
    );
    for x in rows {
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
    if let Some(skip) = l["io_uring_skipped"].as_str() {
        let _ = write!(t, "\nio_uring not measured: {skip}.\n");
    }
    s.part("lent", t);
}
