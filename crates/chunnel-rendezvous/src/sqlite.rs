//! The embedded default: a group record in an SQLite file.
//!
//! No server: every process on the host that opens the same file shares the groups in it.
//! SQLite serializes writers (each operation is one `BEGIN IMMEDIATE` transaction, the file is
//! in WAL mode, and a writer waits up to [`SqliteStore::BUSY_TIMEOUT`] for the lock). Leases use
//! this host's clock, which every process on it shares.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use crate::Error;
use crate::store::{
    Ballot, Committed, JoinReply, Member, Outcome, Snapshot, Store, Transition, check_name, now_ms,
};

const BACKEND: &str = "sqlite";

/// A rendezvous store in an SQLite file (the embedded default).
///
/// ```no_run
/// # fn main() -> Result<(), chunnel_rendezvous::Error> {
/// let store = chunnel_rendezvous::SqliteStore::open("/tmp/my-app-groups.sqlite")?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

fn db<E: std::fmt::Display>(e: E) -> Error {
    Error::unavailable(BACKEND, e)
}

impl SqliteStore {
    /// How long a writer waits for another process's transaction before failing.
    pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

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
                 proposer TEXT NOT NULL, stack BLOB NOT NULL, deadline_ms INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS chunnel_ballots (
                 grp TEXT NOT NULL, tid INTEGER NOT NULL, member TEXT NOT NULL,
                 ballot TEXT NOT NULL, PRIMARY KEY (grp, member));",
        )
        .map_err(db)?;
        Ok(SqliteStore {
            conn: Arc::new(Mutex::new(conn)),
            path,
        })
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
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
            let tx = conn.transaction_with_behavior(behavior).map_err(db)?;
            let out = f(&tx)?;
            tx.commit().map_err(db)?;
            Ok(out)
        })
        .await
        .map_err(|e| Error::unavailable(BACKEND, format!("store thread failed: {e}")))?
    }
}

/// SQLite integers are signed 64-bit: ids and epochs are stored as their bit pattern.
fn to_sql(v: u64) -> i64 {
    v as i64
}

fn from_sql(v: i64) -> u64 {
    v as u64
}

fn reap(tx: &rusqlite::Transaction<'_>, group: &str) -> Result<(), Error> {
    tx.execute(
        "DELETE FROM chunnel_members WHERE grp = ?1 AND expires_ms <= ?2",
        params![group, to_sql(now_ms())],
    )
    .map_err(db)?;
    Ok(())
}

/// Reads the group record. Expired members are filtered out here (and deleted by the next
/// write), so a read needs no write lock.
fn read(tx: &rusqlite::Transaction<'_>, group: &str) -> Result<Snapshot, Error> {
    let mut snap = Snapshot::default();
    let row = tx
        .query_row(
            "SELECT epoch, stack, outcome_id, outcome_committed FROM chunnel_groups WHERE grp = ?1",
            params![group],
            |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, Option<i64>>(2)?,
                    r.get::<_, Option<i64>>(3)?,
                ))
            },
        )
        .optional()
        .map_err(db)?;
    if let Some((epoch, stack, oid, ocommitted)) = row {
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
    }
    let mut q = tx
        .prepare_cached(
            "SELECT id, addr FROM chunnel_members WHERE grp = ?1 AND expires_ms > ?2 ORDER BY id",
        )
        .map_err(db)?;
    snap.members = q
        .query_map(params![group, to_sql(now_ms())], |r| {
            Ok(Member {
                id: r.get(0)?,
                addr: r.get(1)?,
            })
        })
        .map_err(db)?
        .collect::<Result<_, _>>()
        .map_err(db)?;
    snap.transition = tx
        .query_row(
            "SELECT id, from_epoch, proposer, stack, deadline_ms FROM chunnel_transitions WHERE grp = ?1",
            params![group],
            |r| {
                Ok(Transition {
                    id: from_sql(r.get(0)?),
                    from_epoch: from_sql(r.get(1)?),
                    proposer: r.get(2)?,
                    stack: Bytes::from(r.get::<_, Vec<u8>>(3)?),
                    deadline_ms: from_sql(r.get(4)?),
                })
            },
        )
        .optional()
        .map_err(db)?;
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
    let expires = now_ms().saturating_add(lease.as_millis() as u64);
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

    async fn join(
        &self,
        group: &str,
        member: &Member,
        propose: Option<&Bytes>,
        expect_epoch: Option<u64>,
        lease: Duration,
    ) -> Result<JoinReply, Error> {
        check_name("group name", group)?;
        check_name("member id", &member.id)?;
        let (group, member, propose) = (group.to_owned(), member.clone(), propose.cloned());
        self.txn(move |tx| {
            reap(tx, &group)?;
            let snap = read(tx, &group)?;
            match (&snap.committed, propose) {
                (None, Some(stack)) => {
                    tx.execute(
                        "INSERT INTO chunnel_groups (grp, epoch, stack) VALUES (?1, 1, ?2)",
                        params![group, &stack[..]],
                    )
                    .map_err(db)?;
                    upsert_member(tx, &group, &member, lease)?;
                    Ok(JoinReply::Created(read(tx, &group)?))
                }
                (Some(c), _) if Some(c.epoch) == expect_epoch => {
                    upsert_member(tx, &group, &member, lease)?;
                    Ok(JoinReply::Joined(read(tx, &group)?))
                }
                _ => Ok(JoinReply::Current(snap)),
            }
        })
        .await
    }

    async fn renew(&self, group: &str, member_id: &str, lease: Duration) -> Result<bool, Error> {
        let (group, id) = (group.to_owned(), member_id.to_owned());
        self.txn(move |tx| {
            reap(tx, &group)?;
            let expires = now_ms().saturating_add(lease.as_millis() as u64);
            let n = tx
                .execute(
                    "UPDATE chunnel_members SET expires_ms = ?3 WHERE grp = ?1 AND id = ?2",
                    params![group, id, to_sql(expires)],
                )
                .map_err(db)?;
            Ok(n == 1)
        })
        .await
    }

    async fn leave(&self, group: &str, member_id: &str) -> Result<(), Error> {
        let (group, id) = (group.to_owned(), member_id.to_owned());
        self.txn(move |tx| {
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
            Ok(())
        })
        .await
    }

    async fn snapshot(&self, group: &str) -> Result<Snapshot, Error> {
        let group = group.to_owned();
        self.run(TransactionBehavior::Deferred, move |tx| read(tx, &group))
            .await
    }

    async fn propose(&self, group: &str, t: &Transition) -> Result<bool, Error> {
        let (group, t) = (group.to_owned(), t.clone());
        self.txn(move |tx| {
            let snap = read(tx, &group)?;
            if snap.transition.is_some() || snap.epoch() != t.from_epoch || t.from_epoch == 0 {
                return Ok(false);
            }
            tx.execute(
                "INSERT INTO chunnel_transitions (grp, id, from_epoch, proposer, stack, deadline_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![
                    group,
                    to_sql(t.id),
                    to_sql(t.from_epoch),
                    t.proposer,
                    &t.stack[..],
                    to_sql(t.deadline_ms)
                ],
            )
            .map_err(db)?;
            tx.execute("DELETE FROM chunnel_ballots WHERE grp = ?1", params![group])
                .map_err(db)?;
            Ok(true)
        })
        .await
    }

    async fn vote(
        &self,
        group: &str,
        id: u64,
        member_id: &str,
        ballot: &Ballot,
    ) -> Result<bool, Error> {
        let (group, member, ballot) = (group.to_owned(), member_id.to_owned(), ballot.encode());
        self.txn(move |tx| {
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
            Ok(true)
        })
        .await
    }

    async fn finish(&self, group: &str, id: u64, commit: bool) -> Result<bool, Error> {
        let group = group.to_owned();
        self.txn(move |tx| {
            let snap = read(tx, &group)?;
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
            Ok(true)
        })
        .await
    }
}
