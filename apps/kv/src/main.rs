//! `chunnel-kv`: run a sharded store or talk to one.
//!
//! ```text
//! chunnel-kv serve --addr 127.0.0.1:7000 --shards 4 [--no-client-push]
//! chunnel-kv put   --addr 127.0.0.1:7000 KEY VALUE [--offer both|client-push|server-side]
//! chunnel-kv get   --addr 127.0.0.1:7000 KEY
//! chunnel-kv delete --addr 127.0.0.1:7000 KEY
//! ```
#![forbid(unsafe_code)]

use std::net::SocketAddr;

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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Serve {
            addr,
            shards,
            no_client_push,
        } => {
            let cfg = ServerConfig::new(shards).with_client_push(!no_client_push);
            let server = KvServer::start(addr, cfg).await?;
            println!(
                "serving on {} with shards {:?}",
                server.addr(),
                server.shard_addrs()
            );
            tokio::signal::ctrl_c().await?;
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
