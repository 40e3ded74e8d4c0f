//! PNG plots of the figures (feature `report`): `plotters`' bitmap backend with its pure-Rust
//! `ab_glyph` text renderer, so building needs no system library (its default `ttf` feature
//! would need fontconfig and freetype). The text needs a TrueType font at run time: DejaVu Sans
//! from Debian's `fonts-dejavu-core`, or any file named by `CHUNNEL_REPORT_FONT`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;

use super::Loaded;
use super::render::{Spread, spread};
use super::soak::Soak;

const FONTS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

fn register_font() -> Result<()> {
    let from_env = std::env::var_os("CHUNNEL_REPORT_FONT").map(PathBuf::from);
    let path = from_env
        .into_iter()
        .chain(FONTS.iter().map(PathBuf::from))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            anyhow!(
                "no TrueType font for the plots' text: install fonts-dejavu-core \
                 (apt-get install fonts-dejavu-core) or set CHUNNEL_REPORT_FONT to a .ttf file"
            )
        })?;
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    // plotters keeps fonts for the life of the process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("{} is not a font plotters can read", path.display()))?;
    Ok(())
}

/// Draws every plot the figures have data for; returns the files written.
pub(crate) fn all(dir: &Path, figures: &Loaded, soak: Option<&Soak>) -> Result<Vec<PathBuf>> {
    register_font()?;
    let mut written = Vec::new();
    let get = |n: &str| {
        figures
            .iter()
            .find(|(f, e)| f.name == n && e["result"].is_object())
            .map(|(_, e)| &e["result"])
    };
    type Draw = fn(&Path, &Value) -> Result<()>;
    let plots: [(&str, &str, Draw); 13] = [
        ("overhead", "overhead", overhead),
        ("negotiate", "negotiate", negotiate),
        ("reconfig", "reconfig", reconfig),
        ("kv", "kv", kv),
        ("rendezvous", "rendezvous", rendezvous),
        ("etl", "etl", etl),
        ("pubsub", "pubsub", pubsub),
        ("datapaths", "datapaths", datapaths),
        ("datapaths", "figure7", figure7),
        ("secure", "secure", secure),
        ("uring", "uring", uring),
        ("sched", "sched", sched),
        ("sched_heavy", "sched_heavy", sched),
    ];
    for (figure, file, draw) in plots {
        if let Some(r) = get(figure) {
            let path = dir.join(format!("{file}.png"));
            draw(&path, r).with_context(|| format!("drawing {}", path.display()))?;
            written.push(path);
        }
    }
    if let Some(s) = soak.filter(|s| s.rows.len() >= 2) {
        let path = dir.join("soak.png");
        draw_soak(&path, s).with_context(|| format!("drawing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

// ---- primitives --------------------------------------------------------------------------

/// Bars for `series` in each of `groups`, whiskers from min to max, dashed reference lines.
fn bars(
    area: &Area<'_>,
    title: &str,
    y_desc: &str,
    groups: &[String],
    series: &[(String, Vec<Option<Spread>>)],
    refs: &[(f64, &str)],
    ratio_axis: bool,
) -> Result<()> {
    let vals = || {
        series
            .iter()
            .flat_map(|(_, v)| v.iter().flatten().flat_map(|s| [s.min, s.med, s.max]))
            .chain(refs.iter().map(|r| r.0))
            .filter(|x| x.is_finite())
    };
    let hi = vals().fold(0.0f64, f64::max);
    let lo = vals().fold(f64::INFINITY, f64::min);
    // Ratios near 1 start the axis near their smallest value, so differences show; the
    // headroom above the largest value keeps the legend off the bars.
    let (bottom, top) = if ratio_axis && lo.is_finite() && hi > lo {
        let span = hi - lo;
        ((lo - 0.3 * span).max(0.0), hi + 0.6 * span)
    } else {
        (0.0, if hi > 0.0 { hi * 1.35 } else { 1.0 })
    };
    let n = groups.len().max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(34)
        .y_label_area_size(64)
        .build_cartesian_2d(-0.5f64..n - 0.5, bottom..top)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .x_label_formatter(&|_| String::new())
        .y_desc(y_desc)
        .y_label_formatter(&|y| tick(*y))
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    let ns = series.len().max(1) as f64;
    let w = 0.8 / ns;
    for (j, (name, vals)) in series.iter().enumerate() {
        let c = COLORS[j % COLORS.len()];
        let mut rects = Vec::new();
        let mut whiskers = Vec::new();
        for (i, v) in vals.iter().enumerate() {
            let Some(s) = v.filter(|s| s.med.is_finite()) else {
                continue;
            };
            let x0 = i as f64 - 0.4 + j as f64 * w;
            let x1 = x0 + w * 0.9;
            rects.push(Rectangle::new(
                [(x0, bottom), (x1, s.med)],
                c.mix(0.85).filled(),
            ));
            if s.max > s.min {
                let xm = (x0 + x1) / 2.0;
                let cap = w * 0.2;
                whiskers.push(PathElement::new(vec![(xm, s.min), (xm, s.max)], BLACK));
                whiskers.push(PathElement::new(
                    vec![(xm - cap, s.min), (xm + cap, s.min)],
                    BLACK,
                ));
                whiskers.push(PathElement::new(
                    vec![(xm - cap, s.max), (xm + cap, s.max)],
                    BLACK,
                ));
            }
        }
        chart
            .draw_series(rects)
            .map_err(|e| anyhow!("{e}"))?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled()));
        chart.draw_series(whiskers).map_err(|e| anyhow!("{e}"))?;
    }
    for (y, label) in refs {
        let line = DashedLineSeries::new(
            vec![(-0.5, *y), (n - 0.5, *y)],
            6,
            4,
            RGBColor(90, 90, 90).stroke_width(1),
        );
        chart.draw_series(line).map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(std::iter::once(Text::new(
                label.to_string(),
                (n - 0.5, *y),
                ("sans-serif", 12)
                    .into_font()
                    .color(&RGBColor(90, 90, 90))
                    .pos(Pos::new(HPos::Right, VPos::Bottom)),
            )))
            .map_err(|e| anyhow!("{e}"))?;
    }
    for (i, g) in groups.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(i as f64, bottom));
        let (ax, ay) = area.get_base_pixel();
        area.draw(&Text::new(
            g.clone(),
            (px - ax, py - ay + 6),
            TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Center, VPos::Top)),
        ))
        .map_err(|e| anyhow!("{e}"))?;
    }
    if series.len() > 1 {
        legend(&mut chart)?;
    }
    Ok(())
}

/// Lines of (x, y) points with markers; an optional dashed horizontal reference.
fn lines(
    area: &Area<'_>,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    href: Option<(f64, &str)>,
) -> Result<()> {
    let pts = || {
        series
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .filter(|p| p.0.is_finite() && p.1.is_finite())
    };
    let (mut x0, mut x1) = pts().fold((f64::INFINITY, f64::NEG_INFINITY), |a, p| {
        (a.0.min(p.0), a.1.max(p.0))
    });
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let mut y1 = pts().map(|p| p.1).fold(0.0f64, f64::max);
    if let Some((h, _)) = href {
        y1 = y1.max(h);
    }
    let y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, 0f64..y1)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|x| tick(*x))
        .y_label_formatter(&|y| tick(*y))
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (j, (name, v)) in series.iter().enumerate() {
        let c = COLORS[j % COLORS.len()];
        let v: Vec<(f64, f64)> = v
            .iter()
            .copied()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .collect();
        // Long, jagged series at width 1: plotters' joins of wide polylines spike at sharp
        // turns (a restart's drop in memory drew a line across the neighbouring panel).
        let width = if v.len() > 200 { 1 } else { 2 };
        chart
            .draw_series(LineSeries::new(v.clone(), c.stroke_width(width)))
            .map_err(|e| anyhow!("{e}"))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
        if v.len() <= 40 {
            chart
                .draw_series(v.iter().map(|p| Circle::new(*p, 3, c.filled())))
                .map_err(|e| anyhow!("{e}"))?;
        }
    }
    if let Some((h, label)) = href {
        chart
            .draw_series(DashedLineSeries::new(
                vec![(x0, h), (x1, h)],
                6,
                4,
                RGBColor(90, 90, 90).stroke_width(1),
            ))
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(std::iter::once(Text::new(
                label.to_string(),
                (x1, h),
                ("sans-serif", 12)
                    .into_font()
                    .color(&RGBColor(90, 90, 90))
                    .pos(Pos::new(HPos::Right, VPos::Bottom)),
            )))
            .map_err(|e| anyhow!("{e}"))?;
    }
    if series.len() > 1 {
        legend(&mut chart)?;
    }
    Ok(())
}

/// The series' legend, in the upper left corner (drawn when a chart has more than one series).
fn legend<'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, BitMapBackend<'a>, CT>,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| anyhow!("{e}"))
}

/// An axis label: no decimals once they say nothing.
fn tick(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 || (a >= 1.0 && v.fract().abs() < 1e-9) || v == 0.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn canvas(path: &Path, size: (u32, u32)) -> Result<Area<'_>> {
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    Ok(root)
}

fn finish(root: Area<'_>) -> Result<()> {
    root.present().map_err(|e| anyhow!("{e}"))
}

fn one(s: Option<Spread>) -> Option<Spread> {
    s
}

fn point(x: f64) -> Option<Spread> {
    x.is_finite().then_some(Spread {
        med: x,
        min: x,
        max: x,
        runs: None,
    })
}

// ---- figures -----------------------------------------------------------------------------

fn overhead(path: &Path, r: &Value) -> Result<()> {
    let rows = r["results"].as_array().cloned().unwrap_or_default();
    let groups: Vec<(String, u64)> = [("udp", 64), ("udp", 1024), ("unix", 64), ("unix", 1024)]
        .into_iter()
        .map(|(t, s)| (t.to_string(), s))
        .collect();
    let labels: Vec<String> = groups.iter().map(|(t, s)| format!("{t} {s} B")).collect();
    let series = |key: &str| -> Vec<(String, Vec<Option<Spread>>)> {
        ["0", "1", "3", "5"]
            .into_iter()
            .map(|l| {
                let v = groups
                    .iter()
                    .map(|(t, s)| {
                        rows.iter()
                            .find(|x| {
                                x["transport"] == t.as_str() && x["size"] == *s && x["layers"] == l
                            })
                            .and_then(|x| spread(&x[key]))
                    })
                    .collect();
                (format!("{l} layers"), v)
            })
            .collect()
    };
    let root = canvas(path, (1000, 760))?;
    let (a, b) = root.split_vertically(380);
    bars(
        &a,
        "Throughput through no-op layers / raw socket (median, min–max)",
        "throughput / raw",
        &labels,
        &series("throughput_ratio_to_raw"),
        &[(1.0, "raw"), (0.95, "bar 0.95")],
        true,
    )?;
    bars(
        &b,
        "Round-trip p50 through no-op layers / raw socket",
        "p50 / raw",
        &labels,
        &series("p50_ratio_to_raw"),
        &[(1.0, "raw")],
        true,
    )?;
    finish(root)
}

fn negotiate(path: &Path, r: &Value) -> Result<()> {
    let v = &r["variants"];
    let names = ["raw_udp_eager", "one_rtt", "zero_rtt"];
    let groups: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let series = vec![(
        "p50 / raw_udp".to_string(),
        names
            .iter()
            .map(|n| one(spread(&v[n]["p50_ratio_vs_raw"])))
            .collect(),
    )];
    let root = canvas(path, (900, 450))?;
    bars(
        &root,
        "Connect + first echo p50 relative to a raw UDP exchange (median, min–max)",
        "ratio to raw_udp",
        &groups,
        &series,
        &[
            (1.0, "raw_udp"),
            (1.2, "0-RTT bar 1.2"),
            (2.2, "1-RTT bar 2.2"),
        ],
        true,
    )?;
    finish(root)
}

fn reconfig(path: &Path, r: &Value) -> Result<()> {
    let v = &r["fast_path"]["variants"];
    let root = canvas(path, (1000, 420))?;
    let (a, b) = root.split_horizontally(400);
    let mechs = ["lock-free", "lock"];
    bars(
        &a,
        "Fast path: throughput / plain",
        "ratio",
        &mechs.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        &[(
            "throughput / plain".into(),
            mechs
                .iter()
                .map(|m| spread(&v[m]["throughput_ratio_to_plain"]))
                .collect(),
        )],
        &[(1.0, "plain"), (0.98, "bar 0.98")],
        true,
    )?;
    let sp = &r["switch_pause"];
    let ml = &r["multilateral"]["pause"];
    let pauses = [&sp["lock-free"], &sp["lock"], ml];
    let q = |x: &Value, k: &str| point(x["pause_us"][k].as_f64().unwrap_or(f64::NAN));
    bars(
        &b,
        "Switch pause (µs)",
        "µs",
        &["lock-free", "lock", "multilateral"]
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>(),
        &[
            ("p50".into(), pauses.iter().map(|x| q(x, "p50")).collect()),
            ("p99".into(), pauses.iter().map(|x| q(x, "p99")).collect()),
            ("max".into(), pauses.iter().map(|x| q(x, "max")).collect()),
        ],
        &[],
        false,
    )?;
    finish(root)
}

fn kv(path: &Path, r: &Value) -> Result<()> {
    let sweep = &r["sweep"];
    let pts = |mode: &str, key: &str| -> Vec<(f64, f64)> {
        sweep[mode]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|p| {
                        Some((
                            p["offered_rps"].as_f64()? / 1000.0,
                            spread(&p[key])?.med.min(600.0),
                        ))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let bound = r["p95_bound_us"].as_f64().unwrap_or(200.0);
    let root = canvas(path, (900, 480))?;
    lines(
        &root,
        "Key-value store, YCSB B: latency against offered load (capped at 600 µs)",
        "offered load (k req/s)",
        "µs",
        &[
            ("client push p95".into(), pts("client_push", "p95_us")),
            ("server-side p95".into(), pts("server_side", "p95_us")),
            ("client push p50".into(), pts("client_push", "p50_us")),
            ("server-side p50".into(), pts("server_side", "p50_us")),
        ],
        Some((bound, "p95 bound")),
    )?;
    finish(root)
}

fn rendezvous(path: &Path, r: &Value) -> Result<()> {
    let Some(b) = r["backends"].as_object() else {
        return Ok(());
    };
    let series = |what: &str| -> Vec<(String, Vec<(f64, f64)>)> {
        b.iter()
            .filter_map(|(name, sizes)| {
                let sizes = sizes.as_object()?;
                let mut v: Vec<(f64, f64)> = sizes
                    .iter()
                    .filter_map(|(n, x)| Some((n.parse().ok()?, x[what]["p50_ms"].as_f64()?)))
                    .collect();
                v.sort_by(|a, b| a.0.total_cmp(&b.0));
                Some((name.clone(), v))
            })
            .collect()
    };
    let root = canvas(path, (1000, 420))?;
    let (a, c) = root.split_horizontally(500);
    lines(
        &a,
        "Join p50 (ms)",
        "group size N",
        "ms",
        &series("join"),
        None,
    )?;
    lines(
        &c,
        "Commit p50 (ms)",
        "group size N",
        "ms",
        &series("commit"),
        None,
    )?;
    finish(root)
}

fn etl(path: &Path, r: &Value) -> Result<()> {
    let Some(b) = r["brokers"].as_object() else {
        return Ok(());
    };
    let series = |what: &str| -> Vec<(String, Vec<(f64, f64)>)> {
        b.iter()
            .filter_map(|(name, e)| {
                let v = e["points"]
                    .as_array()?
                    .iter()
                    .filter_map(|p| {
                        Some((p["offered_per_s"].as_f64()?, p[what].as_f64()? / 1000.0))
                    })
                    .collect::<Vec<_>>();
                (!v.is_empty()).then(|| (name.clone(), v))
            })
            .collect()
    };
    let root = canvas(path, (1000, 420))?;
    let (a, c) = root.split_horizontally(500);
    lines(
        &a,
        "End-to-end p50 (ms)",
        "offered load (records/s)",
        "ms",
        &series("p50_us"),
        None,
    )?;
    lines(
        &c,
        "End-to-end p99 (ms)",
        "offered load (records/s)",
        "ms",
        &series("p99_us"),
        None,
    )?;
    finish(root)
}

/// Per broker and baseline, Chunnel / client crate: p50 latency and throughput.
fn pubsub(path: &Path, r: &Value) -> Result<()> {
    let Some(b) = r["brokers"].as_object() else {
        return Ok(());
    };
    let mut groups = Vec::new();
    let (mut lat, mut tput) = (Vec::new(), Vec::new());
    for key in ["redis", "nats", "kafka"] {
        let Some(x) = b.get(key) else { continue };
        groups.push(key.to_string());
        lat.push(spread(&x["ratio_latency_p50"]));
        tput.push(spread(&x["ratio_throughput"]));
        for (name, e) in x["baselines"].as_object().into_iter().flatten() {
            groups.push(format!("{key} ({name})"));
            lat.push(spread(&e["ratio_latency_p50"]));
            tput.push(spread(&e["ratio_throughput"]));
        }
    }
    let root = canvas(path, (1000, 440))?;
    bars(
        &root,
        "Pub/sub Chunnel / the broker's client crate (median, min–max)",
        "Chunnel / direct",
        &groups,
        &[("p50 latency".into(), lat), ("throughput".into(), tput)],
        &[(1.1, "latency bar"), (0.9, "throughput bar")],
        true,
    )?;
    finish(root)
}

fn datapaths(path: &Path, r: &Value) -> Result<()> {
    let d = &r["datapaths"];
    let keys = ["kernel_udp", "io_uring", "shared_memory", "af_xdp"];
    let present: Vec<&str> = keys
        .into_iter()
        .filter(|k| d[k]["p50_ratio_lib_over_raw"].is_object())
        .collect();
    let root = canvas(path, (900, 450))?;
    bars(
        &root,
        "Each datapath through the library / its raw baseline",
        "ratio to raw",
        &present
            .iter()
            .map(|s| s.replace('_', " "))
            .collect::<Vec<_>>(),
        &[
            (
                "p50 / raw".into(),
                present
                    .iter()
                    .map(|k| spread(&d[k]["p50_ratio_lib_over_raw"]))
                    .collect(),
            ),
            (
                "64 B throughput / raw".into(),
                present
                    .iter()
                    .map(|k| spread(&d[k]["throughput_ratio_lib_over_raw"]))
                    .collect(),
            ),
        ],
        &[(1.0, "raw"), (1.1, "bar 1.10 (p50)")],
        true,
    )?;
    finish(root)
}

fn figure7(path: &Path, r: &Value) -> Result<()> {
    let f7 = &r["figure7"];
    let Some(rows) = f7["results"].as_array() else {
        return Ok(());
    };
    let sizes: Vec<u64> = f7["sizes"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let series: Vec<(String, Vec<(f64, f64)>)> = sizes
        .iter()
        .map(|s| {
            let mut v: Vec<(f64, f64)> = rows
                .iter()
                .filter(|x| x["size"].as_u64() == Some(*s))
                .filter_map(|x| Some((x["layers"].as_f64()?, spread(&x["rtt_p50_us"])?.med)))
                .collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            (format!("{s} B"), v)
        })
        .collect();
    let root = canvas(path, (900, 450))?;
    lines(
        &root,
        "Figure 7 on shared memory: round-trip p50 against no-op layers",
        "layers",
        "p50 µs",
        &series,
        None,
    )?;
    finish(root)
}

fn secure(path: &Path, r: &Value) -> Result<()> {
    let t = &r["transports"];
    let metrics = [
        ("connect_first_echo_p50", "connect + echo"),
        ("echo_p50", "echo p50"),
        ("bulk_throughput", "bulk MiB/s"),
        ("bulk_throughput_per_cpu_s", "bulk per CPU-s"),
    ];
    let mut groups: Vec<String> = metrics.iter().map(|m| m.1.to_string()).collect();
    groups.push("negotiated reconnect".into());
    let per = |tr: &str| -> Vec<Option<Spread>> {
        let mut v: Vec<Option<Spread>> = metrics
            .iter()
            .map(|(k, _)| spread(&t[tr]["ratios_library_over_raw"][k]))
            .collect();
        v.push(if tr == "quic_stream" {
            spread(&r["negotiated"]["ratios_over_raw_quinn"]["connect_first_echo_p50"])
        } else {
            None
        });
        v
    };
    let root = canvas(path, (1000, 460))?;
    bars(
        &root,
        "chunnel-secure / tokio-rustls and quinn used directly (median, min–max)",
        "library / raw",
        &groups,
        &[
            ("TLS over TCP".into(), per("tls_over_tcp")),
            ("QUIC (stream)".into(), per("quic_stream")),
        ],
        &[(1.0, "raw")],
        true,
    )?;
    finish(root)
}

fn uring(path: &Path, r: &Value) -> Result<()> {
    let v = &r["variants"];
    let names = [
        "raw_uring",
        "uring_lib",
        "uring_lib_any_thread",
        "kernel_lib",
    ];
    let present: Vec<&str> = names.into_iter().filter(|n| v[n].is_object()).collect();
    let groups: Vec<String> = present.iter().map(|s| s.replace('_', " ")).collect();
    let root = canvas(path, (1000, 420))?;
    let (a, b) = root.split_horizontally(500);
    bars(
        &a,
        "io_uring round trip p50 (µs)",
        "µs",
        &groups,
        &[(
            "p50".into(),
            present
                .iter()
                .map(|n| spread(&v[n]["rtt_p50_us"]))
                .collect(),
        )],
        &[],
        false,
    )?;
    bars(
        &b,
        "io_uring round trip p99 (µs)",
        "µs",
        &groups,
        &[(
            "p99".into(),
            present
                .iter()
                .map(|n| spread(&v[n]["rtt_p99_us"]))
                .collect(),
        )],
        &[],
        false,
    )?;
    finish(root)
}

/// The determinism experiment: the periodic flow's one-way p50 and p99 per policy.
fn sched(path: &Path, r: &Value) -> Result<()> {
    let res = &r["results"];
    let modes = [
        ("alone", "alone"),
        ("fifo", "FIFO"),
        ("priority", "priority"),
        ("time_aware", "time-aware"),
    ];
    let groups: Vec<String> = modes.iter().map(|m| m.1.to_string()).collect();
    let col =
        |q: &str| -> Vec<Option<Spread>> { modes.iter().map(|m| spread(&res[m.0][q])).collect() };
    let c = &r["config"];
    let title = format!(
        "1 ms flow one-way latency (µs), bulk {}×{} B every {} µs",
        c["bulk_burst"], r["bulk_size"], c["bulk_every_us"]
    );
    let root = canvas(path, (900, 420))?;
    bars(
        &root,
        &title,
        "µs",
        &groups,
        &[
            ("p50".into(), col("one_way_p50_us")),
            ("p99".into(), col("one_way_p99_us")),
        ],
        &[],
        false,
    )?;
    finish(root)
}

fn draw_soak(path: &Path, s: &Soak) -> Result<()> {
    let t0 = s.first().t_s;
    let col = |f: fn(&super::soak::Row) -> f64| -> Vec<(f64, f64)> {
        s.rows.iter().map(|r| ((r.t_s - t0) / 60.0, f(r))).collect()
    };
    let served: Vec<(f64, f64)> = s
        .served_per_s()
        .into_iter()
        .map(|(t, v)| ((t - t0) / 60.0, v))
        .collect();
    let root = canvas(path, (1100, 760))?;
    let panels = root.split_evenly((2, 2));
    lines(
        &panels[0],
        "Requests served per second",
        "minutes",
        "req/s",
        &[("served/s".into(), served)],
        None,
    )?;
    lines(
        &panels[1],
        "Errors, lost, malformed (cumulative)",
        "minutes",
        "count",
        &[
            ("errors".into(), col(|r| r.errors)),
            ("lost".into(), col(|r| r.lost)),
            ("malformed".into(), col(|r| r.malformed)),
        ],
        None,
    )?;
    lines(
        &panels[2],
        "Resident memory (KiB)",
        "minutes",
        "KiB",
        &[("rss_kb".into(), col(|r| r.rss_kb))],
        None,
    )?;
    lines(
        &panels[3],
        "Open file descriptors",
        "minutes",
        "fds",
        &[("fds".into(), col(|r| r.fds))],
        None,
    )?;
    finish(root)
}
