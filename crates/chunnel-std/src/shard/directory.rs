//! The shard-set advertisement (the exact `shard` capability and its rule) and
//! [`ShardDirectory`], where a client learns the set from the negotiated server stack.

use std::sync::{Arc, OnceLock};

use chunnel::{Capability, ChunnelInfo};

use crate::Error;

use super::*;

/// The server's client-push rule: the client's `shard` capability must name client push and
/// our hash function; the addresses are ours alone.
fn client_push_rule(ours: &Capability, theirs: &Capability) -> bool {
    let has = |c: &Capability, l: &str| c.labels.iter().any(|x| x == l);
    has(theirs, CLIENT_PUSH) && has(theirs, HASH_LABEL) && has(ours, HASH_LABEL)
}

/// The client-push advertisement of a shard set (see the [module docs](super)).
pub fn advertisement(addrs: &[String]) -> Capability {
    let mut labels = vec![CLIENT_PUSH.to_owned(), HASH_LABEL.to_owned()];
    labels.extend(
        addrs
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{SHARD_LABEL_PREFIX}{i}@{a}")),
    );
    Capability::exact(CAPABILITY, labels).with_rule(client_push_rule)
}

/// Parses a client-push advertisement into the shard addresses, by index.
pub fn parse_advertisement(cap: &Capability) -> Result<Vec<String>, Error> {
    let bad = |what: String| Error::BadShardSet { what };
    if cap.kind != CAPABILITY || !cap.labels.iter().any(|l| l == CLIENT_PUSH) {
        return Err(bad("not a client-push shard capability".into()));
    }
    if !cap.labels.iter().any(|l| l == HASH_LABEL) {
        return Err(bad(format!(
            "no `{HASH_LABEL}` label: unknown hash function"
        )));
    }
    let mut slots: Vec<Option<String>> = Vec::new();
    for l in &cap.labels {
        let Some(rest) = l.strip_prefix(SHARD_LABEL_PREFIX) else {
            continue;
        };
        let (i, addr) = rest
            .split_once('@')
            .ok_or_else(|| bad(format!("label `{l}` lacks `@`")))?;
        let i: usize = i
            .parse()
            .map_err(|_| bad(format!("label `{l}`: bad index")))?;
        if i >= MAX_SHARDS {
            return Err(bad(format!("label `{l}`: index over {MAX_SHARDS}")));
        }
        if addr.is_empty() {
            return Err(bad(format!("label `{l}`: empty address")));
        }
        if slots.len() <= i {
            slots.resize(i + 1, None);
        }
        if slots[i].replace(addr.to_owned()).is_some() {
            return Err(bad(format!("shard {i} listed twice")));
        }
    }
    if slots.is_empty() {
        return Err(bad("no shard listed".into()));
    }
    slots
        .into_iter()
        .enumerate()
        .map(|(i, a)| a.ok_or_else(|| bad(format!("shard {i} missing"))))
        .collect()
}

/// Where a [`ClientShard`] learns the shard set: shared between the Chunnel (and every
/// connection it builds) and the application, which fills it once from the negotiated server
/// stack (see the [module docs](super) for why).
#[derive(Clone, Debug, Default)]
pub struct ShardDirectory {
    addrs: Arc<OnceLock<Arc<[String]>>>,
}

impl ShardDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        ShardDirectory::default()
    }

    /// Finds the client-push advertisement in `server_stack` (the ACCEPT's server stack) and
    /// stores its addresses. Returns the shard count, or 0 if the server's stack has no
    /// advertisement (it picked server-side sharding: nothing to learn).
    pub fn learn(&self, server_stack: &[ChunnelInfo]) -> Result<usize, Error> {
        let cap = server_stack
            .iter()
            .flat_map(|c| &c.capabilities)
            .find(|c| c.kind == CAPABILITY && c.labels.iter().any(|l| l == CLIENT_PUSH));
        match cap {
            None => Ok(0),
            Some(cap) => {
                let addrs = parse_advertisement(cap)?;
                let n = addrs.len();
                self.set(addrs)?;
                Ok(n)
            }
        }
    }

    /// Stores the shard addresses (by index). A directory is filled once; setting the same
    /// set again is fine, another one is [`Error::BadShardSet`].
    pub fn set(&self, addrs: Vec<String>) -> Result<(), Error> {
        if addrs.is_empty() || addrs.len() > MAX_SHARDS {
            return Err(Error::BadShardSet {
                what: format!("{} shards (1..={MAX_SHARDS} allowed)", addrs.len()),
            });
        }
        let new: Arc<[String]> = Arc::from(addrs);
        let have = self.addrs.get_or_init(|| Arc::clone(&new));
        if **have == *new {
            Ok(())
        } else {
            Err(Error::BadShardSet {
                what: "this directory already holds another shard set".into(),
            })
        }
    }

    /// The shard addresses, once known.
    pub fn get(&self) -> Option<&[String]> {
        self.addrs.get().map(|a| &**a)
    }
}
