//! Change notifications: an etcd watch on a group's key prefix (see "Notifications" in the
//! module docs).

use std::sync::atomic::Ordering;
use std::time::Duration;

use etcd_client::{EventType, WatchOptions, WatchResponse};

use crate::store::{Changes, Committed, News, Notifier, Watch};

use super::record::{Meta, decode_transition};

use super::EtcdStore;

impl EtcdStore {
    /// The longest pause between two attempts to watch a group again after its watch broke
    /// (the pauses start at 50 ms and double up to this).
    pub const WATCH_BACKOFF: Duration = Duration::from_secs(2);

    /// How often a watch asks its member for a progress report; a watch that heard nothing
    /// since the previous request counts as broken.
    pub const WATCH_PROGRESS: Duration = Duration::from_secs(5);

    /// A watch on `group`'s record but its ballots (the keys from `members/` to the end of the
    /// group's prefix), fed by a task of its own.
    pub(super) fn watch_group(&self, group: &str) -> Watch {
        let prefix = format!("chunnel/{group}/");
        // `/` + 1: the end of the prefix.
        let range = (format!("{prefix}members/"), format!("chunnel/{group}0"));
        self.spawn_watch(prefix, range)
    }

    /// A watch on `group`'s ballots only (what a proposer waits for).
    pub(super) fn watch_group_ballots(&self, group: &str) -> Watch {
        let prefix = format!("chunnel/{group}/");
        let range = (format!("{prefix}ballots/"), format!("{prefix}ballots0"));
        self.spawn_watch(prefix, range)
    }

    fn spawn_watch(&self, prefix: String, range: (String, String)) -> Watch {
        let (watch, notifier) = Watch::new();
        let task = tokio::spawn(feed(self.clone(), prefix, range, notifier));
        watch.with_task(task)
    }
}

/// What the key `key` under the group's `prefix` is part of.
pub(super) fn kind(prefix: &[u8], key: &[u8]) -> Changes {
    match key.strip_prefix(prefix) {
        Some(rest) if rest.starts_with(b"members/") => Changes::MEMBERS,
        Some(rest) if rest.starts_with(b"ballots/") => Changes::BALLOTS,
        Some(b"meta" | b"transition") => Changes::TRANSITION,
        _ => Changes::ALL,
    }
}

/// The kinds the events of `resp` touched, and the news of its last event that carries some:
/// a put of the transition key (a proposal) or of the meta key with an outcome (a finished
/// transition, or the group's lease moved: news of a transition already finished, which
/// changes nothing). A value that does not decode carries no news (the kinds alone make the
/// participant read the record).
fn changes(prefix: &[u8], resp: &WatchResponse) -> (Changes, Option<News>) {
    let mut out = Changes::NONE;
    let mut news = None;
    for ev in resp.events() {
        let Some(kv) = ev.kv() else {
            out = Changes::ALL;
            continue;
        };
        out |= kind(prefix, kv.key());
        if ev.event_type() != EventType::Put {
            continue;
        }
        match kv.key().strip_prefix(prefix) {
            Some(b"transition") => {
                if let Ok(t) = decode_transition(kv.value()) {
                    news = Some(News::Proposed(t));
                }
            }
            Some(b"meta") => {
                if let Ok(Meta {
                    epoch,
                    stack,
                    outcome: Some(outcome),
                }) = Meta::decode(kv.value())
                {
                    news = Some(News::Finished {
                        outcome,
                        committed: Committed { epoch, stack },
                    });
                }
            }
            _ => {}
        }
    }
    (out, news)
}

/// Watches the key range `range` (start, end) under the group's `prefix` on one member at a time (the store's pinned one first, the next after
/// a failure), notifying the kinds each response's events touched. The watch is complete
/// from etcd's confirmation that it was created until it breaks (an error, the stream closed
/// or cancelled, no answer to a progress request, an answer from another cluster); then the
/// task watches again after a backoff of 50 ms doubling up to [`EtcdStore::WATCH_BACKOFF`].
/// Ends when the watch is dropped (which also aborts it).
async fn feed(store: EtcdStore, prefix: String, range: (String, String), notifier: Notifier) {
    const FIRST_BACKOFF: Duration = Duration::from_millis(50);
    let mut backoff = FIRST_BACKOFF;
    let n = store.clients.len();
    let mut at = store.pinned.load(Ordering::Relaxed);
    while !notifier.is_closed() {
        let i = at % n;
        let mut client = store.clients[i].clone();
        let options = WatchOptions::new().with_range(range.1.as_bytes());
        let opened = tokio::time::timeout(
            EtcdStore::CONNECT_TIMEOUT + EtcdStore::REQUEST_TIMEOUT,
            client.watch(range.0.as_bytes(), Some(options)),
        )
        .await;
        let why = match opened {
            Ok(Ok(mut stream)) => {
                let mut progress = tokio::time::interval(EtcdStore::WATCH_PROGRESS);
                progress.tick().await;
                let mut heard = true;
                loop {
                    tokio::select! {
                        msg = stream.message() => match msg {
                            Ok(Some(resp)) => {
                                heard = true;
                                let cluster = resp.header().map(|h| h.cluster_id());
                                if let Err(e) = store.check_cluster(i, cluster) {
                                    break e.to_string();
                                }
                                if resp.canceled() {
                                    break format!("cancelled: {}", resp.cancel_reason());
                                }
                                if resp.created() {
                                    backoff = FIRST_BACKOFF;
                                    notifier.set_complete(true);
                                }
                                match changes(prefix.as_bytes(), &resp) {
                                    (ch, Some(news)) => notifier.notify_news(ch, news),
                                    (ch, None) if !ch.is_empty() => notifier.notify(ch),
                                    _ => {}
                                }
                            }
                            Ok(None) => break "the stream closed".to_owned(),
                            Err(e) => break e.to_string(),
                        },
                        _ = progress.tick() => {
                            if !heard {
                                break format!("no answer within {:?}", EtcdStore::WATCH_PROGRESS);
                            }
                            heard = false;
                            if let Err(e) = stream.request_progress().await {
                                break e.to_string();
                            }
                        }
                    }
                }
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer to the watch request".to_owned(),
        };
        notifier.set_complete(false);
        tracing::debug!(endpoint = %store.endpoints[i], %prefix, %why, "etcd watch broke; watching again");
        at = i + 1;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(EtcdStore::WATCH_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_kinds_and_strangers_to_all() {
        let p = b"chunnel/g/";
        assert_eq!(kind(p, b"chunnel/g/members/a"), Changes::MEMBERS);
        assert_eq!(kind(p, b"chunnel/g/ballots/a"), Changes::BALLOTS);
        assert_eq!(kind(p, b"chunnel/g/meta"), Changes::TRANSITION);
        assert_eq!(kind(p, b"chunnel/g/transition"), Changes::TRANSITION);
        assert_eq!(kind(p, b"chunnel/g/other"), Changes::ALL);
        assert_eq!(kind(p, b"chunnel/h/meta"), Changes::ALL);
    }
}
