//! The negotiated options: the `endpoint` capability that carries each transport's address,
//! [`Option3`] and the three-way [`Choice`] a client and a server negotiate.

use std::net::SocketAddr;

use chunnel::negotiate::{Capability, ChunnelInfo, Negotiate};
use chunnel::{Chunnel, ChunnelConnection, Select, select};

use super::Transport;

/// The capability kind of the options: `endpoint = {<transport>}` at the client,
/// `endpoint = {<transport>, "addr=<ip:port>"}` at the server (exact; the server's rule
/// compares the transport label only).
pub const CAPABILITY: &str = "endpoint";
const ADDR_PREFIX: &str = "addr=";

/// The server's rule: the client's `endpoint` capability names our transport.
fn endpoint_rule(ours: &Capability, theirs: &Capability) -> bool {
    ours.labels
        .first()
        .is_some_and(|t| theirs.labels.iter().any(|l| l == t))
}

/// One option of the negotiated choice: a transport (with, at the server, its endpoint's
/// address), or an empty slot that is never offered. Builds no layer: the datapath is set up
/// after negotiation, on the endpoint the accept names.
#[derive(Clone, Debug)]
pub struct Option3 {
    transport: Option<Transport>,
    addr: Option<SocketAddr>,
}

impl Negotiate for Option3 {
    fn id(&self) -> &'static str {
        self.transport
            .map_or("chunnel/endpoint-none/1", Transport::id)
    }

    fn capabilities(&self) -> Vec<Capability> {
        let Some(t) = self.transport else {
            return Vec::new();
        };
        match self.addr {
            None => vec![Capability::exact(CAPABILITY, [t.label()])],
            Some(a) => vec![
                Capability::exact(
                    CAPABILITY,
                    [t.label().to_string(), format!("{ADDR_PREFIX}{a}")],
                )
                .with_rule(endpoint_rule),
            ],
        }
    }

    fn check_available(&self) -> Result<(), chunnel::Error> {
        match self.transport {
            Some(_) => Ok(()),
            None => Err(chunnel::Error::NotAvailable {
                chunnel: "chunnel/endpoint-none/1",
                reason: "empty slot".into(),
            }),
        }
    }
}

impl<C: ChunnelConnection + Send> Chunnel<C> for Option3 {
    type Connection = C;

    async fn connect_wrap(&mut self, inner: C) -> Result<C, chunnel::Error> {
        Ok(inner)
    }
}

/// The offered choice: up to three transports, preferred first.
pub type Choice = Select<Option3, Select<Option3, Option3>>;

pub(super) fn choice(order: &[(Transport, Option<SocketAddr>)]) -> Choice {
    let slot = |i: usize| Option3 {
        transport: order.get(i).map(|o| o.0),
        addr: order.get(i).and_then(|o| o.1),
    };
    select(slot(0), select(slot(1), slot(2)))
}

/// The transport and endpoint address of a server stack (the accept's `server_stack`).
pub(super) fn parse_server_stack(stack: &[ChunnelInfo]) -> Option<(Transport, SocketAddr)> {
    let c = stack.first()?;
    let t = Transport::from_id(&c.id)?;
    let addr = c
        .capabilities
        .iter()
        .filter(|c| c.kind == CAPABILITY)
        .flat_map(|c| &c.labels)
        .find_map(|l| l.strip_prefix(ADDR_PREFIX)?.parse().ok())?;
    Some((t, addr))
}
