//! The bounds of the sharding machinery: [`Config`].

/// Bounds of the sharding machinery.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Requests queued per shard; a full queue makes forwarders wait.
    pub shard_queue: usize,
    /// Replies queued per connection; a reply that does not fit is dropped and counted.
    pub reply_queue: usize,
    /// Messages a client-side connection buffers between its sockets and `recv`.
    pub merge_queue: usize,
    /// Peers one shard socket serves at once; datagrams from further peers are ignored.
    pub max_peers: usize,
    /// Messages moved per `recv`/`send` call inside the machinery.
    pub batch: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            shard_queue: 1024,
            reply_queue: 1024,
            merge_queue: 1024,
            max_peers: 4096,
            batch: 32,
        }
    }
}

impl Config {
    /// Sets [`Config::shard_queue`].
    pub fn with_shard_queue(mut self, n: usize) -> Self {
        self.shard_queue = n.max(1);
        self
    }

    /// Sets [`Config::reply_queue`].
    pub fn with_reply_queue(mut self, n: usize) -> Self {
        self.reply_queue = n.max(1);
        self
    }

    /// Sets [`Config::max_peers`].
    pub fn with_max_peers(mut self, n: usize) -> Self {
        self.max_peers = n.max(1);
        self
    }
}
