//! The generated parts of each figure's section: the claim, the tables, the plot, the summary
//! lines. Each reads the bench's own JSON (`envelope["result"]`).

use std::fmt::Write as _;

use serde_json::Value;

use super::super::Figure;
use super::{Section, Spread, spread, thousands};

mod datapaths;
mod lent;
mod pubsub;
mod secure;

use datapaths::{datapaths, xdp};
use pubsub::pubsub;
use secure::secure;

pub(super) fn render(f: &Figure, env: &Value) -> Section {
    let r = &env["result"];
    let mut s = Section::default();
    match f.name {
        "overhead" => overhead(r, &mut s),
        "negotiate" => negotiate(r, &mut s),
        "flood" => flood(r, &mut s, false),
        "flood_slow" => flood(r, &mut s, true),
        "reconfig" => reconfig(r, &mut s),
        "kv" => kv(r, &mut s),
        "rendezvous" => rendezvous(r, &mut s),
        "etl" => etl(r, &mut s),
        "pubsub" => pubsub(r, &mut s),
        "shm" => shm(r, &mut s),
        "uring" => uring(r, &mut s),
        "datapaths" => datapaths(r, &mut s),
        "xdp" => xdp(r, &mut s),
        "secure" => secure(r, &mut s),
        "sched" | "sched_heavy" => super::sched::render(f.name, r, &mut s),
        _ => {}
    }
    s
}

// ---- formatting --------------------------------------------------------------------------

/// A ratio: `1.062 [1.049–1.301]`; `171 [120–198]` for large ones.
pub(super) fn ratio(sp: Option<Spread>) -> String {
    let f = |x: f64| {
        if x.abs() >= 10.0 {
            format!("{x:.0}")
        } else if x.abs() >= 3.0 {
            format!("{x:.2}")
        } else {
            format!("{x:.3}")
        }
    };
    match sp {
        Some(s) if s.min == s.max => f(s.med),
        Some(s) => format!("{} [{}–{}]", f(s.med), f(s.min), f(s.max)),
        None => "–".into(),
    }
}

/// A ratio in bold with its spread after: `**1.062** [1.049–1.301]`.
fn ratio_b(sp: Option<Spread>) -> String {
    match sp {
        Some(s) if s.min == s.max => format!("**{:.3}**", s.med),
        Some(s) => format!("**{:.3}** [{:.3}–{:.3}]", s.med, s.min, s.max),
        None => "–".into(),
    }
}

/// Microseconds at a precision fit for their size.
pub(super) fn us(x: f64) -> String {
    if !x.is_finite() {
        "–".into()
    } else if x < 1.0 {
        format!("{x:.3}")
    } else if x < 10.0 {
        format!("{x:.2}")
    } else if x < 100.0 {
        format!("{x:.1}")
    } else {
        thousands(x)
    }
}

pub(super) fn us_sp(sp: Option<Spread>) -> String {
    match sp {
        Some(s) if s.min == s.max => us(s.med),
        Some(s) => format!("{} [{}–{}]", us(s.med), us(s.min), us(s.max)),
        None => "–".into(),
    }
}

pub(super) fn med(sp: Option<Spread>) -> f64 {
    sp.map_or(f64::NAN, |s| s.med)
}

/// `k` units: 175k, 6.7M.
pub(super) fn rate(x: f64) -> String {
    if !x.is_finite() {
        "–".into()
    } else if x >= 1e6 {
        format!("{:.1}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.0}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

pub(super) fn met(ok: Option<bool>) -> &'static str {
    match ok {
        Some(true) => "met",
        Some(false) => "**not met**",
        None => "not judged",
    }
}

pub(super) fn reps(sp: Option<Spread>) -> String {
    match sp.and_then(|s| s.runs) {
        Some(1) => "one repetition".into(),
        Some(n) => format!("median [min–max] of {n} repetitions"),
        None => "median [min–max]".into(),
    }
}

pub(super) fn plot(name: &str, alt: &str) -> String {
    format!("![{alt}](figures/{name}.png)")
}

// ---- overhead ----------------------------------------------------------------------------

fn overhead(r: &Value, s: &mut Section) {
    let rows = r["results"].as_array().cloned().unwrap_or_default();
    let find = |t: &str, size: u64, l: &str| {
        rows.iter()
            .find(|x| x["transport"] == t && x["size"] == size && x["layers"] == l)
    };
    let tput = |t, size, l| find(t, size, l).and_then(|x| spread(&x["throughput_ratio_to_raw"]));
    let p50 = |t, size, l| find(t, size, l).and_then(|x| spread(&x["p50_ratio_to_raw"]));
    let zero = tput("udp", 64, "0");
    let ok = zero.map(|z| z.med >= 0.95);
    s.part(
        "claim",
        format!(
            "**Throughput through the 0-Chunnel stack is {}× the raw socket** (UDP, 64 B, {}; \
             bar ≥ 0.95 — {}), {}× on Unix datagrams. One message in flight: the 0-layer p50 is \
             {}× raw (UDP 64 B) and {}× with 5 layers; {}× and {}× on Unix datagrams.",
            ratio(zero),
            reps(zero),
            met(ok),
            ratio(tput("unix", 64, "0")),
            ratio(p50("udp", 64, "0")),
            ratio(p50("udp", 64, "5")),
            ratio(p50("unix", 64, "0")),
            ratio(p50("unix", 64, "5")),
        ),
    );
    s.headline(
        "overhead",
        "0-Chunnel stack throughput / raw socket (UDP, 64 B)",
        ratio(zero),
        "≥ 0.95",
        ok,
    );
    s.part(
        "plot",
        plot(
            "overhead",
            "throughput and p50 latency of 0, 1, 3, 5 no-op layers relative to raw sockets",
        ),
    );
    let mut t = String::from(
        "| transport | size | layers | msgs/s median [min–max] | throughput / raw | RTT p50 µs \
         | RTT p99 µs | p50 / raw |\n|---|---|---|---|---|---|---|---|\n",
    );
    for x in &rows {
        let m = spread(&x["msgs_per_s"]);
        let _ = writeln!(
            t,
            "| {} | {} B | {} | {} | {} | {} | {} | {} |",
            x["transport"].as_str().unwrap_or("?"),
            x["size"],
            x["layers"].as_str().unwrap_or("?"),
            m.map_or("–".into(), |m| if m.min == m.max {
                thousands(m.med)
            } else {
                format!(
                    "{} [{}–{}]",
                    thousands(m.med),
                    thousands(m.min),
                    thousands(m.max)
                )
            }),
            ratio(spread(&x["throughput_ratio_to_raw"])),
            us(med(spread(&x["rtt_p50_us"]))),
            us(med(spread(&x["rtt_p99_us"]))),
            ratio(spread(&x["p50_ratio_to_raw"]).map(|s| Spread {
                min: s.med,
                max: s.med,
                ..s
            })),
        );
    }
    s.part("table", t);
    super::overhead_metrics::render(r, s);

    let cg = &r["callgrind"];
    if let Some(per) = cg["instr_per_msg_round_trip"].as_object() {
        let mut t = String::from(
            "| layers | instructions per message round trip (send + recv) |\n|---|---|\n",
        );
        for (l, v) in per {
            let _ = writeln!(t, "| {l} | {:.1} |", v.as_f64().unwrap_or(f64::NAN));
        }
        let d = cg["five_minus_zero_per_msg"].as_f64().unwrap_or(f64::NAN);
        let ok = Some(d <= 50.0);
        let _ = write!(
            t,
            "\n**5 layers − 0 layers = {:.1} instructions per round trip = {:.1} per message \
             traversal (one send or one receive), {:.1} per layer per message** (bar: ≤ 10 per \
             layer, ≤ 50 for five — {}).",
            cg["five_minus_zero_per_round_trip"]
                .as_f64()
                .unwrap_or(f64::NAN),
            d,
            d / 5.0,
            met(ok)
        );
        s.part("callgrind", t);
        s.headline(
            "overhead",
            "instructions per layer per message traversal (callgrind)",
            format!("{:.1}", d / 5.0),
            "≤ 10",
            ok,
        );
    } else {
        let why = cg["skipped"]
            .as_str()
            .unwrap_or("run with `--no-callgrind`");
        s.part("callgrind", format!("Not counted in this run ({why})."));
    }
    if let Some(a) = r["allocations_per_msg_5_layers"].as_f64() {
        s.part(
            "allocs",
            format!(
                "`allocations_per_msg_5_layers` in the same JSON: **{a}** heap allocations per \
                 message sent and received through 5 `Noop` layers over UDP (steady state, \
                 counted by a global counting allocator in `chunnel-bench`)."
            ),
        );
        s.headline(
            "overhead",
            "heap allocations per message through 5 layers",
            format!("{a}"),
            "0",
            Some(a == 0.0),
        );
    }
}

// ---- negotiate ---------------------------------------------------------------------------

fn negotiate(r: &Value, s: &mut Section) {
    let v = &r["variants"];
    let zero = spread(&v["zero_rtt"]["p50_ratio_vs_raw"]);
    let one = spread(&v["one_rtt"]["p50_ratio_vs_raw"]);
    let (zok, ook) = (zero.map(|z| z.med <= 1.2), one.map(|o| o.med <= 2.2));
    s.part(
        "claim",
        format!(
            "**A 0-RTT connection's set-up and first echo take {}× a raw UDP exchange** (p50, \
             {}, each repetition against the `raw_udp` exchange of the same repetition; bar ≤ \
             1.2 — {}), **1-RTT {}×** (bar ≤ 2.2 — {}).",
            ratio(zero),
            reps(zero),
            met(zok),
            ratio(one),
            met(ook)
        ),
    );
    s.headline(
        "negotiate",
        "0-RTT connect + first echo / raw UDP exchange (p50)",
        ratio(zero),
        "≤ 1.2",
        zok,
    );
    s.headline(
        "negotiate",
        "1-RTT connect + first echo / raw UDP exchange (p50)",
        ratio(one),
        "≤ 2.2",
        ook,
    );
    s.part(
        "plot",
        plot(
            "negotiate",
            "connect + first echo p50 of each variant relative to raw_udp",
        ),
    );
    let mut t = String::from(
        "| variant | p50 µs | p99 µs | p50 / `raw_udp` | p50 / `raw_udp_eager` | bar |\n\
         |---|---|---|---|---|---|\n",
    );
    for (name, bar) in [
        ("raw_udp", "baseline".to_string()),
        ("raw_udp_eager", "–".to_string()),
        ("one_rtt", format!("≤ 2.2 — {}", met(ook))),
        ("zero_rtt", format!("≤ 1.2 — {}", met(zok))),
    ] {
        let x = &v[name];
        if x.is_null() {
            continue;
        }
        let _ = writeln!(
            t,
            "| `{name}` | {} | {} | {} | {} | {bar} |",
            us_sp(spread(&x["p50_us"])),
            us_sp(spread(&x["p99_us"])),
            ratio(spread(&x["p50_ratio_vs_raw"])),
            ratio(spread(&x["p50_ratio_vs_raw_eager"])),
        );
    }
    s.part("table", t);
}

// ---- flood -------------------------------------------------------------------------------

fn flood(r: &Value, s: &mut Section, slow: bool) {
    let n = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let connected = r["clients_connected"].as_u64().unwrap_or(0);
    let clients = r["clients"].as_u64().unwrap_or(0);
    let ok = Some(connected == clients && clients > 0);
    let label = if slow {
        format!(
            "flood + {} slow-deciding clients ({} slow answers, p50 {:.0} ms)",
            r["slow_clients"],
            r["slow_answers"],
            n("slow_answer_p50_us") / 1000.0
        )
    } else {
        "flood only".into()
    };
    let caps = r["peer_cap_stats"].as_array();
    let evicted = caps
        .and_then(|c| c.first())
        .and_then(Value::as_f64)
        .unwrap_or(f64::NAN);
    let row = format!(
        "| {label} | {} in {:.1} s | {} of {} | {} µs | {} ms | {} ms | {:.1} MB | {} | {} | {} |",
        thousands(n("flood_hellos")),
        n("flood_secs"),
        thousands(connected as f64),
        thousands(clients as f64),
        us(n("connect_p50_us")),
        us(n("connect_p99_us") / 1000.0),
        us(n("connect_max_us") / 1000.0),
        n("server_peak_rss_kb") / 1000.0,
        thousands(n("server_peak_peers")),
        thousands(evicted),
        r["kernel_udp_rcvbuf_drops"]
            .as_f64()
            .map_or("–".into(), thousands),
    );
    let what = if slow {
        "clients connected during the flood, with slow-deciding clients"
    } else {
        "clients connected during a hello flood"
    };
    s.headline(
        if slow { "flood_slow" } else { "flood" },
        what,
        format!("{connected} of {clients}"),
        "all",
        ok,
    );
    // The table and the claim come from both runs; the first of them writes them.
    s.part("row", row);
    s.part(
        "claim_one",
        format!(
            "{} of {} clients connect ({}; connect + echo p50 {} µs, p99 {} ms)",
            thousands(connected as f64),
            thousands(clients as f64),
            label,
            us(n("connect_p50_us")),
            us(n("connect_p99_us") / 1000.0)
        ),
    );
}

/// The flood table and claim, from both flood runs (`flood` and `flood_slow`).
pub(super) fn flood_parts(a: Option<&Section>, b: Option<&Section>) -> (String, String) {
    let rows: Vec<&String> = [a, b]
        .into_iter()
        .flatten()
        .filter_map(|s| s.parts.get("row"))
        .collect();
    if rows.is_empty() {
        return (String::new(), String::new());
    }
    let mut t = String::from(
        "| run | flood hellos | clients connected | connect + echo p50 | p99 | max | server \
         peak RSS | peak peers | evicted | kernel drops |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        t.push_str(r);
        t.push('\n');
    }
    let claims: Vec<&String> = [a, b]
        .into_iter()
        .flatten()
        .filter_map(|s| s.parts.get("claim_one"))
        .collect();
    let claim = format!(
        "**Every client connects during a flood of hellos from distinct sources**: {}. There is \
         no baseline in these runs; the same client's connect + echo without a flood is the \
         `one_rtt` row of the negotiation figure above.",
        claims
            .iter()
            .map(|c| c.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    );
    (t, claim)
}

// ---- reconfig ----------------------------------------------------------------------------

fn reconfig(r: &Value, s: &mut Section) {
    let fp = &r["fast_path"];
    let v = &fp["variants"];
    let lf = spread(&v["lock-free"]["throughput_ratio_to_plain"]);
    let lk = spread(&v["lock"]["throughput_ratio_to_plain"]);
    let sp = &r["switch_pause"];
    let p = |m: &str, q: &str| sp[m]["pause_us"][q].as_f64().unwrap_or(f64::NAN);
    let lossless = |x: &Value| {
        x["loss"]["lost"] == 0 && x["loss"]["duplicates"] == 0 && x["switches"].as_u64() > Some(0)
    };
    let tok = lf.map(|x| x.med >= 0.98);
    let pok = Some(p("lock-free", "p99") < 1000.0 && p("lock", "p99") < 1000.0);
    let zero_loss = Some(lossless(&sp["lock-free"]) && lossless(&sp["lock"]));
    s.part(
        "claim",
        format!(
            "**The lock-free reconfigurable select runs at {}× the throughput of the plain \
             stack** ({}; bar ≥ 0.98 — {}); the lock mechanism at {}×. **A unilateral switch \
             pauses delivery for {:.1} µs at p99** (lock-free; lock {:.1} µs; bar < 1 ms — {}) \
             **with no message lost, duplicated or reordered** ({}).",
            ratio(lf),
            reps(lf),
            met(tok),
            ratio(lk),
            p("lock-free", "p99"),
            p("lock", "p99"),
            met(pok),
            if zero_loss == Some(true) {
                "met"
            } else {
                "**not met**"
            },
        ),
    );
    s.headline(
        "reconfig",
        "lock-free select throughput / plain stack",
        ratio(lf),
        "≥ 0.98",
        tok,
    );
    s.headline(
        "reconfig",
        "unilateral switch pause p99 (lock-free / lock)",
        format!("{:.1} / {:.1} µs", p("lock-free", "p99"), p("lock", "p99")),
        "< 1 ms",
        pok,
    );
    s.headline(
        "reconfig",
        "messages lost or duplicated across switches",
        if zero_loss == Some(true) { "0" } else { "some" },
        "0",
        zero_loss,
    );
    s.part(
        "plot",
        plot(
            "reconfig",
            "fast-path throughput relative to the plain stack, and switch pauses",
        ),
    );
    let cg = &fp["callgrind"];
    let instr = |m: &str| {
        cg["instr_per_msg_round_trip"][m]
            .as_f64()
            .map_or("not counted".into(), |x| format!("{x:.1}"))
    };
    let gate = |m: &str| {
        cg["gate_cost_per_traversal"][m]
            .as_f64()
            .map_or("not counted".into(), |x| format!("{x:.1}"))
    };
    let alloc = |m: &str| {
        fp["allocations_per_msg"][m]
            .as_f64()
            .map_or("–".into(), |x| format!("{x}"))
    };
    let sw = |m: &str, q: &str| sp[m]["switch_call_us"][q].as_f64().unwrap_or(f64::NAN);
    let loss = |m: &str| {
        let l = &sp[m]["loss"];
        format!(
            "{} / {} / {} (of {})",
            l["lost"],
            l["duplicates"],
            l["reordered"],
            thousands(l["sent"].as_f64().unwrap_or(f64::NAN))
        )
    };
    let plain = med(spread(&v["plain"]["msgs_per_s"]));
    let mut t = format!(
        "| | lock-free | lock |\n|---|---|---|\n\
         | throughput ratio to plain (plain: {} msgs/s) | {} | {} |\n\
         | instructions per message round trip (plain {}) | {} | {} |\n\
         | gate cost per message traversal (callgrind) | {} | {} |\n\
         | heap allocations per message | {} | {} |\n",
        rate(plain),
        ratio_b(lf),
        ratio(lk),
        instr("plain"),
        instr("lock-free"),
        instr("lock"),
        gate("lock-free"),
        gate("lock"),
        alloc("lock-free"),
        alloc("lock"),
    );
    let _ = write!(
        t,
        "| unilateral pause p50 / p99 / max (µs) | {:.1} / **{:.1}** / {:.1} | {:.1} / **{:.1}** \
         / {:.1} |\n\
         | unilateral switch call p50 / p99 (µs) | {:.1} / {:.1} | {:.1} / {:.1} |\n\
         | messages lost / duplicated / reordered | {} | {} |\n",
        p("lock-free", "p50"),
        p("lock-free", "p99"),
        p("lock-free", "max"),
        p("lock", "p50"),
        p("lock", "p99"),
        p("lock", "max"),
        sw("lock-free", "p50"),
        sw("lock-free", "p99"),
        sw("lock", "p50"),
        sw("lock", "p99"),
        loss("lock-free"),
        loss("lock"),
    );
    s.part("table", t);
    let m = &r["multilateral"]["pause"];
    if m.is_object() {
        let q = |a: &str, b: &str| us(m[a][b].as_f64().unwrap_or(f64::NAN));
        let l = &m["loss"];
        s.part(
            "multilateral",
            format!(
                "Multilateral (lock-free at both ends, {} switches): pause p50 **{} µs**, p99 \
                 **{} µs**, max {} µs; propose-to-peer-switched p50 {} µs, p99 {} µs; {} lost, \
                 {} duplicated, {} reordered of {}; round trip p50 {} µs in steady state, {} µs \
                 for messages in flight across a switch.",
                m["switches"],
                q("pause_us", "p50"),
                q("pause_us", "p99"),
                q("pause_us", "max"),
                q("switch_call_us", "p50"),
                q("switch_call_us", "p99"),
                l["lost"],
                l["duplicates"],
                l["reordered"],
                thousands(l["sent"].as_f64().unwrap_or(f64::NAN)),
                us(m["rtt_us"]["steady"]["p50"].as_f64().unwrap_or(f64::NAN)),
                us(m["rtt_us"]["during"]["p50"].as_f64().unwrap_or(f64::NAN)),
            ),
        );
    }
}

// ---- kv ----------------------------------------------------------------------------------

fn kv(r: &Value, s: &mut Section) {
    let m = &r["max_load_meeting_bound"];
    let bound = r["p95_bound_us"].as_f64().unwrap_or(f64::NAN);
    let load = |k: &str| {
        m[k].as_f64().map_or_else(
            || "no measured load".to_string(),
            |x| format!("{} req/s", rate(x)),
        )
    };
    let pr = &r["full_vs_inline"]["paired"];
    let paired = spread(&pr["p50_ratio_full_over_no_chunnels"]);
    let pok = paired.map(|p| p.med <= 1.10);
    let ratio_loads = m["ratio_client_push_over_server_side"].as_f64();
    s.part(
        "claim",
        format!(
            "**Highest offered load whose p95 stays within {:.0} µs: client push {}, server-side \
             sharding {}**{}.",
            bound,
            load("client_push"),
            load("server_side"),
            ratio_loads.map_or(String::new(), |x| format!(" (ratio {x:.2})")),
        ),
    );
    s.headline(
        "kv",
        format!("max load within p95 {bound:.0} µs, client push / server-side"),
        ratio_loads.map_or("–".into(), |x| format!("{x:.2}")),
        "–",
        None,
    );
    s.headline(
        "kv",
        "full Chunnel stack p50 / inline code (paired)",
        ratio(paired),
        "≤ 1.10",
        pok,
    );
    s.part(
        "plot",
        plot(
            "kv",
            "p50 and p95 latency against offered load, both sharding modes",
        ),
    );
    let sweep = &r["sweep"];
    let cp = sweep["client_push"].as_array().cloned().unwrap_or_default();
    let ss = sweep["server_side"].as_array().cloned().unwrap_or_default();
    let mut loads: Vec<f64> = cp
        .iter()
        .chain(&ss)
        .filter_map(|p| p["offered_rps"].as_f64())
        .collect();
    loads.sort_by(f64::total_cmp);
    loads.dedup();
    let cell = |pts: &[Value], l: f64| -> (String, String) {
        match pts.iter().find(|p| p["offered_rps"].as_f64() == Some(l)) {
            None => ("—".into(), "—".into()),
            Some(p) => {
                let p95 = us_sp(spread(&p["p95_us"]));
                let fails = if p["meets_bound"].as_bool() == Some(false) {
                    " (fails)"
                } else {
                    ""
                };
                (us(med(spread(&p["p50_us"]))), format!("{p95}{fails}"))
            }
        }
    };
    let mut t = String::from(
        "| load (req/s) | client push p50 µs | client push p95 µs | server-side p50 µs | \
         server-side p95 µs |\n|---|---|---|---|---|\n",
    );
    for l in loads {
        let (a, b) = cell(&cp, l);
        let (c, d) = cell(&ss, l);
        let _ = writeln!(t, "| {} | {a} | {b} | {c} | {d} |", rate(l));
    }
    let _ = write!(
        t,
        "\nMedians over {} repetitions per point, p95 min–max in brackets; \"(fails)\": the \
         median p95 is above the {bound:.0} µs bound.",
        r["reps"]
    );
    s.part("sweep", t);
    if pr.is_object() {
        let mut detail = reps(paired);
        if let (Some(f), Some(n)) = (
            spread(&pr["full_p50_us"]),
            spread(&pr["no_chunnels_p50_us"]),
        ) {
            let _ = write!(
                detail,
                "; full p50 {} µs, inline {} µs",
                us_sp(Some(f)),
                us_sp(Some(n))
            );
        }
        if let (Some(f), Some(n)) = (
            pr["samples"]["full"].as_u64(),
            pr["samples"]["no_chunnels"].as_u64(),
        ) {
            let _ = write!(detail, "; {f} and {n} requests per run");
        }
        s.part(
            "paired",
            format!(
                "Paired p50 ratio full / no Chunnels: **{}** ({detail}); **the bar (full within \
                 10 % of no Chunnels) is {}**.",
                ratio(paired),
                met(pok)
            ),
        );
    }
}

// ---- rendezvous --------------------------------------------------------------------------

fn rendezvous(r: &Value, s: &mut Section) {
    let Some(b) = r["backends"].as_object() else {
        return;
    };
    s.part(
        "plot",
        plot(
            "rendezvous",
            "join and commit p50 against group size per backend",
        ),
    );
    // Runs from before direct ballots have no `direct_ballots`: every ballot went to the store.
    let ballots = if r["direct_ballots"].as_bool() == Some(true) {
        "ballots sent directly to the proposer (datagrams)"
    } else {
        "every ballot written to the store"
    };
    let mut t = format!(
        "p50 / p90 in ms over {} repetitions, notified (polling every {} ms without \
         notifications, every {} ms with them), {ballots}; *store alone* = p50 of a \
         proposal and of an abort written by a client outside the group while its N members \
         handle them (runs with direct ballots only):\n\n\
         | backend | N | join p50 | join p90 | commit p50 | commit p90 | store alone: propose / finish |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
        r["reps"], r["poll_ms"], r["poll_notified_ms"]
    );
    for (name, sizes) in b {
        let Some(sizes) = sizes.as_object() else {
            if let Some(why) = sizes["skipped"].as_str().or(sizes.as_str()) {
                let _ = writeln!(t, "| {name} | – | skipped: {why} | | | | |");
            }
            continue;
        };
        let mut ns: Vec<(u64, &Value)> = sizes
            .iter()
            .filter_map(|(n, v)| n.parse().ok().map(|n| (n, v)))
            .collect();
        ns.sort_by_key(|x| x.0);
        for (n, v) in ns {
            let ms =
                |w: &str, q: &str| v[w][q].as_f64().map_or("–".into(), |x| format!("{x:.2}"));
            let floor = match (
                v["store_propose"]["p50_ms"].as_f64(),
                v["store_finish"]["p50_ms"].as_f64(),
            ) {
                (Some(p), Some(f)) => format!("{p:.2} / {f:.2}"),
                _ => "–".into(),
            };
            let _ = writeln!(
                t,
                "| {name} | {n} | {} | {} | {} | {} | {floor} |",
                ms("join", "p50_ms"),
                ms("join", "p90_ms"),
                ms("commit", "p50_ms"),
                ms("commit", "p90_ms")
            );
        }
    }
    s.part("table", t);
    // Issue 23's bar: a group of 64 commits in under 10 ms on Redis and on the etcd cluster.
    let at64 = |backend: &str| {
        b.get(backend)
            .and_then(|v| v["64"]["commit"]["p50_ms"].as_f64())
    };
    if let (Some(e), Some(r)) = (at64("etcd3"), at64("redis")) {
        s.headline(
            "rendezvous",
            format!(
                "commit p50, 64 members: three-member etcd cluster / Redis ({})",
                if ballots.starts_with("every") {
                    "ballots in the store"
                } else {
                    "direct ballots"
                }
            ),
            format!("{e:.2} / {r:.2} ms"),
            "< 10 ms",
            Some(e < 10.0 && r < 10.0),
        );
    }
}

// ---- etl ---------------------------------------------------------------------------------

fn etl(r: &Value, s: &mut Section) {
    let Some(b) = r["brokers"].as_object() else {
        return;
    };
    s.part(
        "plot",
        plot(
            "etl",
            "end-to-end p50 and p99 latency against offered load, Kafka and NATS",
        ),
    );
    let ms = |v: &Value| {
        v.as_f64()
            .map_or("–".into(), |x| format!("{:.2}", x / 1000.0))
    };
    let mut t = format!(
        "{} producers (batches of {}), {} ingest servers, {} parsers, one consumer, {} s per \
         offered load; hops negotiated onto {}; every {}th line malformed (counted and skipped):\n\n\
         | broker | offered (records/s) | delivered (records/s) | p50 ms | p99 ms | max ms | \
         every record exactly once |\n|---|---:|---:|---:|---:|---:|---|\n",
        r["producers"],
        r["batch"],
        r["ingests"],
        r["parsers"],
        r["secs"],
        r["hop_paths"]
            .as_array()
            .map(|v| v
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(" and "))
            .unwrap_or_default(),
        r["malformed_every"],
    );
    let mut all_complete = true;
    for (name, e) in b {
        if let Some(why) = e["skipped"].as_str() {
            let _ = writeln!(t, "| {name} | – | skipped: {why} | | | | |");
            all_complete = false;
            continue;
        }
        for p in e["points"].as_array().into_iter().flatten() {
            let complete = p["complete"].as_bool() == Some(true);
            all_complete &= complete;
            let _ = writeln!(
                t,
                "| {name} | {} | {} | {} | {} | {} | {} |",
                thousands(p["offered_per_s"].as_f64().unwrap_or(f64::NAN)),
                thousands(p["delivered_per_s"].as_f64().unwrap_or(f64::NAN)),
                ms(&p["p50_us"]),
                ms(&p["p99_us"]),
                ms(&p["max_us"]),
                if complete {
                    "yes".to_string()
                } else {
                    format!("no: {} missing", p["missing"])
                }
            );
        }
        if let Some(why) = e["failed"].as_str() {
            let _ = writeln!(t, "| {name} | – | failed: {why} | | | | |");
            all_complete = false;
        }
    }
    s.part("table", t);
    s.headline(
        "etl",
        "ETL pipeline: every record delivered exactly once at every offered load",
        if all_complete { "yes" } else { "no" },
        "yes",
        Some(all_complete),
    );
}

// ---- shm ---------------------------------------------------------------------------------

fn shm(r: &Value, s: &mut Section) {
    let res = &r["results"];
    let udp_over = spread(&r["p50_ratio_udp_over_shm"]);
    let lib_over = spread(&r["p50_ratio_lib_shm_over_raw_ring"]);
    let raw = med(spread(&res["raw_ring"]["rtt_p50_us"]));
    let lib = med(spread(&res["chunnel_shm"]["rtt_p50_us"]));
    let ok5 = udp_over.map(|x| x.med >= 5.0);
    let ok1 = Some(lib - raw <= 1.0);
    s.part(
        "claim",
        format!(
            "**Shared memory's round trip is {}× shorter than UDP's through the same \
             negotiation** (p50, {}; bar ≥ 5× — {}). **The library adds {:+.2} µs at p50 over \
             the raw ring** ({}×; the bar for paths under 10 µs is at most 1 µs above the raw \
             baseline — {}).",
            ratio(udp_over),
            reps(udp_over),
            met(ok5),
            lib - raw,
            ratio(lib_over),
            met(ok1)
        ),
    );
    s.headline(
        "shm",
        "UDP p50 / shared-memory p50, same negotiation",
        ratio(udp_over),
        "≥ 5",
        ok5,
    );
    s.headline(
        "shm",
        "chunnel-shm p50 − raw SPSC ring p50",
        format!("{:+.2} µs", lib - raw),
        "≤ 1 µs",
        ok1,
    );
    let mut t = format!("| {} B | p50 µs | p99 µs |\n|---|---:|---:|\n", r["size"]);
    for (k, label) in [
        ("raw_ring", "raw SPSC ring (no library, the baseline)"),
        ("chunnel_shm", "chunnel-shm"),
        ("chunnel_udp", "UDP through the library"),
    ] {
        let _ = writeln!(
            t,
            "| {label} | {} | {} |",
            us_sp(spread(&res[k]["rtt_p50_us"])),
            us_sp(spread(&res[k]["rtt_p99_us"]))
        );
    }
    s.part("table", t);
}

// ---- uring -------------------------------------------------------------------------------

fn uring(r: &Value, s: &mut Section) {
    let v = &r["variants"];
    let lib = spread(&v["uring_lib"]["p50_ratio_to_raw"]);
    let ok = lib.map(|x| x.med <= 1.10);
    s.part(
        "claim",
        format!(
            "**The io_uring datapath's round trip is {}× the raw io_uring echo's** (p50, {}; \
             bar within 10 % — {}); a ring not bound to one thread (`uring_lib_any_thread`) is \
             {}×.",
            ratio(lib),
            reps(lib),
            met(ok),
            ratio(spread(&v["uring_lib_any_thread"]["p50_ratio_to_raw"]))
        ),
    );
    s.headline(
        "uring",
        "io_uring datapath p50 / raw io_uring echo",
        ratio(lib),
        "≤ 1.10",
        ok,
    );
    let mut t = String::from(
        "| variant | p50 µs | p99 µs | p50 / raw | 64 B msgs/s | throughput / raw |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for (k, label) in [
        ("raw_uring", "raw io_uring echo (the baseline)"),
        (
            "uring_lib",
            "`uring_lib`: chunnel-uring, ring bound to its thread",
        ),
        ("uring_lib_any_thread", "`uring_lib_any_thread`"),
        ("kernel_lib", "kernel UDP through the library (context)"),
    ] {
        let x = &v[k];
        if x.is_null() {
            continue;
        }
        let _ = writeln!(
            t,
            "| {label} | {} | {} | {} | {} | {} |",
            us_sp(spread(&x["rtt_p50_us"])),
            us_sp(spread(&x["rtt_p99_us"])),
            ratio(spread(&x["p50_ratio_to_raw"])),
            rate(med(spread(&x["msgs_per_s_64b"]))),
            ratio(spread(&x["throughput_ratio_to_raw"])),
        );
    }
    s.part("table", t);
}
