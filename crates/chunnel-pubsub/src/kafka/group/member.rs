//! A member's state, shared by its consumer and its driver task, and the driver: lease
//! renewal, the rendezvous record read and acted on through [`Core`], the synchronous
//! commits of a release.

use super::*;

/// Aborts the member's tasks when the consumer is dropped: it stops renewing its lease, so the
/// group reassigns its partitions once the lease runs out.
pub(super) struct Tasks(pub(super) Vec<tokio::task::JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

pub(super) enum Cmd {
    Leave(oneshot::Sender<Result<(), Error>>),
}

/// One partition a member holds.
pub(super) struct Slot {
    /// Distinguishes this holding from an earlier one of the same partition (tokens of an
    /// earlier one acknowledge nothing).
    pub(super) generation: u64,
    pub(super) client: Arc<PartitionClient>,
    /// Where the holding started.
    pub(super) start: i64,
    /// The next offset to fetch.
    pub(super) pos: i64,
    /// The next offset after the highest acknowledged one (-1: none).
    pub(super) acked: i64,
    /// The position last committed by this member (-1: none).
    pub(super) committed: i64,
    /// Being given up: fetched no more.
    pub(super) draining: bool,
}

#[derive(Default)]
pub(super) struct Shared {
    pub(super) slots: BTreeMap<i32, Slot>,
    pub(super) generation: u64,
    pub(super) next: usize,
    pub(super) epoch: u64,
}

/// What a member's consumer and its driver share.
pub(super) struct Ctl {
    pub(super) state: Mutex<Shared>,
    /// Held around every produce to the offsets topic, so commits of one member are stored in
    /// the order they were taken and none follows the release of its partition.
    pub(super) commit_lock: tokio::sync::Mutex<()>,
    pub(super) offsets: Arc<PartitionClient>,
    /// `group/topic/`, the offsets key without the partition.
    pub(super) key_prefix: String,
    /// When the last successful lease renewal (or join) started ([`mono_ms`]; 0: never).
    pub(super) renewed_ms: AtomicU64,
    pub(super) lease_ms: u64,
    pub(super) op_timeout: Duration,
    /// Wakes the committer.
    pub(super) acked: tokio::sync::Notify,
    /// Set when the member leaves: it renews its lease no more.
    pub(super) left: AtomicBool,
    pub(super) cmd: mpsc::Sender<Cmd>,
}

impl Ctl {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the acknowledgements of `tokens` (emptying it) and wakes the committer; a
    /// partition whose token belongs to a holding given up since (ignored), if any.
    pub(super) fn ack(&self, tokens: &mut Vec<KafkaGroupToken>) -> Option<i32> {
        let mut stale = None;
        {
            let mut st = self.lock();
            for t in tokens.drain(..) {
                match st.slots.get_mut(&t.part) {
                    Some(s) if s.generation == t.generation => {
                        s.acked = s.acked.max(t.offset + 1);
                    }
                    _ => stale = Some(t.part),
                }
            }
        }
        self.acked.notify_one();
        stale
    }

    /// Whether our lease is certainly still valid (renewed within 3/4 of it).
    pub(super) fn leased(&self) -> bool {
        let renewed = self.renewed_ms.load(AtomicOrdering::Acquire);
        // 0: never renewed (mono_ms starts at 1).
        renewed != 0 && mono_ms() < renewed.saturating_add(self.lease_ms * 3 / 4)
    }

    /// Commits the acknowledged positions of `only` (all held partitions if `None`); the
    /// caller holds `commit_lock`. Returns once the broker acknowledged the produce. Commits
    /// nothing, and fails, once the lease is no longer certain: the group may have given the
    /// partitions to another member, whose commits this one must not overwrite.
    pub(super) async fn commit_locked(&self, only: Option<&[i32]>) -> Result<(), Error> {
        if !self.leased() {
            return Err(lease_lost());
        }
        let todo: Vec<(i32, i64)> = {
            let st = self.lock();
            st.slots
                .iter()
                .filter(|(p, _)| only.is_none_or(|o| o.contains(p)))
                .filter(|(_, s)| s.acked > s.committed)
                .map(|(p, s)| (*p, s.acked))
                .collect()
        };
        produce_positions(
            &self.offsets,
            self.op_timeout,
            todo.iter()
                .map(|(p, pos)| (format!("{}{p}", self.key_prefix).into_bytes(), *pos))
                .collect(),
        )
        .await?;
        let mut st = self.lock();
        for (p, pos) in todo {
            if let Some(s) = st.slots.get_mut(&p) {
                s.committed = s.committed.max(pos);
            }
        }
        Ok(())
    }

    /// Stops fetching `parts`, waits (at most `drain`) until what was fetched from them is
    /// acknowledged, commits them synchronously and drops them.
    pub(super) async fn release(&self, parts: &[i32], drain: Duration) -> Result<(), Error> {
        {
            let mut st = self.lock();
            for p in parts {
                if let Some(s) = st.slots.get_mut(p) {
                    s.draining = true;
                }
            }
        }
        let deadline = tokio::time::Instant::now() + drain;
        loop {
            let drained = {
                let st = self.lock();
                parts.iter().all(|p| {
                    st.slots
                        .get(p)
                        .is_none_or(|s| s.pos == s.start || s.acked >= s.pos)
                })
            };
            if drained || tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _order = self.commit_lock.lock().await;
        let r = self.commit_locked(Some(parts)).await;
        let mut st = self.lock();
        for p in parts {
            st.slots.remove(p);
        }
        r
    }
}

/// Commits acknowledged positions at most every [`COMMIT_EVERY`](crate::kafka::COMMIT_EVERY) while the member's
/// lease holds (until the consumer is dropped, which aborts it).
pub(super) async fn committer(c: Arc<Ctl>) {
    loop {
        c.acked.notified().await;
        if c.leased() {
            let _order = c.commit_lock.lock().await;
            if let Err(e) = c.commit_locked(None).await {
                tracing::debug!(error = %e, "kafka group: offset commit failed; retrying");
                c.acked.notify_one();
            }
        }
        tokio::time::sleep(crate::kafka::COMMIT_EVERY).await;
    }
}

/// Renews the member's lease every `renew_every`, recording when a successful renewal began.
pub(super) async fn renew<St: Store>(
    store: Arc<St>,
    rgroup: String,
    me: String,
    config: GroupConfig,
    ctl: Weak<Ctl>,
) {
    loop {
        tokio::time::sleep(config.renew_every).await;
        let started = mono_ms();
        let r = tokio::time::timeout(config.lease, store.renew(&rgroup, &me, config.lease)).await;
        let Some(c) = ctl.upgrade() else { return };
        if c.left.load(AtomicOrdering::Acquire) {
            return;
        }
        match r {
            Ok(Ok(true)) => c.renewed_ms.fetch_max(started, AtomicOrdering::AcqRel),
            // Not a member any more (the driver rejoins), or the store did not answer.
            _ => 0,
        };
    }
}

/// Drives a member's [`Core`]: reads the group record, carries out the actions.
pub(super) struct Driver<St: Store> {
    pub(super) store: Arc<St>,
    pub(super) rgroup: String,
    pub(super) me: String,
    pub(super) kafka: KafkaBroker,
    pub(super) topic: String,
    pub(super) config: GroupConfig,
    pub(super) ctl: Arc<Ctl>,
    pub(super) core: Core,
}

impl<St: Store> Driver<St> {
    pub(super) fn op_timeout(&self) -> Duration {
        self.ctl.op_timeout
    }

    /// Joins the rendezvous group (creating it with an empty assignment).
    pub(super) async fn join(&mut self) -> Result<(), Error> {
        let me = chunnel_rendezvous::Member {
            id: self.me.clone(),
            addr: "-".into(),
        };
        let empty = encode_members(&[]);
        let lease = self.config.lease;
        for _ in 0..64 {
            let started = mono_ms();
            let snap = self.bounded(self.store.snapshot(&self.rgroup)).await?;
            let reply = match &snap.committed {
                None => {
                    self.bounded(
                        self.store
                            .join(&self.rgroup, &me, Some(&empty), None, lease),
                    )
                    .await?
                }
                Some(c) => {
                    // Not a Kafka group's record (the name is taken by something else).
                    decode_members(&c.stack)?;
                    self.bounded(
                        self.store
                            .join(&self.rgroup, &me, None, Some(c.epoch), lease),
                    )
                    .await?
                }
            };
            if let JoinReply::Created(_) | JoinReply::Joined(_) = reply {
                self.ctl
                    .renewed_ms
                    .fetch_max(started, AtomicOrdering::AcqRel);
                return Ok(());
            }
        }
        Err(Error::Rendezvous(chunnel_rendezvous::Error::Contended {
            group: self.rgroup.clone(),
            attempts: 64,
        }))
    }

    pub(super) async fn bounded<T>(
        &self,
        f: impl Future<Output = Result<T, chunnel_rendezvous::Error>>,
    ) -> Result<T, Error> {
        match tokio::time::timeout(self.op_timeout(), f).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(Error::Rendezvous(chunnel_rendezvous::Error::unavailable(
                self.store.backend(),
                "no answer",
            ))),
        }
    }

    pub(super) async fn run(mut self, mut cmd: mpsc::Receiver<Cmd>) {
        let mut watch = self.store.watch(&self.rgroup);
        loop {
            match self.bounded(self.store.snapshot(&self.rgroup)).await {
                Ok(snap) => {
                    let rec = GroupRecord::from_snapshot(&snap);
                    if let Some(why) = rec.damage() {
                        tracing::warn!(group = %self.rgroup, epoch = rec.epoch, "kafka group: {why}");
                    }
                    let actions = self
                        .core
                        .on_record(&rec, chunnel_rendezvous::store::now_ms());
                    for a in actions {
                        self.execute(a).await;
                    }
                }
                Err(e) => tracing::debug!(group = %self.rgroup, error = %e, "kafka group"),
            }
            tokio::select! {
                c = cmd.recv() => match c {
                    Some(Cmd::Leave(reply)) => {
                        let r = self.leave().await;
                        let _ = reply.send(r);
                        return;
                    }
                    None => return,
                },
                _ = tokio::time::sleep(self.config.poll) => {}
                _ = async {
                    match &mut watch {
                        Some(w) => { w.changed().await; }
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }

    pub(super) async fn leave(&mut self) -> Result<(), Error> {
        self.ctl.left.store(true, AtomicOrdering::Release);
        let parts = self.core.leave();
        let r = self.ctl.release(&parts, Duration::ZERO).await;
        self.ctl.lock().slots.clear();
        self.bounded(self.store.leave(&self.rgroup, &self.me))
            .await?;
        r
    }

    pub(super) async fn execute(&mut self, action: Action) {
        match action {
            Action::Rejoin => {
                tracing::info!(group = %self.rgroup, member = %self.me, "kafka group: rejoining");
                if let Err(e) = self.join().await {
                    tracing::warn!(group = %self.rgroup, error = %e, "kafka group: rejoin failed");
                }
            }
            Action::Stop(parts) => {
                let mut st = self.ctl.lock();
                for p in parts {
                    st.slots.remove(&p);
                }
            }
            Action::Acquire(parts) => {
                if let Err(e) = self.acquire(&parts).await {
                    tracing::warn!(group = %self.rgroup, error = %e, "kafka group: acquire failed");
                    self.core.not_acquired(&parts);
                }
            }
            Action::Release { id, partitions } => {
                match self.ctl.release(&partitions, self.config.drain).await {
                    Ok(()) => {
                        for a in self.core.released(id) {
                            Box::pin(self.execute(a)).await;
                        }
                    }
                    // No vote: the transition times out, and what we own we take back.
                    Err(e) => {
                        tracing::warn!(group = %self.rgroup, error = %e, "kafka group: release failed")
                    }
                }
            }
            Action::Vote(id) => {
                let r = self
                    .bounded(self.store.vote(&self.rgroup, id, &self.me, &Ballot::Yes))
                    .await;
                if let Err(e) = r {
                    tracing::debug!(group = %self.rgroup, error = %e, "kafka group: vote failed");
                }
            }
            Action::Propose {
                from_epoch,
                members,
            } => {
                let t = Transition {
                    id: chunnel::util::random_u64(),
                    from_epoch,
                    proposer: self.me.clone(),
                    stack: encode_members(&members),
                    deadline_ms: chunnel_rendezvous::store::now_ms()
                        + self.config.transition_timeout.as_millis() as u64,
                    ballot_box: None,
                };
                if let Err(e) = self.bounded(self.store.propose(&self.rgroup, &t)).await {
                    tracing::debug!(group = %self.rgroup, error = %e, "kafka group: propose failed");
                }
            }
            Action::Finish { id, commit } => {
                if let Err(e) = self
                    .bounded(self.store.finish(&self.rgroup, id, commit))
                    .await
                {
                    tracing::debug!(group = %self.rgroup, error = %e, "kafka group: finish failed");
                }
            }
        }
        let epoch = self.core.epoch();
        self.ctl.lock().epoch = epoch;
    }

    /// Opens `parts` at their committed positions (the earliest record if none).
    pub(super) async fn acquire(&mut self, parts: &[i32]) -> Result<(), Error> {
        let committed = read_commits(&self.ctl.offsets).await?;
        let mut opened = Vec::with_capacity(parts.len());
        for &p in parts {
            let client = self.kafka.partition(&self.topic, p).await?;
            let pos = match committed.get(&format!("{}{p}", self.ctl.key_prefix)) {
                Some(&pos) => pos,
                None => client
                    .get_offset(OffsetAt::Earliest)
                    .await
                    .map_err(|e| unavailable("read offset", e))?,
            };
            opened.push((p, client, pos));
        }
        let mut st = self.ctl.lock();
        for (p, client, pos) in opened {
            st.generation += 1;
            let generation = st.generation;
            st.slots.insert(
                p,
                Slot {
                    generation,
                    client,
                    start: pos,
                    pos,
                    acked: -1,
                    committed: pos,
                    draining: false,
                },
            );
        }
        Ok(())
    }
}

/// The error of a commit refused because the member's lease is no longer certain.
pub(super) fn lease_lost() -> Error {
    Error::Unavailable {
        broker: crate::kafka::NAME,
        op: "commit",
        waited: Duration::ZERO,
        last: "the group lease was not renewed in time".into(),
    }
}

/// Milliseconds on a monotonic clock (from 1, at the first call in this process): the lease
/// fence counts on it, so a wall-clock step (NTP) cannot stretch a member's lease.
pub(super) fn mono_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let start = *START.get_or_init(std::time::Instant::now);
    u64::try_from(start.elapsed().as_millis())
        .unwrap_or(u64::MAX)
        .saturating_add(1)
}
