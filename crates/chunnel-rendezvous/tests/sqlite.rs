//! The embedded SQLite backend: the store semantics, the group scenarios, and two processes
//! sharing one file.

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chunnel::select;
use chunnel_rendezvous::SqliteStore;
use chunnel_test::Xor;
use support::Scratch;
use support::scenarios::{self, any_port, fast, until};

fn open(s: &Scratch) -> Arc<SqliteStore> {
    Arc::new(SqliteStore::open(s.0.join("groups.sqlite")).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store_semantics() {
    let s = Scratch::new("sqlite-conf");
    chunnel_rendezvous::conformance::store_semantics(&*open(&s), "conf").await;
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

const CHILD_ENV: &str = "CHUNNEL_RDV_CHILD";

/// Two processes, one file: the parent creates the group, a child process (this test binary,
/// re-run on `child_member`) joins it, they exchange messages, and the child's exit without
/// leaving is noticed through its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_groups_span_processes() {
    let s = Scratch::new("sqlite-procs");
    let path = s.0.join("groups.sqlite");
    let store = Arc::new(SqliteStore::open(&path).unwrap());
    let group = scenarios::unique("procs");
    let parent = chunnel_rendezvous::Group::join(
        store,
        &group,
        "parent",
        any_port(),
        select(Xor(1), Xor(2)),
        None,
        fast(),
    )
    .await
    .unwrap();
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_member", "--ignored", "--nocapture"])
        .env(CHILD_ENV, format!("{}\n{group}", path.display()))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    until(
        &parent,
        "the child process to join",
        Duration::from_secs(20),
        |v| v.members.len() == 2,
    )
    .await;
    let got = tokio::time::timeout(Duration::from_secs(10), parent.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, "from the child process");
    parent
        .send([Bytes::from_static(b"from the parent")])
        .await
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "child failed: {status}");
    until(
        &parent,
        "the exited child's lease to run out",
        Duration::from_secs(10),
        |v| v.members.len() == 1,
    )
    .await;
}

/// Run only as the child of `sqlite_groups_span_processes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child half of sqlite_groups_span_processes"]
async fn child_member() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (path, group) = spec.split_once('\n').unwrap();
    let store = Arc::new(SqliteStore::open(path).unwrap());
    let me = chunnel_rendezvous::Group::join(
        store,
        group,
        "child",
        any_port(),
        select(Xor(2), Xor(1)),
        None,
        fast(),
    )
    .await
    .unwrap();
    // Our preference (xor=2) lost: the group's committed stack is the parent's.
    assert_eq!(me.participant().view().option, 1);
    until(&me, "the parent", Duration::from_secs(10), |v| {
        v.members.len() == 2
    })
    .await;
    me.send([Bytes::from_static(b"from the child process")])
        .await
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), me.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, "from the parent");
    // Exit without leaving.
    std::mem::forget(me);
}
