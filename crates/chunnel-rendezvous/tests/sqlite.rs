//! The embedded SQLite backend: the store semantics, the group scenarios, and two processes
//! sharing one file.

mod support;

use std::sync::Arc;

use chunnel_rendezvous::SqliteStore;
use support::Scratch;
use support::scenarios;

fn open(s: &Scratch) -> Arc<SqliteStore> {
    Arc::new(SqliteStore::open(s.0.join("groups.sqlite")).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store_semantics() {
    let s = Scratch::new("sqlite-conf");
    chunnel_rendezvous::conformance::store_semantics(&*open(&s), "conf").await;
}

/// Ballots as datagrams to the proposer, the store fallback, forged ballots, mixed groups and
/// a dead voter (tests/support/direct.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_direct_ballots() {
    let s = Scratch::new("sqlite-direct");
    support::direct::direct_ballots(|| async { open(&s) }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_64_racing_joiners_agree_on_one_stack() {
    let s = Scratch::new("sqlite-race");
    // Every participant opens the file itself (its own SQLite connection).
    scenarios::race_64(|| async { open(&s) }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_incompatible_late_joiner() {
    let s = Scratch::new("sqlite-late");
    scenarios::incompatible_late_joiner(open(&s)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_killed_member_expires() {
    let s = Scratch::new("sqlite-lease");
    scenarios::killed_member_expires(open(&s)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_transitions() {
    let s = Scratch::new("sqlite-switch");
    scenarios::transitions(open(&s)).await;
}

/// Two processes, one file: a participant in another process joins through the same SQLite
/// file, exchanges messages, is SIGKILLed, and vanishes after its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_groups_span_processes_and_a_killed_one_expires() {
    let s = Scratch::new("sqlite-procs");
    let path = s.0.join("groups.sqlite");
    let store = Arc::new(SqliteStore::open(&path).unwrap());
    scenarios::killed_process(store, "child_member", path.to_str().unwrap()).await;
}

/// Run only as the child of `sqlite_groups_span_processes_and_a_killed_one_expires`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child half of sqlite_groups_span_processes_and_a_killed_one_expires"]
async fn child_member() {
    let Ok(spec) = std::env::var(scenarios::CHILD_ENV) else {
        return;
    };
    let (path, group) = spec.split_once('\n').unwrap();
    scenarios::child(Arc::new(SqliteStore::open(path).unwrap()), group).await;
}

/// Members of one process, each with its own connection to the file, see joins and switches
/// through the store's in-process wake-up, not its 30 s polls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_switches_by_notification_in_process() {
    let s = Scratch::new("sqlite-notified");
    scenarios::switches_by_notification(|| async { open(&s) }, 8).await;
}
