//! The `secure` section: TLS and QUIC against tokio-rustls and quinn, and the negotiated
//! secure connect.

use std::fmt::Write as _;

use serde_json::Value;

use super::*;

// ---- secure ------------------------------------------------------------------------------

pub(super) fn secure(r: &Value, s: &mut Section) {
    let t = &r["transports"];
    let tls = &t["tls_over_tcp"];
    let quic = &t["quic_stream"];
    let rr = |x: &Value, k: &str| spread(&x["ratios_library_over_raw"][k]);
    let neg = &r["negotiated"];
    let reco = spread(&neg["ratios_over_raw_quinn"]["connect_first_echo_p50"]);
    let echo_ok = |x: &Value| rr(x, "echo_p50").map(|v| v.med <= 1.05);
    let bulk_ok = |x: &Value| rr(x, "bulk_throughput").map(|v| v.med >= 0.95);
    let cpu_ok = |x: &Value| rr(x, "bulk_throughput_per_cpu_s").map(|v| v.med >= 0.95);
    let reco_ok = reco.map(|v| v.med <= 1.1);
    s.part(
        "claim",
        format!(
            "**Echo round trip through the library: {}× tokio-rustls (TLS) and {}× quinn \
             (QUIC)** (p50, {}; bar ≤ 1.05 — {} and {}). **Bulk throughput per CPU-second: {}× \
             (TLS) and {}× (QUIC)** (bar ≥ 0.95 — {} and {}; wall-clock {}× and {}×). **A \
             negotiated `select(quic, tls)` reconnect + first echo is {}× raw quinn's** (bar ≤ \
             1.1 — {}).",
            ratio(rr(tls, "echo_p50")),
            ratio(rr(quic, "echo_p50")),
            reps(rr(tls, "echo_p50")),
            met(echo_ok(tls)),
            met(echo_ok(quic)),
            ratio(rr(tls, "bulk_throughput_per_cpu_s")),
            ratio(rr(quic, "bulk_throughput_per_cpu_s")),
            met(cpu_ok(tls)),
            met(cpu_ok(quic)),
            ratio(rr(tls, "bulk_throughput")),
            ratio(rr(quic, "bulk_throughput")),
            ratio(reco),
            met(reco_ok),
        ),
    );
    for (name, x) in [("TLS", tls), ("QUIC", quic)] {
        s.headline(
            "secure",
            format!("{name} echo p50 / raw"),
            ratio(rr(x, "echo_p50")),
            "≤ 1.05",
            echo_ok(x),
        );
        s.headline(
            "secure",
            format!("{name} bulk MiB per CPU-s / raw"),
            ratio(rr(x, "bulk_throughput_per_cpu_s")),
            "≥ 0.95",
            cpu_ok(x),
        );
    }
    s.headline(
        "secure",
        "negotiated QUIC reconnect + first echo / raw quinn",
        ratio(reco),
        "≤ 1.1",
        reco_ok,
    );
    s.part(
        "plot",
        plot(
            "secure",
            "library / raw ratios for TLS and QUIC: connect, echo, bulk",
        ),
    );
    let mut tb =
        String::from("| | raw | library | library / raw | bar |\n|---|---:|---:|---:|---|\n");
    for (name, x) in [("TLS", tls), ("QUIC", quic)] {
        let row = |what: &str, key: &str, rkey: &str, bar: String, mibs: bool| {
            let f = |sp: Option<Spread>| {
                if mibs {
                    sp.map_or("–".into(), |s| {
                        if s.min == s.max {
                            format!("{:.0}", s.med)
                        } else {
                            format!("{:.0} [{:.0}–{:.0}]", s.med, s.min, s.max)
                        }
                    })
                } else {
                    us_sp(sp)
                }
            };
            format!(
                "| {name} {what} | {} | {} | {} | {bar} |\n",
                f(spread(&x["raw"][key])),
                f(spread(&x["library"][key])),
                ratio(rr(x, rkey)),
            )
        };
        tb.push_str(&row(
            "connect + first echo p50 µs",
            "connect_first_echo_p50_us",
            "connect_first_echo_p50",
            "–".into(),
            false,
        ));
        tb.push_str(&row(
            "echo p50 µs",
            "echo_p50_us",
            "echo_p50",
            format!("≤ 1.05 — {}", met(echo_ok(x))),
            false,
        ));
        tb.push_str(&row(
            "bulk MiB/s",
            "bulk_mib_per_s",
            "bulk_throughput",
            format!("≥ 0.95 — {} (wall clock)", met(bulk_ok(x))),
            true,
        ));
        tb.push_str(&row(
            "bulk MiB per CPU-s",
            "bulk_mib_per_cpu_s",
            "bulk_throughput_per_cpu_s",
            format!("≥ 0.95 — {}", met(cpu_ok(x))),
            true,
        ));
    }
    s.part("table", tb);
    if neg.is_object() {
        let raw = spread(&neg["raw_quinn_connect_first_echo_p50_us"]);
        let q = &neg["ratios_over_raw_quinn"];
        let mut n = String::from(
            "| | raw quinn | negotiated | negotiated / raw quinn | bar |\n\
             |---|---:|---:|---:|---|\n",
        );
        for (what, key, rkey, bar) in [
            (
                "reconnect (remembered pick, REBIND) connect + first echo p50 µs",
                "connect_first_echo_p50_us",
                "connect_first_echo_p50",
                format!("≤ 1.1 — {}", met(reco_ok)),
            ),
            (
                "… connect, then send",
                "connect_then_send_p50_us",
                "connect_then_send_p50",
                String::new(),
            ),
            (
                "first contact (negotiation each time) connect + first echo p50 µs",
                "first_contact_connect_first_echo_p50_us",
                "first_contact_connect_first_echo_p50",
                String::new(),
            ),
        ] {
            let _ = writeln!(
                n,
                "| {what} | {} | {} | {} | {bar} |",
                us_sp(raw),
                us_sp(spread(&neg[key])),
                ratio(spread(&q[rkey]))
            );
        }
        let _ = write!(
            n,
            "\nThe reconnect's p99 is {} µs.",
            us(med(spread(&neg["connect_first_echo_p99_us"])))
        );
        s.part("negotiated", n);
    }
}
