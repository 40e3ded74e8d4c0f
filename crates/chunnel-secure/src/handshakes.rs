//! A listener's server handshakes in flight, shared by [`crate::tls::Listener`] and
//! [`crate::quic::Listener`]: each runs in its own task under a timeout, at most a configured
//! number at once; finished ones are taken in completion order; failures are counted and the
//! last [`KEPT_FAILURES`] kept.

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use tokio::task::JoinSet;

use crate::Error;

/// How many failed handshakes a listener remembers for its `take_failures`.
pub const KEPT_FAILURES: usize = 64;

pub(crate) struct Handshakes<T> {
    pending: JoinSet<(String, Result<T, Error>)>,
    failures: VecDeque<Error>,
    failed: u64,
}

impl<T: Send + 'static> Handshakes<T> {
    pub(crate) fn new() -> Self {
        Handshakes {
            pending: JoinSet::new(),
            failures: VecDeque::new(),
            failed: 0,
        }
    }

    /// Handshakes running now.
    pub(crate) fn in_progress(&self) -> usize {
        self.pending.len()
    }

    /// Runs `handshake` with `peer` in a task of its own; past `after` it fails with
    /// [`Error::HandshakeTimeout`].
    pub(crate) fn spawn<F>(&mut self, peer: String, after: Duration, handshake: F)
    where
        F: Future<Output = Result<T, Error>> + Send + 'static,
    {
        self.pending.spawn(async move {
            let r = match tokio::time::timeout(after, handshake).await {
                Ok(r) => r,
                Err(_) => Err(Error::HandshakeTimeout {
                    peer: peer.clone(),
                    after,
                }),
            };
            (peer, r)
        });
    }

    /// The next handshake to finish (pending forever while none runs): the peer and its
    /// outcome; a failure is counted. A task cannot panic on network bytes (rustls and quinn
    /// return errors); if one ever did, that client alone is dropped and the wait goes on.
    pub(crate) async fn finished(&mut self) -> (String, Result<T, Error>) {
        loop {
            match self.pending.join_next().await {
                Some(Ok((peer, r))) => {
                    if r.is_err() {
                        self.failed += 1;
                    }
                    return (peer, r);
                }
                Some(Err(_)) => continue,
                None => std::future::pending().await,
            }
        }
    }

    /// Keeps `e` among the last [`KEPT_FAILURES`] failures.
    pub(crate) fn keep(&mut self, e: Error) {
        if self.failures.len() == KEPT_FAILURES {
            self.failures.pop_front();
        }
        self.failures.push_back(e);
    }

    /// Failed handshakes so far.
    pub(crate) fn failed(&self) -> u64 {
        self.failed
    }

    /// The kept failures, oldest first, emptying the list.
    pub(crate) fn take_failures(&mut self) -> Vec<Error> {
        self.failures.drain(..).collect()
    }
}
