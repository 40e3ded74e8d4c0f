//! The `datapaths` and `xdp` sections: every datapath against its raw baseline, Figure 7,
//! AF_XDP alone and at both ends.

use std::fmt::Write as _;

use serde_json::Value;

use super::*;

// ---- datapaths ---------------------------------------------------------------------------

const DATAPATHS: [(&str, &str); 4] = [
    ("kernel_udp", "kernel UDP (raw: tokio `UdpSocket` echo)"),
    (
        "io_uring",
        "io_uring (raw: `io-uring` crate echo blocking in `io_uring_enter`)",
    ),
    (
        "shared_memory",
        "shared memory (raw: the same SPSC ring without the library)",
    ),
    ("af_xdp", "AF_XDP (raw: the XSK socket driven by hand)"),
];

pub(super) fn datapaths(r: &Value, s: &mut Section) {
    let d = &r["datapaths"];
    let mut t = String::from(
        "| datapath | raw p50 µs | library p50 µs | library / raw p50 | 64 B msg/s raw → \
         library | bar |\n|---|---:|---:|---:|---|---|\n",
    );
    let mut claims = Vec::new();
    let rows = DATAPATHS.iter().map(|&(k, label)| (label, &d[k])).chain([(
        "AF_XDP at both ends (raw: XSK loops at both ends)",
        &d["af_xdp"]["both_ends"],
    )]);
    for (label, x) in rows {
        if let Some(why) = x["skipped"].as_str() {
            let _ = writeln!(t, "| {label} | – | – | – | – | not measured: {why} |");
            continue;
        }
        if !x.is_object() {
            continue;
        }
        let raw = spread(&x["raw"]["rtt_p50_us"]);
        let lib = spread(&x["library"]["rtt_p50_us"]);
        let small = med(raw) < 10.0;
        let rt = spread(&x["p50_ratio_lib_over_raw"]);
        let diff = x["p50_lib_minus_raw_us"]
            .as_f64()
            .unwrap_or(med(lib) - med(raw));
        let shown = if small {
            format!("{diff:+.2} µs")
        } else {
            ratio(rt)
        };
        let ok = x["meets_bar"].as_bool();
        let bar = if small {
            format!("{} (≤ 1 µs above)", met(ok))
        } else {
            format!("{} (≤ 1.10)", met(ok))
        };
        let short = label.split(" (").next().unwrap_or(label);
        claims.push(format!("{short} {shown}"));
        s.headline(
            "datapaths",
            format!("{short}: library p50 vs raw"),
            shown.clone(),
            if small { "≤ +1 µs" } else { "≤ 1.10" },
            ok,
        );
        let _ = writeln!(
            t,
            "| {label} | {} | {} | {shown} | {} → {} | {bar} |",
            us_sp(raw),
            us_sp(lib),
            rate(med(spread(&x["raw"]["msgs_per_s_64b"]))),
            rate(med(spread(&x["library"]["msgs_per_s_64b"]))),
        );
    }
    super::lent::lent(r, s);
    let shm = spread(&d["shared_memory"]["p50_ratio_udp_over_shm"]);
    let all = r["checks"]["all_measured_datapaths_meet_bar"].as_bool();
    s.part(
        "claim",
        format!(
            "**Every datapath through the library is within its bar of the same technology used \
             directly** ({}): library / raw p50 {} ({} of 5 repetitions). Shared memory vs UDP \
             through the same negotiation: **{}×** lower p50 (bar ≥ 5×).",
            if all == Some(true) {
                "all met"
            } else {
                "**not all met**"
            },
            claims.join(", "),
            "median [min–max]",
            ratio(shm)
        )
        .replace(
            "**Every datapath through the library is within its bar of the same technology used \
             directly** (**not all met**)",
            "**Not every datapath through the library is within its bar of the same technology \
             used directly**",
        )
        .replace(
            " of 5 repetitions",
            &format!(" of {} repetitions", r["reps"]),
        ),
    );
    s.part(
        "plot",
        plot(
            "datapaths",
            "library p50 relative to each datapath's raw baseline",
        ),
    );
    s.part("table", t);

    let f7 = &r["figure7"];
    if let Some(rows) = f7["results"].as_array() {
        let layers: Vec<u64> = f7["layers"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let sizes: Vec<u64> = f7["sizes"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let mut t = String::from("| size |");
        for l in &layers {
            let _ = write!(t, " {l}{} |", if *l == 0 { " layers" } else { "" });
        }
        t.push_str("\n|---|");
        for _ in &layers {
            t.push_str("---:|");
        }
        t.push('\n');
        let mut worst: f64 = 0.0;
        for size in &sizes {
            let _ = write!(t, "| {size} B |");
            for l in &layers {
                let x = rows.iter().find(|x| {
                    x["size"].as_u64() == Some(*size) && x["layers"].as_u64() == Some(*l)
                });
                let p = x.and_then(|x| spread(&x["rtt_p50_us"]));
                let rt = x.and_then(|x| spread(&x["p50_ratio_to_0_layers"]));
                if *l == 0 {
                    let _ = write!(t, " {:.3} |", med(p));
                } else {
                    let _ = write!(t, " {:.3} ({:.2}) |", med(p), med(rt));
                }
                if let (Some(p), Some(z)) = (
                    p,
                    rows.iter()
                        .find(|x| {
                            x["size"].as_u64() == Some(*size) && x["layers"].as_u64() == Some(0)
                        })
                        .and_then(|x| spread(&x["rtt_p50_us"])),
                ) {
                    worst = worst.max(p.med - z.med);
                }
            }
            t.push('\n');
        }
        let _ = write!(
            t,
            "\nFive no-op layers add at most {:.0} ns per round trip on the fastest datapath (the \
             clock's resolution here is ~10 ns).",
            worst * 1000.0
        );
        s.part("figure7", t);
        s.part(
            "figure7_plot",
            plot(
                "figure7",
                "Figure 7 on shared memory: p50 against layers per message size",
            ),
        );
    }
}

pub(super) fn xdp(r: &Value, s: &mut Section) {
    let x = &r["af_xdp"];
    super::lent::xdp_lent(x, s);
    if let Some(why) = x["skipped"].as_str() {
        s.part("claim", format!("Not measured in this run: {why}."));
        return;
    }
    let rt = spread(&x["p50_ratio_lib_over_raw"]);
    let ok = x["meets_bar"].as_bool();
    s.part(
        "claim",
        format!(
            "**The AF_XDP library's round trip is {}× the raw XSK loop's** (p50, {}; raw {} µs, \
             library {} µs; bar ≤ 1.10 — {}); every echoed request was redirected to the socket: \
             {}.",
            ratio(rt),
            reps(rt),
            us_sp(spread(&x["raw"]["rtt_p50_us"])),
            us_sp(spread(&x["library"]["rtt_p50_us"])),
            met(ok),
            if x["all_requests_redirected"].as_bool() == Some(true) {
                "yes"
            } else {
                "**no**"
            }
        ),
    );
    s.headline(
        "xdp",
        "AF_XDP library p50 / raw XSK loop",
        ratio(rt),
        "≤ 1.10",
        ok,
    );
    let b = &x["both_ends"];
    if b.is_object() {
        let rt = spread(&b["p50_ratio_lib_over_raw"]);
        let tr = spread(&b["throughput_ratio_lib_over_raw"]);
        let ok = b["meets_bar"].as_bool();
        s.part(
            "both",
            format!(
                "**With AF_XDP at both ends (`AfXdpConnect` against the listener), the round \
                 trip is {}× a raw XSK client loop against the raw echo loop** (p50, {}; raw {} \
                 µs, library {} µs; bar ≤ 1.10 — {}); 64 B throughput {}× raw. Both programs' \
                 counters show every request and every echo redirected to an AF_XDP socket: {}.",
                ratio(rt),
                reps(rt),
                us_sp(spread(&b["raw"]["rtt_p50_us"])),
                us_sp(spread(&b["library"]["rtt_p50_us"])),
                met(ok),
                ratio(tr),
                if b["all_redirected_both_directions"].as_bool() == Some(true) {
                    "yes"
                } else {
                    "**no**"
                }
            ),
        );
        s.headline(
            "xdp",
            "AF_XDP both ends: library p50 / raw XSK loops",
            ratio(rt),
            "≤ 1.10",
            ok,
        );
    }
}
