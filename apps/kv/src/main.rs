//! `chunnel-kv`: run a sharded store or talk to one.
//!
//! ```text
//! chunnel-kv serve --addr 127.0.0.1:7000 --shards 4 [--no-client-push] [--control PATH]
//! chunnel-kv load  --addr 127.0.0.1:7000 --control PATH [--rate 200] [--writers 4]
//!                  [--ramp RATE:SECS,...] [--autopilot] [--autopilot-rule RULE]
//! chunnel-kv put   --addr 127.0.0.1:7000 KEY VALUE [--offer both|client-push|server-side]
//! chunnel-kv get   --addr 127.0.0.1:7000 KEY
//! chunnel-kv delete --addr 127.0.0.1:7000 KEY
//! ```
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use chunnel_ctl::{Endpoint, Registry};
use chunnel_kv::live::{self, LiveClient};
use chunnel_kv::{ClientConfig, KvClient, KvServer, Offer, ServerConfig};
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(about = "A sharded key-value store on Chunnels")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum OfferArg {
    Both,
    ClientPush,
    ServerSide,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serves until interrupted.
    Serve {
        /// Canonical address.
        #[arg(long, default_value = "127.0.0.1:7000")]
        addr: SocketAddr,
        /// Number of shards.
        #[arg(long, default_value_t = 4)]
        shards: usize,
        /// Offer only server-side sharding.
        #[arg(long)]
        no_client_push: bool,
        /// Serve a control endpoint (chunnelctl) on this Unix socket path (default:
        /// $CHUNNEL_CONTROL, if set).
        #[arg(long)]
        control: Option<PathBuf>,
    },
    /// Runs checked traffic over a client whose sharding mode can be switched live (by
    /// `chunnelctl switch`), until interrupted.
    Load {
        #[arg(long, default_value = "127.0.0.1:7000")]
        addr: SocketAddr,
        /// The control endpoint's Unix socket path (default: $CHUNNEL_CONTROL).
        #[arg(long)]
        control: Option<PathBuf>,
        /// Requests per second, in total (the `rate` policy; chunnelctl can change it).
        #[arg(long, default_value_t = 200)]
        rate: u32,
        /// Concurrent writers, one key each.
        #[arg(long, default_value_t = 4)]
        writers: usize,
        /// A load ramp: RATE:SECONDS steps, comma separated (e.g. 100:10,800:20,100:20); the
        /// `rate` policy follows it and stays at the last step.
        #[arg(long, value_parser = live::parse_ramp)]
        ramp: Option<live::Ramp>,
        /// Run the autopilot: client push as the request rate rises, server-side sharding
        /// as it falls (the rule `autopilot.sharding`, see --autopilot-rule).
        #[arg(long)]
        autopilot: bool,
        /// The autopilot's rule (implies --autopilot).
        #[arg(long, default_value = live::AUTOPILOT_RULE)]
        autopilot_rule: String,
        /// Milliseconds between the autopilot's samples.
        #[arg(long, default_value_t = 200)]
        autopilot_interval: u64,
    },
    /// Reads a key.
    Get {
        #[arg(long, default_value = "127.0.0.1:7000")]
        addr: SocketAddr,
        #[arg(long, value_enum, default_value = "both")]
        offer: OfferArg,
        key: String,
    },
    /// Writes a key.
    Put {
        #[arg(long, default_value = "127.0.0.1:7000")]
        addr: SocketAddr,
        #[arg(long, value_enum, default_value = "both")]
        offer: OfferArg,
        key: String,
        value: String,
    },
    /// Removes a key.
    Delete {
        #[arg(long, default_value = "127.0.0.1:7000")]
        addr: SocketAddr,
        #[arg(long, value_enum, default_value = "both")]
        offer: OfferArg,
        key: String,
    },
}

fn show(v: Option<Vec<u8>>) -> String {
    match v {
        Some(v) => String::from_utf8_lossy(&v).into_owned(),
        None => "(none)".into(),
    }
}

async fn client(addr: SocketAddr, offer: OfferArg) -> anyhow::Result<KvClient> {
    let offer = match offer {
        OfferArg::Both => Offer::Both,
        OfferArg::ClientPush => Offer::ClientPush,
        OfferArg::ServerSide => Offer::ServerSide,
    };
    let c = KvClient::connect(addr, ClientConfig::default().with_offer(offer)).await?;
    eprintln!("sharding: {:?}", c.sharding());
    Ok(c)
}

/// The control endpoint at `path` (else `$CHUNNEL_CONTROL`), with its registry.
fn control_endpoint(
    path: Option<PathBuf>,
    name: &str,
) -> anyhow::Result<Option<(Registry, Endpoint)>> {
    let registry = Registry::new(name);
    let cfg = match path {
        Some(p) => Some(chunnel_ctl::Config::new(p)),
        None => chunnel_ctl::Config::from_env(),
    };
    let Some(cfg) = cfg else { return Ok(None) };
    let endpoint =
        Endpoint::bind(cfg, registry.clone()).context("starting the control endpoint")?;
    Ok(Some((registry, endpoint)))
}

fn cfg_interval(ms: u64) -> std::time::Duration {
    std::time::Duration::from_millis(ms.max(1))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Serve {
            addr,
            shards,
            no_client_push,
            control,
        } => {
            let cfg = ServerConfig::new(shards).with_client_push(!no_client_push);
            let (server, _endpoint) = match control_endpoint(control, "chunnel-kv serve")? {
                Some((registry, endpoint)) => (
                    KvServer::start_with_control(addr, cfg, registry).await?,
                    Some(endpoint),
                ),
                None => (KvServer::start(addr, cfg).await?, None),
            };
            if let Some(e) = &_endpoint {
                println!("control endpoint at {}", e.path().display());
            }
            println!(
                "serving on {} with shards {:?}",
                server.addr(),
                server.shard_addrs()
            );
            tokio::signal::ctrl_c().await?;
        }
        Cmd::Load {
            addr,
            control,
            rate,
            writers,
            ramp,
            autopilot,
            autopilot_rule,
            autopilot_interval,
        } => {
            let Some((registry, endpoint)) = control_endpoint(control, "chunnel-kv load")? else {
                anyhow::bail!("load needs a control endpoint: --control PATH or $CHUNNEL_CONTROL");
            };
            let rate = registry.policy(
                "rate",
                "requests per second of the load, in total",
                &rate.to_string(),
                live::valid_rate,
            )?;
            let client = Arc::new(LiveClient::connect(addr, ClientConfig::default()).await?);
            let _guard = client.register(&registry, live::ENTRY);
            let autopilot = autopilot || autopilot_rule != live::AUTOPILOT_RULE;
            let _pilot = if autopilot {
                let cfg = chunnel_ctl::autopilot::Config {
                    interval: cfg_interval(autopilot_interval),
                    ..Default::default()
                };
                let p = chunnel_ctl::autopilot::Autopilot::start(
                    &registry,
                    cfg,
                    [("sharding", autopilot_rule.as_str())],
                )?;
                println!("autopilot on: {autopilot_rule}");
                // Its decisions, as they are made (they are also tracing events, and
                // `chunnelctl autopilot` shows the log).
                let every = cfg_interval(autopilot_interval);
                let log = p.log();
                tokio::spawn(async move {
                    let mut seen = 0;
                    loop {
                        tokio::time::sleep(every).await;
                        for d in log.decisions(seen) {
                            seen = d.seq;
                            eprintln!(
                                "autopilot #{} {:.1}s {:?}: {}",
                                d.seq,
                                d.at_ms as f64 / 1000.0,
                                d.verdict,
                                d.reason
                            );
                        }
                    }
                });
                Some(p)
            } else {
                None
            };
            if let Some(steps) = ramp {
                tokio::spawn(live::ramp(registry.clone(), steps));
            }
            println!(
                "loading {addr} at {} requests/s; control endpoint at {}",
                rate.get(),
                endpoint.path().display()
            );
            live::load(client, writers, rate, async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await;
        }
        Cmd::Get { addr, offer, key } => {
            println!(
                "{}",
                show(client(addr, offer).await?.get(key.as_bytes()).await?)
            );
        }
        Cmd::Put {
            addr,
            offer,
            key,
            value,
        } => {
            let c = client(addr, offer).await?;
            println!("{}", show(c.put(key.as_bytes(), value.as_bytes()).await?));
        }
        Cmd::Delete { addr, offer, key } => {
            println!(
                "{}",
                show(client(addr, offer).await?.delete(key.as_bytes()).await?)
            );
        }
    }
    Ok(())
}
