//! The embedded default: a group record in an SQLite file.
//!
//! No server: every process on the host that opens the same file shares the groups in it.
//! SQLite serializes writers (each operation is one `BEGIN IMMEDIATE` transaction, the file is
//! in WAL mode, and a writer waits up to [`SqliteStore::BUSY_TIMEOUT`] for the lock). The
//! writers of one process (every handle on the file) first queue on a lock of their own per
//! file, so they wait for each other in turn rather than in SQLite's busy handler, which
//! sleeps between attempts (up to 100 ms at a time) when many write at once. Leases use
//! this host's clock, which every process on it shares.
//!
//! # Growth
//!
//! Each group row carries `gc_after_ms`: the latest lease expiry among its members (or the
//! time of the write, if none is left) plus the grace period ([`SqliteStore::with_grace`],
//! default [`SqliteStore::DEFAULT_GRACE`]), set by every write to the group. A group whose
//! `gc_after_ms` has passed and that has no live member is *gone*: every read shows it as
//! absent, and the next write to it deletes its rows first. Expired members are deleted by
//! the next write to their group. Rows of groups nobody touches are collected by a sweep:
//! every operation of a store handle starts one in the background when the last one is at
//! least [`SqliteStore::with_sweep_every`] old (default [`SqliteStore::DEFAULT_SWEEP_EVERY`]);
//! it deletes every expired member row and every gone group (with its transition and
//! ballots), in transactions of at most [`SqliteStore::SWEEP_BATCH`] groups and as many member
//! rows each, so other writers wait at most one batch. [`SqliteStore::sweep`] runs one at once.
//!
//! So, once any process used the file (any operation) at least `sweep_every` after the
//! previous sweep, and the sweep's batches are done, the file holds: one `chunnel_groups` row
//! per group with a member that joined or renewed within lease + grace, one
//! `chunnel_members` row per live member, and a `chunnel_transitions` row and one
//! `chunnel_ballots` row per voter for each pending transition; nothing else. (With no
//! process using the file, nothing is collected, and nothing is added either.) Deleted rows'
//! pages are reused by SQLite; the file itself does not shrink without a `VACUUM`.
//!
//! # Notifications
//!
//! [`Store::watch`] wakes a participant when any process of the host wrote to its group: a
//! join, leave, proposal, vote or finish notifies every watch of that group right after the
//! transaction committed (the file is known by device and inode in the process, so any path
//! to it will do). Within the process, through a process-wide registry. Across processes,
//! through Unix datagram sockets next to the file ([`wake`], re-exported as
//! `chunnel_rendezvous::sqlite_wake`): each process watching a group of the file binds one
//! socket in `<file>.wake/`, and a writer sends every other process's socket one small
//! datagram (the kinds that changed and the group: `docs/wire.md` §15.2), without blocking;
//! sockets of dead processes are removed by the writer that finds them, and a datagram
//! dropped on a full queue leaves a marker that makes the receiver wake all its watches of
//! the file. A watch is complete ([`crate::Watch::is_complete`]) while its process's socket
//! is bound and in the directory: participants then read on notification, and every
//! [`crate::Config::poll_notified`] as the fallback; while it is not (the socket cannot be
//! bound, or the directory holds more than [`wake::MAX_ENTRIES`] entries), every
//! [`crate::Config::poll`]. Notifications carry no news: a woken participant reads the
//! record. [`SqliteStore::wake_counters`] tells what the wake-ups did.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use crate::Error;
use crate::ballot::BallotBox;
use crate::store::{
    Ballot, Changes, Committed, JoinReply, Member, Outcome, Snapshot, Store, Transition, Watch,
    check_name, now_ms,
};

pub mod wake;

const BACKEND: &str = "sqlite";

/// The longest grace period kept, in ms.
const MAX_GRACE_MS: u64 = 1_000_000_000_000_000;

/// A rendezvous store in an SQLite file (the embedded default).
///
/// ```
/// # fn main() -> Result<(), chunnel_rendezvous::Error> {
/// # let dir = std::env::temp_dir().join(format!("chunnel-rdv-sqlite-doc-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir)?;
/// # let path = dir.join("my-app-groups.sqlite");
/// // Every process of the host that opens this file shares its groups.
/// let store = chunnel_rendezvous::SqliteStore::open(&path)?
///     // A group outlives its last member by 10 s (default 60 s).
///     .with_grace(std::time::Duration::from_secs(10));
/// # drop(store);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
    /// The wake-ups of the file's watches, in this process and across the host.
    wakes: Arc<wake::Wakes>,
    /// Taken around every writing transaction by every handle of this process on the file.
    writers: Arc<Mutex<()>>,
    /// How long a group outlives its last member, in ms.
    grace_ms: u64,
    sweeper: Arc<Sweeper>,
}

/// When this handle (and its clones) last started a sweep, and whether one is running.
#[derive(Debug)]
struct Sweeper {
    every: Duration,
    last: Mutex<Option<std::time::Instant>>,
    running: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .field("grace_ms", &self.grace_ms)
            .field("sweep_every", &self.sweeper.every)
            .finish()
    }
}

fn db<E: std::fmt::Display>(e: E) -> Error {
    Error::unavailable(BACKEND, e)
}

impl SqliteStore {
    /// How long a writer waits for another process's transaction before failing.
    pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

    /// The longest lease kept (about 31,000 years); a longer one is taken as this, so that
    /// an expiry plus the grace stays within SQLite's integers.
    pub const MAX_LEASE: Duration = Duration::from_millis(MAX_GRACE_MS);

    /// How long a group outlives its last member by default (see [`SqliteStore::with_grace`]).
    pub const DEFAULT_GRACE: Duration = Duration::from_secs(60);

    /// How often a store handle sweeps the whole file by default (see
    /// [`SqliteStore::with_sweep_every`]).
    pub const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(10);

    /// The most groups (and, separately, member rows) one sweep transaction deletes.
    pub const SWEEP_BATCH: usize = 500;

    /// Opens (creating if needed) the store in `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<SqliteStore, Error> {
        let path = path.as_ref().to_path_buf();
        let conn = Connection::open(&path).map_err(|e| {
            Error::unavailable(BACKEND, format!("cannot open {}: {e}", path.display()))
        })?;
        conn.busy_timeout(Self::BUSY_TIMEOUT).map_err(db)?;
        // WAL lets readers proceed while one process writes; `synchronous=NORMAL` is durable
        // across process crashes (not power loss), which is what a rendezvous needs.
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(db)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(db)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS chunnel_groups (
                 grp TEXT PRIMARY KEY, epoch INTEGER NOT NULL, stack BLOB NOT NULL,
                 outcome_id INTEGER, outcome_committed INTEGER);
             CREATE TABLE IF NOT EXISTS chunnel_members (
                 grp TEXT NOT NULL, id TEXT NOT NULL, addr TEXT NOT NULL,
                 expires_ms INTEGER NOT NULL, PRIMARY KEY (grp, id));
             CREATE TABLE IF NOT EXISTS chunnel_transitions (
                 grp TEXT PRIMARY KEY, id INTEGER NOT NULL, from_epoch INTEGER NOT NULL,
                 proposer TEXT NOT NULL, stack BLOB NOT NULL, deadline_ms INTEGER NOT NULL,
                 ballot_box TEXT);
             CREATE TABLE IF NOT EXISTS chunnel_ballots (
                 grp TEXT NOT NULL, tid INTEGER NOT NULL, member TEXT NOT NULL,
                 ballot TEXT NOT NULL, PRIMARY KEY (grp, member));
             CREATE INDEX IF NOT EXISTS chunnel_members_expiry ON chunnel_members (expires_ms);",
        )
        .map_err(db)?;
        // Files from before direct ballots lack `ballot_box` (NULL: members vote in the file).
        let has_box: bool = conn
            .query_row(
                "SELECT COUNT(*) FROM pragma_table_info('chunnel_transitions') WHERE name = 'ballot_box'",
                [],
                |r| r.get::<_, i64>(0),
            )
            .map_err(db)?
            > 0;
        if !has_box {
            conn.execute_batch("ALTER TABLE chunnel_transitions ADD COLUMN ballot_box TEXT")
                .map_err(db)?;
        }
        // Files from before groups were collected lack `gc_after_ms`: 0 makes their groups
        // collectable as soon as they have no live member.
        let has_gc: bool = conn
            .query_row(
                "SELECT COUNT(*) FROM pragma_table_info('chunnel_groups') WHERE name = 'gc_after_ms'",
                [],
                |r| r.get::<_, i64>(0),
            )
            .map_err(db)?
            > 0;
        if !has_gc {
            conn.execute_batch(
                "ALTER TABLE chunnel_groups ADD COLUMN gc_after_ms INTEGER NOT NULL DEFAULT 0",
            )
            .map_err(db)?;
        }
        conn.execute_batch(
            "CREATE INDEX IF NOT EXISTS chunnel_groups_gc ON chunnel_groups (gc_after_ms);",
        )
        .map_err(db)?;
        let file = {
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::metadata(&path).map_err(|e| {
                Error::unavailable(BACKEND, format!("cannot stat {}: {e}", path.display()))
            })?;
            (m.dev(), m.ino())
        };
        Ok(SqliteStore {
            conn: Arc::new(Mutex::new(conn)),
            wakes: Arc::new(wake::Wakes::new(&path, file)),
            path,
            writers: writers(file),
            grace_ms: Self::DEFAULT_GRACE.as_millis() as u64,
            sweeper: Arc::new(Sweeper {
                every: Self::DEFAULT_SWEEP_EVERY,
                last: Mutex::new(None),
                running: false.into(),
            }),
        })
    }

    /// Keeps a group for `grace` after its last member's lease ran out (or it left), instead
    /// of [`Self::DEFAULT_GRACE`]: see "Growth" in the module docs.
    pub fn with_grace(mut self, grace: Duration) -> SqliteStore {
        // At most about 31,000 years, so expiry + grace stays within SQLite's integers.
        self.grace_ms =
            u64::try_from(grace.as_millis()).map_or(MAX_GRACE_MS, |g| g.min(MAX_GRACE_MS));
        self
    }

    /// Sweeps the file at most this often from this handle (and its clones), instead of every
    /// [`Self::DEFAULT_SWEEP_EVERY`]: see "Growth" in the module docs.
    pub fn with_sweep_every(mut self, every: Duration) -> SqliteStore {
        self.sweeper = Arc::new(Sweeper {
            every,
            last: Mutex::new(None),
            running: false.into(),
        });
        self
    }

    /// Deletes every expired member row and every gone group of the file now, in
    /// transactions of at most [`Self::SWEEP_BATCH`] groups and as many member rows; returns
    /// how many (groups, member rows) it deleted.
    pub async fn sweep(&self) -> Result<(u64, u64), Error> {
        let (mut groups, mut members) = (0, 0);
        loop {
            let (g, m) = self
                .run_now(TransactionBehavior::Immediate, |tx| {
                    sweep_batch(tx, now_ms(), Self::SWEEP_BATCH)
                })
                .await?;
            groups += g as u64;
            members += m as u64;
            if g < Self::SWEEP_BATCH && m < Self::SWEEP_BATCH {
                return Ok((groups, members));
            }
            tokio::task::yield_now().await;
        }
    }

    /// Starts a sweep in the background if the last one from this handle is at least
    /// `sweep_every` old and none is running (needs a tokio runtime, as every operation does).
    fn maybe_sweep(&self) {
        use std::sync::atomic::Ordering;
        let now = std::time::Instant::now();
        {
            let mut last = self.sweeper.last.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|t| now.duration_since(t) < self.sweeper.every)
                || self.sweeper.running.swap(true, Ordering::AcqRel)
            {
                return;
            }
            *last = Some(now);
        }
        let store = self.clone();
        tokio::spawn(async move {
            match store.sweep().await {
                Ok((0, 0)) => {}
                Ok((groups, members)) => {
                    tracing::debug!(groups, members, "swept the rendezvous file");
                }
                Err(e) => tracing::debug!(error = %e, "sweeping the rendezvous file failed"),
            }
            store.sweeper.running.store(false, Ordering::Release);
        });
    }

    /// The file this store lives in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` in one `IMMEDIATE` transaction (a writer) on a blocking thread.
    async fn txn<T, F>(&self, f: F) -> Result<T, Error>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Transaction<'_>) -> Result<T, Error> + Send + 'static,
    {
        self.run(TransactionBehavior::Immediate, f).await
    }

    /// Runs `f` in one transaction of the given kind on a blocking thread (a `DEFERRED` one
    /// that only reads sees one consistent snapshot and takes no write lock, in WAL mode).
    async fn run<T, F>(&self, behavior: TransactionBehavior, f: F) -> Result<T, Error>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Transaction<'_>) -> Result<T, Error> + Send + 'static,
    {
        self.maybe_sweep();
        self.run_now(behavior, f).await
    }

    /// [`Self::run`] without starting a sweep.
    async fn run_now<T, F>(&self, behavior: TransactionBehavior, f: F) -> Result<T, Error>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Transaction<'_>) -> Result<T, Error> + Send + 'static,
    {
        let conn = self.conn.clone();
        let writers = self.writers.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
            // Writers of this process queue here rather than in SQLite's busy handler, which
            // sleeps (1 ms, 2 ms, 5 ms, ... up to 100 ms) between attempts at the lock.
            let _writing = (!matches!(behavior, TransactionBehavior::Deferred))
                .then(|| writers.lock().unwrap_or_else(|p| p.into_inner()));
            let tx = conn.transaction_with_behavior(behavior).map_err(db)?;
            let out = f(&tx)?;
            tx.commit().map_err(db)?;
            Ok(out)
        })
        .await
        .map_err(|e| Error::unavailable(BACKEND, format!("store thread failed: {e}")))?
    }
}

/// The lock every handle of this process on the file `file` takes to write (one per file,
/// shared; entries of files no handle uses any more are dropped when another is added).
fn writers(file: (u64, u64)) -> Arc<Mutex<()>> {
    type Writers = HashMap<(u64, u64), std::sync::Weak<Mutex<()>>>;
    static WRITERS: OnceLock<Mutex<Writers>> = OnceLock::new();
    let mut all = WRITERS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(lock) = all.get(&file).and_then(std::sync::Weak::upgrade) {
        return lock;
    }
    all.retain(|_, w| w.strong_count() > 0);
    let lock = Arc::new(Mutex::new(()));
    all.insert(file, Arc::downgrade(&lock));
    lock
}

impl SqliteStore {
    /// Tells every watch of `group` on this host that it changed (see `wake`).
    fn wake(&self, group: &str, changes: Changes) {
        self.wakes.notify(group, changes);
    }

    /// What this handle's wake-ups did, and this process's socket for the file (see
    /// "Notifications" in the module docs).
    pub fn wake_counters(&self) -> wake::Counters {
        self.wakes.counters()
    }
}

/// SQLite integers are signed 64-bit: ids and epochs are stored as their bit pattern.
/// SQLite integers are `i64`: ids (random `u64`) are stored bit for bit; times and epochs stay
/// below `i64::MAX` by construction (leases and the grace are capped).
fn to_sql(v: u64) -> i64 {
    v as i64
}

fn from_sql(v: i64) -> u64 {
    v as u64
}

/// The expiry of a lease of `lease` from now, in Unix ms; leases are capped at
/// [`SqliteStore::MAX_LEASE`], so that expiry plus any grace stays an `i64`.
fn expiry_ms(lease: Duration) -> u64 {
    let ms = u64::try_from(lease.min(SqliteStore::MAX_LEASE).as_millis()).unwrap_or(u64::MAX);
    now_ms().saturating_add(ms)
}

/// Collection on access, first in every write to `group`: deletes its expired members, and
/// the whole group if it is gone (no live member, `gc_after_ms` passed).
fn collect(tx: &rusqlite::Transaction<'_>, group: &str) -> Result<(), Error> {
    let now = to_sql(now_ms());
    tx.execute(
        "DELETE FROM chunnel_members WHERE grp = ?1 AND expires_ms <= ?2",
        params![group, now],
    )
    .map_err(db)?;
    let gone = tx
        .execute(
            "DELETE FROM chunnel_groups WHERE grp = ?1 AND gc_after_ms <= ?2
               AND NOT EXISTS (SELECT 1 FROM chunnel_members WHERE grp = ?1)",
            params![group, now],
        )
        .map_err(db)?;
    if gone > 0 {
        delete_rest(tx, group)?;
    }
    Ok(())
}

/// Deletes a group's member, transition and ballot rows (its group row is deleted already).
fn delete_rest(tx: &rusqlite::Transaction<'_>, group: &str) -> Result<(), Error> {
    for table in ["chunnel_members", "chunnel_transitions", "chunnel_ballots"] {
        tx.prepare_cached(&format!("DELETE FROM {table} WHERE grp = ?1"))
            .map_err(db)?
            .execute(params![group])
            .map_err(db)?;
    }
    Ok(())
}

/// Last in every write to `group`: it is collectable `grace_ms` after the latest lease
/// expiry among its members, or after now if it has none.
fn touch(tx: &rusqlite::Transaction<'_>, group: &str, grace_ms: u64) -> Result<(), Error> {
    tx.execute(
        "UPDATE chunnel_groups SET gc_after_ms = MAX(?2,
             COALESCE((SELECT MAX(expires_ms) FROM chunnel_members WHERE grp = ?1), 0)) + ?3
         WHERE grp = ?1",
        params![group, to_sql(now_ms()), to_sql(grace_ms)],
    )
    .map_err(db)?;
    Ok(())
}

/// One transaction of a sweep: deletes up to `limit` expired member rows, and up to `limit`
/// gone groups with all their rows. Returns (groups, member rows) deleted.
fn sweep_batch(
    tx: &rusqlite::Transaction<'_>,
    now: u64,
    limit: usize,
) -> Result<(usize, usize), Error> {
    let (now, limit) = (to_sql(now), limit as i64);
    let members = tx
        .execute(
            "DELETE FROM chunnel_members WHERE rowid IN
                 (SELECT rowid FROM chunnel_members WHERE expires_ms <= ?1 LIMIT ?2)",
            params![now, limit],
        )
        .map_err(db)?;
    let gone: Vec<String> = tx
        .prepare_cached(
            "SELECT grp FROM chunnel_groups AS g WHERE gc_after_ms <= ?1
               AND NOT EXISTS (SELECT 1 FROM chunnel_members AS m
                               WHERE m.grp = g.grp AND m.expires_ms > ?1)
             LIMIT ?2",
        )
        .map_err(db)?
        .query_map(params![now, limit], |r| r.get(0))
        .map_err(db)?
        .collect::<Result<_, _>>()
        .map_err(db)?;
    for g in &gone {
        tx.execute("DELETE FROM chunnel_groups WHERE grp = ?1", params![g])
            .map_err(db)?;
        delete_rest(tx, g)?;
    }
    Ok((gone.len(), members))
}

/// Reads the group record. Expired members, and a gone group, are filtered out here (and
/// deleted by the next write or sweep), so a read needs no write lock.
fn read(tx: &rusqlite::Transaction<'_>, group: &str) -> Result<Snapshot, Error> {
    let mut snap = Snapshot::default();
    let now = to_sql(now_ms());
    let row = tx
        .query_row(
            "SELECT epoch, stack, outcome_id, outcome_committed, gc_after_ms FROM chunnel_groups WHERE grp = ?1",
            params![group],
            |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, Option<i64>>(2)?,
                    r.get::<_, Option<i64>>(3)?,
                    r.get::<_, i64>(4)?,
                ))
            },
        )
        .optional()
        .map_err(db)?;
    let Some((epoch, stack, oid, ocommitted, gc_after)) = row else {
        return Ok(snap);
    };
    let mut q = tx
        .prepare_cached(
            "SELECT id, addr FROM chunnel_members WHERE grp = ?1 AND expires_ms > ?2 ORDER BY id",
        )
        .map_err(db)?;
    snap.members = q
        .query_map(params![group, now], |r| {
            Ok(Member {
                id: r.get(0)?,
                addr: r.get(1)?,
            })
        })
        .map_err(db)?
        .collect::<Result<_, _>>()
        .map_err(db)?;
    if snap.members.is_empty() && gc_after <= now {
        // Gone: as if it had never been created.
        return Ok(Snapshot::default());
    }
    snap.committed = Some(Committed {
        epoch: from_sql(epoch),
        stack: Bytes::from(stack),
    });
    if let (Some(id), Some(c)) = (oid, ocommitted) {
        snap.outcome = Some(Outcome {
            id: from_sql(id),
            committed: c != 0,
        });
    }
    snap.transition = tx
        .query_row(
            "SELECT id, from_epoch, proposer, stack, deadline_ms, ballot_box FROM chunnel_transitions WHERE grp = ?1",
            params![group],
            |r| {
                Ok(Transition {
                    id: from_sql(r.get(0)?),
                    from_epoch: from_sql(r.get(1)?),
                    proposer: r.get(2)?,
                    stack: Bytes::from(r.get::<_, Vec<u8>>(3)?),
                    deadline_ms: from_sql(r.get(4)?),
                    ballot_box: None,
                })
                .map(|t| (t, r.get::<_, Option<String>>(5)))
            },
        )
        .optional()
        .map_err(db)?
        .map(|(mut t, bb)| {
            if let Some(bb) = bb.map_err(db)? {
                t.ballot_box = Some(BallotBox::decode(&bb)?);
            }
            Ok::<_, Error>(t)
        })
        .transpose()?;
    if let Some(t) = &snap.transition {
        let mut q = tx
            .prepare_cached(
                "SELECT member, ballot FROM chunnel_ballots WHERE grp = ?1 AND tid = ?2 ORDER BY member",
            )
            .map_err(db)?;
        let rows: Vec<(String, String)> = q
            .query_map(params![group, to_sql(t.id)], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(db)?
            .collect::<Result<_, _>>()
            .map_err(db)?;
        for (m, b) in rows {
            snap.ballots.push((m, Ballot::decode(&b)?));
        }
    }
    Ok(snap)
}

fn upsert_member(
    tx: &rusqlite::Transaction<'_>,
    group: &str,
    m: &Member,
    lease: Duration,
) -> Result<(), Error> {
    let expires = expiry_ms(lease);
    tx.execute(
        "INSERT INTO chunnel_members (grp, id, addr, expires_ms) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (grp, id) DO UPDATE SET addr = excluded.addr, expires_ms = excluded.expires_ms",
        params![group, m.id, m.addr, to_sql(expires)],
    )
    .map_err(db)?;
    Ok(())
}

impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn join_creating_at(
        &self,
        group: &str,
        member: &Member,
        propose: Option<&Bytes>,
        expect_epoch: Option<u64>,
        create_epoch: u64,
        lease: Duration,
    ) -> Result<JoinReply, Error> {
        check_name("group name", group)?;
        check_name("member id", &member.id)?;
        let group_name = group;
        let (group, member, propose) = (group.to_owned(), member.clone(), propose.cloned());
        let grace = self.grace_ms;
        let reply = self
            .txn(move |tx| {
                collect(tx, &group)?;
                let snap = read(tx, &group)?;
                match (&snap.committed, propose) {
                    (None, Some(stack)) => {
                        tx.execute(
                            "INSERT INTO chunnel_groups (grp, epoch, stack) VALUES (?1, ?2, ?3)",
                            params![group, to_sql(create_epoch.max(1)), &stack[..]],
                        )
                        .map_err(db)?;
                        upsert_member(tx, &group, &member, lease)?;
                        touch(tx, &group, grace)?;
                        Ok(JoinReply::Created(read(tx, &group)?))
                    }
                    (Some(c), _) if Some(c.epoch) == expect_epoch => {
                        upsert_member(tx, &group, &member, lease)?;
                        touch(tx, &group, grace)?;
                        Ok(JoinReply::Joined(read(tx, &group)?))
                    }
                    _ => Ok(JoinReply::Current(snap)),
                }
            })
            .await;
        match &reply {
            Ok(JoinReply::Created(_)) => {
                self.wake(group_name, Changes::MEMBERS | Changes::TRANSITION);
            }
            Ok(JoinReply::Joined(_)) => self.wake(group_name, Changes::MEMBERS),
            _ => {}
        }
        reply
    }

    async fn renew(&self, group: &str, member_id: &str, lease: Duration) -> Result<bool, Error> {
        let (group, id) = (group.to_owned(), member_id.to_owned());
        let grace = self.grace_ms;
        self.txn(move |tx| {
            collect(tx, &group)?;
            let expires = expiry_ms(lease);
            let n = tx
                .execute(
                    "UPDATE chunnel_members SET expires_ms = ?3 WHERE grp = ?1 AND id = ?2",
                    params![group, id, to_sql(expires)],
                )
                .map_err(db)?;
            if n == 1 {
                touch(tx, &group, grace)?;
            }
            Ok(n == 1)
        })
        .await
    }

    async fn leave(&self, group: &str, member_id: &str) -> Result<(), Error> {
        let group_name = group;
        let (group, id) = (group.to_owned(), member_id.to_owned());
        let grace = self.grace_ms;
        self.txn(move |tx| {
            collect(tx, &group)?;
            tx.execute(
                "DELETE FROM chunnel_members WHERE grp = ?1 AND id = ?2",
                params![group, id],
            )
            .map_err(db)?;
            tx.execute(
                "DELETE FROM chunnel_ballots WHERE grp = ?1 AND member = ?2",
                params![group, id],
            )
            .map_err(db)?;
            touch(tx, &group, grace)?;
            Ok(())
        })
        .await?;
        self.wake(group_name, Changes::MEMBERS);
        Ok(())
    }

    async fn snapshot(&self, group: &str) -> Result<Snapshot, Error> {
        let group = group.to_owned();
        self.run(TransactionBehavior::Deferred, move |tx| read(tx, &group))
            .await
    }

    async fn propose(&self, group: &str, t: &Transition) -> Result<bool, Error> {
        let group_name = group;
        let (group, t) = (group.to_owned(), t.clone());
        let grace = self.grace_ms;
        let done = self
            .txn(move |tx| {
                collect(tx, &group)?;
                let snap = read(tx, &group)?;
                if snap.transition.is_some() || snap.epoch() != t.from_epoch || t.from_epoch == 0 {
                    return Ok(false);
                }
                tx.execute(
                "INSERT INTO chunnel_transitions (grp, id, from_epoch, proposer, stack, deadline_ms, ballot_box)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                params![
                    group,
                    to_sql(t.id),
                    to_sql(t.from_epoch),
                    t.proposer,
                    &t.stack[..],
                    to_sql(t.deadline_ms),
                    t.ballot_box.map(|b| b.encode())
                ],
            )
            .map_err(db)?;
                tx.execute("DELETE FROM chunnel_ballots WHERE grp = ?1", params![group])
                    .map_err(db)?;
                touch(tx, &group, grace)?;
                Ok(true)
            })
            .await?;
        if done {
            self.wake(group_name, Changes::TRANSITION);
        }
        Ok(done)
    }

    async fn vote(
        &self,
        group: &str,
        id: u64,
        member_id: &str,
        ballot: &Ballot,
    ) -> Result<bool, Error> {
        let group_name = group;
        let (group, member, ballot) = (group.to_owned(), member_id.to_owned(), ballot.encode());
        let grace = self.grace_ms;
        let done = self.txn(move |tx| {
            collect(tx, &group)?;
            let pending: Option<i64> = tx
                .query_row(
                    "SELECT id FROM chunnel_transitions WHERE grp = ?1",
                    params![group],
                    |r| r.get(0),
                )
                .optional()
                .map_err(db)?;
            if pending.map(from_sql) != Some(id) {
                return Ok(false);
            }
            tx.execute(
                "INSERT INTO chunnel_ballots (grp, tid, member, ballot) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (grp, member) DO UPDATE SET tid = excluded.tid, ballot = excluded.ballot",
                params![group, to_sql(id), member, ballot],
            )
            .map_err(db)?;
            touch(tx, &group, grace)?;
            Ok(true)
        })
        .await?;
        if done {
            self.wake(group_name, Changes::BALLOTS);
        }
        Ok(done)
    }

    async fn finish_attested(
        &self,
        group: &str,
        id: u64,
        commit: bool,
        attested: &[String],
    ) -> Result<bool, Error> {
        let group_name = group;
        let group = group.to_owned();
        let attested = attested.to_vec();
        let grace = self.grace_ms;
        let done = self
            .txn(move |tx| {
                collect(tx, &group)?;
                let snap = read(tx, &group)?;
                if commit && !snap.all_live_yes_with(&attested) {
                    return Ok(false);
                }
                let Some(t) = snap.transition.filter(|t| t.id == id) else {
                    return Ok(false);
                };
                if commit && snap.committed.as_ref().map(|c| c.epoch) == Some(t.from_epoch) {
                    tx.execute(
                        "UPDATE chunnel_groups SET epoch = ?2, stack = ?3 WHERE grp = ?1",
                        params![group, to_sql(t.from_epoch + 1), &t.stack[..]],
                    )
                    .map_err(db)?;
                }
                tx.execute(
                "UPDATE chunnel_groups SET outcome_id = ?2, outcome_committed = ?3 WHERE grp = ?1",
                params![group, to_sql(id), commit as i64],
            )
            .map_err(db)?;
                tx.execute(
                    "DELETE FROM chunnel_transitions WHERE grp = ?1",
                    params![group],
                )
                .map_err(db)?;
                tx.execute("DELETE FROM chunnel_ballots WHERE grp = ?1", params![group])
                    .map_err(db)?;
                touch(tx, &group, grace)?;
                Ok(true)
            })
            .await?;
        if done {
            self.wake(group_name, Changes::TRANSITION);
        }
        Ok(done)
    }

    /// Notifications from this process's writes, and other processes' while this process's
    /// wake-up socket is healthy (then complete): see "Notifications" in the module docs.
    fn watch(&self, group: &str) -> Option<Watch> {
        Some(self.wakes.watch(group))
    }
}
