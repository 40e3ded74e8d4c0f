//! `chunnelctl`: see and steer the live stacks of a process that runs a control endpoint
//! (`chunnel-ctl`).
//!
//! ```text
//! chunnelctl [--socket PATH] [--json] ls
//! chunnelctl show ID
//! chunnelctl switch (ID | --all) BRANCH [--commit]
//! chunnelctl policy [NAME [VALUE]]
//! chunnelctl watch [ID] [--interval MS] [--count N]
//! chunnelctl autopilot [--entry ID] [--since SEQ]
//! ```
//!
//! The endpoint is `--socket`, else `$CHUNNEL_CONTROL`. Human output is aligned tables;
//! `--json` prints the endpoint's answers as JSON (one line per `watch` snapshot), and errors
//! as `{"error": {"code": ..., "message": ...}}`. The exit status is 1 on any error.
#![forbid(unsafe_code)]

mod table;

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use chunnel_ctl::proto::{Decision, EntryView, Op, Reply, Target};
use chunnel_ctl::{Client, Error};
use clap::{Parser, Subcommand};
use serde_json::json;

use crate::table::Table;

#[derive(Parser)]
#[command(name = "chunnelctl", about = "See and steer live Chunnel stacks")]
struct Cli {
    /// The control socket (default: $CHUNNEL_CONTROL).
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Lists live connections and listeners.
    Ls,
    /// Shows one entry: stack, negotiation, branches, counters.
    Show {
        /// The entry's id (from `ls`).
        id: u64,
    },
    /// Switches a connection (or every switchable one) to a branch.
    Switch {
        /// Every switchable entry.
        #[arg(long)]
        all: bool,
        /// By two-phase commit with the peer (else this end alone).
        #[arg(long)]
        commit: bool,
        /// `ID BRANCH`, or `BRANCH` with --all. BRANCH is a name from `show` or an index.
        #[arg(num_args = 1..=2, required = true)]
        args: Vec<String>,
    },
    /// Reads policies, or sets one.
    Policy {
        /// The policy.
        name: Option<String>,
        /// Its new value.
        value: Option<String>,
    },
    /// Live counters, refreshed in place.
    Watch {
        /// One entry (default: all).
        id: Option<u64>,
        /// Milliseconds between refreshes.
        #[arg(long, default_value_t = 1000)]
        interval: u64,
        /// Stop after this many refreshes (default: until interrupted).
        #[arg(long)]
        count: Option<u64>,
    },
    /// The autopilot: its rules and its decision log (every switch it made or held back,
    /// and why). Turn it off with `policy autopilot off`, change a rule with `policy
    /// autopilot.NAME '...'`.
    Autopilot {
        /// Only the decisions about this entry.
        #[arg(long)]
        entry: Option<u64>,
        /// Only the decisions after this sequence number.
        #[arg(long)]
        since: Option<u64>,
    },
}

fn main() {
    let cli = Cli::parse();
    let json = cli.json;
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => fail(json, "runtime", &e.to_string()),
    };
    if let Err(e) = rt.block_on(run(cli)) {
        let code = match e.downcast_ref::<Error>() {
            Some(Error::Remote { code, .. } | Error::Refused { code, .. }) => {
                serde_json::to_value(code)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_else(|| "error".into())
            }
            Some(Error::NoSocket { .. }) => "no-socket".into(),
            Some(Error::PermissionDenied { .. }) => "permission-denied".into(),
            Some(Error::Version { .. }) => "version".into(),
            _ => "error".into(),
        };
        fail(json, &code, &format!("{e:#}"));
    }
}

fn fail(json: bool, code: &str, message: &str) -> ! {
    if json {
        println!("{}", json!({"error": {"code": code, "message": message}}));
    } else {
        eprintln!("chunnelctl: {message}");
    }
    std::process::exit(1)
}

async fn run(cli: Cli) -> Result<()> {
    let Some(path) = cli
        .socket
        .or_else(|| std::env::var_os(chunnel_ctl::ENV).map(PathBuf::from))
    else {
        bail!(
            "no control endpoint given: pass --socket PATH or set {}",
            chunnel_ctl::ENV
        );
    };
    let mut c = Client::connect(&path).await?;
    let json = cli.json;
    match cli.cmd {
        Cmd::Ls => {
            let reply = c.request(&Op::Ls).await?;
            if json {
                return print_json(&reply);
            }
            let Reply::Ls { entries, left_off } = reply else {
                bail!("unexpected answer");
            };
            let (pid, name) = c.process();
            println!("{name} (pid {pid}): {} entries", entries.len());
            print!("{}", ls_table(&entries));
            if left_off > 0 {
                println!("({left_off} more not listed)");
            }
        }
        Cmd::Show { id } => {
            let reply = c.request(&Op::Show { id }).await?;
            if json {
                return print_json(&reply);
            }
            let Reply::Show { entry } = reply else {
                bail!("unexpected answer");
            };
            print!("{}", show(&entry));
        }
        Cmd::Switch { all, commit, args } => {
            let (target, branch) = match (all, args.as_slice()) {
                (true, [branch]) => (Target::All, branch.clone()),
                (false, [id, branch]) => (
                    Target::Id(
                        id.parse()
                            .with_context(|| format!("not an entry id: {id:?}"))?,
                    ),
                    branch.clone(),
                ),
                (true, _) => bail!("with --all, give only the branch"),
                (false, _) => bail!("give the entry's id and the branch (or --all and the branch)"),
            };
            let reply = c
                .request(&Op::Switch {
                    target,
                    branch,
                    commit,
                })
                .await?;
            if json {
                print_json(&reply)?;
            }
            let Reply::Switch { results } = reply else {
                bail!("unexpected answer");
            };
            if !json {
                let mut t = Table::new(["ID", "RESULT", "FROM", "TO", "EPOCH", "DETAIL"]);
                for r in &results {
                    let result = match (r.ok, r.changed) {
                        (true, true) => "switched",
                        (true, false) => "unchanged",
                        (false, _) => "failed",
                    };
                    t.row([
                        r.id.to_string(),
                        result.into(),
                        r.from.clone(),
                        r.to.clone(),
                        r.epoch.to_string(),
                        r.message.clone(),
                    ]);
                }
                print!("{t}");
                if results.is_empty() {
                    println!("no switchable entries");
                }
            }
            let failed = results.iter().filter(|r| !r.ok).count();
            if failed > 0 {
                bail!("{failed} of {} switches failed", results.len());
            }
        }
        Cmd::Policy { name, value } => {
            let reply = c.request(&Op::Policy { name, value }).await?;
            if json {
                return print_json(&reply);
            }
            let Reply::Policy { policies } = reply else {
                bail!("unexpected answer");
            };
            let mut t = Table::new(["NAME", "VALUE", "PREVIOUS", "DESCRIPTION"]);
            for p in policies {
                t.row([
                    p.name,
                    p.value,
                    p.previous.unwrap_or_else(|| "-".into()),
                    p.description,
                ]);
            }
            print!("{t}");
        }
        Cmd::Watch {
            id,
            interval,
            count,
        } => watch(&mut c, json, id, interval, count).await?,
        Cmd::Autopilot { entry, since } => {
            let reply = c.request(&Op::Autopilot { id: entry, since }).await?;
            if json {
                return print_json(&reply);
            }
            let Reply::Autopilot {
                running,
                enabled,
                rules,
                decisions,
                dropped,
            } = reply
            else {
                bail!("unexpected answer");
            };
            let (pid, name) = c.process();
            if !running {
                println!("{name} (pid {pid}) runs no autopilot");
                return Ok(());
            }
            println!(
                "{name} (pid {pid}): autopilot {}, {} rules",
                if enabled { "on" } else { "off" },
                rules.len()
            );
            let mut t = Table::new(["RULE", "ENABLED", "ENTRIES", "SPEC"]);
            for r in rules {
                let ids: Vec<String> = r.entries.iter().map(u64::to_string).collect();
                t.row([
                    r.name,
                    r.enabled.to_string(),
                    dash(Some(&ids.join(","))),
                    r.spec,
                ]);
            }
            print!("{t}");
            println!();
            print!("{}", decisions_table(&decisions));
            if decisions.is_empty() {
                println!("no decisions yet");
            }
            if dropped > 0 {
                println!("({dropped} older decisions no longer kept)");
            }
        }
    }
    Ok(())
}

fn print_json(reply: &Reply) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, reply)?;
    writeln!(out)?;
    Ok(())
}

fn dash(s: Option<&str>) -> String {
    s.filter(|s| !s.is_empty()).unwrap_or("-").to_owned()
}

fn ls_table(entries: &[EntryView]) -> Table {
    let mut t = Table::new([
        "ID", "KIND", "NAME", "PEER", "BRANCH", "EPOCH", "STACK", "AGE",
    ]);
    for e in entries {
        t.row([
            e.id.to_string(),
            format!("{:?}", e.kind).to_lowercase(),
            e.name.clone(),
            dash(e.peer.as_deref()),
            dash(e.branch.as_deref()),
            e.epoch.to_string(),
            dash(Some(&e.stack.join(" | "))),
            age(e.age_ms),
        ]);
    }
    t
}

fn rate(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{r:.1}/s"))
}

/// A decision's verdict as on the wire (`within-dwell`...).
fn verdict(d: &Decision) -> String {
    serde_json::to_value(d.verdict)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn decisions_table(decisions: &[Decision]) -> Table {
    let mut t = Table::new([
        "SEQ", "AT", "RULE", "ENTRY", "VERDICT", "FROM", "TO", "RATE", "WHY",
    ]);
    for d in decisions {
        t.row([
            d.seq.to_string(),
            format!("{:.1}s", d.at_ms as f64 / 1000.0),
            d.rule.clone(),
            d.entry.map_or_else(|| "-".into(), |e| e.to_string()),
            verdict(d),
            dash(Some(&d.from)),
            dash(Some(&d.to)),
            rate(d.rate),
            d.reason.clone(),
        ]);
    }
    t
}

fn age(ms: u64) -> String {
    match ms / 1000 {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s => format!("{}h", s / 3600),
    }
}

fn show(e: &EntryView) -> String {
    let mut t = Table::new(["FIELD", "VALUE"]);
    t.row(["id".into(), e.id.to_string()]);
    t.row(["kind".into(), format!("{:?}", e.kind).to_lowercase()]);
    t.row(["name".into(), e.name.clone()]);
    t.row(["peer".into(), dash(e.peer.as_deref())]);
    t.row(["stack".into(), dash(Some(&e.stack.join(" | ")))]);
    t.row(["epoch".into(), e.epoch.to_string()]);
    if !e.branches.is_empty() {
        t.row(["branch".into(), dash(e.branch.as_deref())]);
        let how = if e.commit_only {
            " (switch with --commit only)"
        } else {
            ""
        };
        t.row(["branches".into(), format!("{}{how}", e.branches.join(", "))]);
    }
    if let Some(n) = &e.negotiation {
        t.row(["role".into(), n.role.clone()]);
        t.row([
            "client stack".into(),
            dash(Some(&n.client_stack.join(" | "))),
        ]);
        t.row([
            "server stack".into(),
            dash(Some(&n.server_stack.join(" | "))),
        ]);
        t.row(["client pick".into(), format!("{:?}", n.client_pick)]);
        t.row(["server pick".into(), format!("{:?}", n.server_pick)]);
        t.row(["0-rtt".into(), n.zero_rtt.clone()]);
        t.row(["hellos sent".into(), n.hellos_sent.to_string()]);
    }
    t.row(["age".into(), age(e.age_ms)]);
    if let Some(a) = &e.autopilot {
        t.row(["autopilot rule".into(), a.rule.clone()]);
        t.row([
            "autopilot rate".into(),
            format!("{} over {} ms", rate(a.rate), a.window_ms),
        ]);
        if let Some(d) = &a.last {
            t.row([
                "autopilot last".into(),
                format!("#{} {}: {}", d.seq, verdict(d), d.reason),
            ]);
        }
    }
    let mut out = t.to_string();
    if !e.counters.is_empty() {
        out.push('\n');
        let mut c = Table::new(["LAYER", "COUNTER", "VALUE"]);
        for l in &e.counters {
            for k in &l.counters {
                c.row([l.layer.clone(), k.name.clone(), k.value.to_string()]);
            }
        }
        out.push_str(&c.to_string());
    }
    out
}

async fn watch(
    c: &mut Client,
    json: bool,
    id: Option<u64>,
    interval: u64,
    count: Option<u64>,
) -> Result<()> {
    c.send(&Op::Watch {
        id,
        interval_ms: interval,
        count,
    })
    .await?;
    let tty = std::io::stdout().is_terminal();
    let mut before: HashMap<(u64, String, String), (u64, u64)> = HashMap::new();
    loop {
        let (reply, more) = c.next().await?;
        if json {
            print_json(&reply)?;
        } else {
            let Reply::Watch {
                seq,
                at_ms,
                entries,
            } = reply
            else {
                bail!("unexpected answer");
            };
            let mut t = Table::new([
                "ID", "NAME", "BRANCH", "EPOCH", "LAYER", "COUNTER", "VALUE", "PER SEC",
            ]);
            for e in &entries {
                for l in &e.counters {
                    for k in &l.counters {
                        let key = (e.id, l.layer.clone(), k.name.clone());
                        let rate = match before.insert(key, (at_ms, k.value)) {
                            Some((t0, v0)) if at_ms > t0 => format!(
                                "{:.0}",
                                k.value.saturating_sub(v0) as f64 * 1000.0 / (at_ms - t0) as f64
                            ),
                            _ => "-".into(),
                        };
                        t.row([
                            e.id.to_string(),
                            e.name.clone(),
                            dash(e.branch.as_deref()),
                            e.epoch.to_string(),
                            l.layer.clone(),
                            k.name.clone(),
                            k.value.to_string(),
                            rate,
                        ]);
                    }
                }
                if e.counters.is_empty() {
                    t.row([
                        e.id.to_string(),
                        e.name.clone(),
                        dash(e.branch.as_deref()),
                        e.epoch.to_string(),
                        "-".into(),
                        "-".into(),
                        "-".into(),
                        "-".into(),
                    ]);
                }
            }
            let mut out = std::io::stdout().lock();
            if tty {
                // Home the cursor and clear the screen: the table is redrawn in place.
                write!(out, "\x1b[H\x1b[2J")?;
            } else if seq > 0 {
                writeln!(out)?;
            }
            let (pid, name) = c.process();
            writeln!(
                out,
                "{name} (pid {pid}) snapshot {} every {interval} ms",
                seq + 1
            )?;
            write!(out, "{t}")?;
            out.flush()?;
        }
        if !more {
            return Ok(());
        }
    }
}
