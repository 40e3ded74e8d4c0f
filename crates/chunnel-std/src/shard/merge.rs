//! [`Merge`]: several connections' receive sides merged through one bounded queue (used by
//! client push and by the balancer).

use std::sync::{Arc, Mutex};

use chunnel::ChunnelConnection;
use tokio::sync::mpsc;

/// The merge queue's receiver and an error to report after the messages before it.
type MergeRx<T> = (
    mpsc::Receiver<Result<T, chunnel::Error>>,
    Option<chunnel::Error>,
);

/// Merges several connections' receive sides through one bounded queue: a task per
/// connection (aborted on drop) moves messages into it.
pub(super) struct Merge<T> {
    tx: mpsc::Sender<Result<T, chunnel::Error>>,
    rx: tokio::sync::Mutex<MergeRx<T>>,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    batch: usize,
}

impl<T> Drop for Merge<T> {
    fn drop(&mut self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }
}

impl<T: Send + 'static> Merge<T> {
    pub(super) fn new(queue: usize, batch: usize) -> Self {
        let (tx, rx) = mpsc::channel(queue.max(1));
        Merge {
            tx,
            rx: tokio::sync::Mutex::new((rx, None)),
            tasks: Mutex::new(Vec::new()),
            batch: batch.clamp(1, 64),
        }
    }

    pub(super) fn pump<C: ChunnelConnection<Data = T> + 'static>(&self, conn: Arc<C>) {
        let tx = self.tx.clone();
        let batch = self.batch;
        let task = tokio::spawn(async move {
            let mut slots: Vec<Option<T>> = (0..batch).map(|_| None).collect();
            loop {
                match conn.recv(&mut slots).await {
                    Ok(n) => {
                        for m in slots[..n].iter_mut().filter_map(Option::take) {
                            if tx.send(Ok(m)).await.is_err() {
                                return;
                            }
                        }
                    }
                    // A message that did not decode: reported, the connection goes on.
                    Err(e @ (chunnel::Error::Layer { .. } | chunnel::Error::Malformed { .. })) => {
                        if tx.send(Err(e)).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                }
            }
        });
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(task.abort_handle());
    }

    /// Stops the pumps and moves the messages already queued to `out` (a pending error is
    /// dropped). For a hand-over at a switch point, when no call is inside `recv`.
    pub(super) fn stop_into(&self, out: &mut std::collections::VecDeque<T>) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
        if let Ok(mut guard) = self.rx.try_lock() {
            while let Ok(m) = guard.0.try_recv() {
                if let Ok(m) = m {
                    out.push_back(m);
                }
            }
        }
    }

    pub(super) async fn recv(&self, slots: &mut [Option<T>]) -> Result<usize, chunnel::Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let mut guard = self.rx.lock().await;
        let (rx, pending) = &mut *guard;
        if let Some(e) = pending.take() {
            return Err(e);
        }
        // Cancel safe: the only await is the first receive.
        let first = rx.recv().await.ok_or(chunnel::Error::Closed)??;
        slots[0] = Some(first);
        let mut n = 1;
        while n < slots.len() {
            match rx.try_recv() {
                Ok(Ok(m)) => {
                    slots[n] = Some(m);
                    n += 1;
                }
                Ok(Err(e)) => {
                    // Reported by the next call, after the good messages.
                    *pending = Some(e);
                    break;
                }
                Err(_) => break,
            }
        }
        Ok(n)
    }
}
