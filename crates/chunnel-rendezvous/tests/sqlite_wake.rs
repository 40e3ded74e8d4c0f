//! The SQLite store's wake-ups across the processes of a host (`src/sqlite/wake.rs`): a
//! participant in another process follows a switch with polls far longer than the test, a
//! killed process's socket is removed by the next write, malformed datagrams are ignored and
//! counted, a full queue leaves a marker that wakes every watch, and the in-process wake-up
//! works without the cross-process channel.

mod support;

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chunnel::select;
use chunnel_rendezvous::sqlite_wake::{Counters, encode};
use chunnel_rendezvous::{Changes, Group, Member, SqliteStore, Store, Watch};
use chunnel_test::Xor;
use support::Scratch;
use support::scenarios::{any_port, polling, unique, until};
use tokio::io::AsyncBufReadExt;

/// The variable that makes a run of this binary the child (`wake_child`):
/// `<role>\n<file>\n<group>`.
const CHILD_ENV: &str = "CHUNNEL_RDV_WAKE_CHILD";

/// Longer than any test here: a member that changes within it was notified.
const SLOW: Duration = Duration::from_secs(60);

/// Generous bound on anything a notification carries.
const BOUND: Duration = Duration::from_secs(20);

fn wake_dir(db: &Path) -> PathBuf {
    let mut d = std::fs::canonicalize(db).unwrap().into_os_string();
    d.push(".wake");
    PathBuf::from(d)
}

/// The socket files in the wake-up directory.
fn sockets(db: &Path) -> Vec<PathBuf> {
    let Ok(dir) = std::fs::read_dir(wake_dir(db)) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = dir
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sock"))
        .collect();
    v.sort();
    v
}

fn spawn_child(role: &str, db: &Path, group: &str) -> tokio::process::Child {
    tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "wake_child", "--ignored", "--nocapture"])
        .env(CHILD_ENV, format!("{role}\n{}\n{group}", db.display()))
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// Waits (bounded) for the child to print `marker`.
async fn expect_line(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    marker: &str,
) {
    tokio::time::timeout(BOUND, async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if l.contains(marker) {
                return;
            }
        }
        panic!("the child exited before printing {marker}");
    })
    .await
    .unwrap_or_else(|_| panic!("the child did not print {marker} within {BOUND:?}"));
}

/// Waits until the watch is complete; the notifications taken meanwhile are dropped.
async fn until_complete(w: &mut Watch) {
    tokio::time::timeout(BOUND, async {
        while !w.is_complete() {
            w.changed().await;
        }
    })
    .await
    .expect("the watch never became complete");
}

/// The next notified kinds (bounded), skipping wake-ups that notified none (a watch may
/// have one left over from a change of state).
async fn next_change(w: &mut Watch) -> Changes {
    tokio::time::timeout(BOUND, async {
        loop {
            let c = w.changed().await;
            if !c.is_empty() {
                return c;
            }
        }
    })
    .await
    .expect("no notification")
}

/// Waits (bounded) until the store's counters satisfy `f`.
async fn until_counted(store: &SqliteStore, what: &str, f: impl Fn(&Counters) -> bool) -> Counters {
    let deadline = Instant::now() + BOUND;
    loop {
        let c = store.wake_counters();
        if f(&c) {
            return c;
        }
        assert!(Instant::now() < deadline, "never counted {what}: {c:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Two processes, one file, polls every 60 s: the parent's proposal reaches the child (which
/// votes), its commit switches the child, and the child's proposal switches the parent back,
/// each within the test's bound; only the wake-up datagrams can carry that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_processes_switch_by_notification() {
    let s = Scratch::new("sqlite-wake-switch");
    let path = s.0.join("groups.sqlite");
    let store = Arc::new(SqliteStore::open(&path).unwrap());
    let group = unique("wake");
    let started = Instant::now();
    let parent = Group::join(
        store.clone(),
        &group,
        "parent",
        any_port(),
        select(Xor(1), Xor(2)),
        None,
        polling(SLOW, SLOW),
    )
    .await
    .unwrap();
    let mut child = spawn_child("switch", &path, &group);
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    until(&parent, "the child process's join", BOUND, |v| {
        v.members.len() == 2
    })
    .await;
    expect_line(&mut lines, "CHILD-JOINED").await;
    // The child learns of the proposal only by notification; without its yes the proposal
    // aborts after its 10 s timeout.
    let proposed = Instant::now();
    parent.propose(1).await.expect("the child did not vote");
    eprintln!(
        "a proposal committed across two processes in {:?}",
        proposed.elapsed()
    );
    until(&parent, "epoch 2", BOUND, |v| v.epoch == 2).await;
    expect_line(&mut lines, "CHILD-EPOCH-2").await;
    // The child proposes back; the parent votes and follows the commit.
    until(&parent, "epoch 3, proposed by the child", BOUND, |v| {
        v.epoch == 3 && v.option == 0
    })
    .await;
    expect_line(&mut lines, "CHILD-COMMITTED-3").await;
    assert!(
        started.elapsed() < SLOW,
        "the test ran past the poll interval, so polling may have carried it"
    );
    let c = store.wake_counters();
    assert!(c.bound && c.received > 0 && c.sent > 0, "{c:?}");
    parent.leave().await.unwrap();
    child.kill().await.unwrap();
}

/// A process killed with SIGKILL leaves its socket behind; the next write to any group of the
/// file removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_killed_process_socket_is_removed() {
    let s = Scratch::new("sqlite-wake-dead");
    let path = s.0.join("groups.sqlite");
    let store = SqliteStore::open(&path).unwrap();
    let group = unique("dead");
    let mut child = spawn_child("watch", &path, &group);
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    expect_line(&mut lines, "CHILD-WATCHING").await;
    let pid = child.id().unwrap();
    let socks = sockets(&path);
    assert_eq!(socks.len(), 1, "one socket, the child's: {socks:?}");
    let sock = socks[0].clone();
    assert!(
        sock.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(&format!("{pid}-")),
        "{sock:?} is not named after the child ({pid})"
    );
    child.kill().await.unwrap(); // SIGKILL: no clean-up
    child.wait().await.unwrap();
    assert!(
        sock.exists(),
        "the killed child's socket vanished by itself"
    );
    // Any write that notifies: a leave of nobody.
    store.leave(&group, "nobody").await.unwrap();
    assert!(!sock.exists(), "the dead socket was not removed");
    assert_eq!(store.wake_counters().removed, 1);
    assert!(sockets(&path).is_empty());
}

/// Malformed datagrams are ignored and counted; the socket keeps serving, and a valid one
/// after them wakes its group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_malformed_wakeups_are_ignored() {
    let s = Scratch::new("sqlite-wake-bad");
    let path = s.0.join("groups.sqlite");
    let store = SqliteStore::open(&path).unwrap();
    let mut w = store.watch("g").unwrap();
    until_complete(&mut w).await;
    let socks = sockets(&path);
    assert_eq!(socks.len(), 1, "{socks:?}");
    let tx = UnixDatagram::unbound().unwrap();
    let long = [&[1u8, 1][..], &[b'g'; 300][..]].concat();
    let bad: [&[u8]; 8] = [
        b"",
        &[1],
        &[2, 1, b'g'],
        &[1, 0, b'g'],
        &[1, 9, b'g'],
        &[1, 1, 0xff],
        &[1, 1, b'a', b'/'],
        &long,
    ];
    for d in bad {
        tx.send_to(d, &socks[0]).unwrap();
    }
    tx.send_to(&encode(Changes::MEMBERS, "g").unwrap(), &socks[0])
        .unwrap();
    // In order: once the valid one is counted, so are the others.
    let c = until_counted(&store, "the valid datagram", |c| c.received >= 1).await;
    assert_eq!((c.received, c.malformed), (1, 8), "{c:?}");
    assert!(w.is_complete(), "malformed datagrams broke the channel");
    let got = tokio::time::timeout(BOUND, w.changed()).await.unwrap();
    assert!(got.contains(Changes::MEMBERS), "{got:?}");
}

/// A receive queue that is full: the writer leaves the socket's marker; a receiver that finds
/// its marker wakes every watch of the file with `Changes::ALL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_overflow_marks_and_wakes_everything() {
    let s = Scratch::new("sqlite-wake-full");
    let path = s.0.join("groups.sqlite");
    let store = SqliteStore::open(&path).unwrap();
    // The writer's half: a socket nobody reads (named as another process's would be).
    let dir = wake_dir(&path);
    std::fs::create_dir_all(&dir).unwrap();
    let stuck = UnixDatagram::bind(dir.join("0-stuck.sock")).unwrap();
    let mut writes = 0;
    while store.wake_counters().overflowed == 0 {
        assert!(writes < 100_000, "the queue never filled");
        store.leave("g", "nobody").await.unwrap();
        writes += 1;
    }
    assert!(
        dir.join("0-stuck.missed").exists(),
        "no marker after an overflow"
    );
    let mut buf = [0u8; 256];
    stuck.set_nonblocking(true).unwrap();
    let n = stuck.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], &encode(Changes::MEMBERS, "g").unwrap()[..]);
    drop(stuck);
    std::fs::remove_file(dir.join("0-stuck.sock")).unwrap();

    // The receiver's half: our own socket's marker, then a datagram for another group.
    let mut w = store.watch("g").unwrap();
    until_complete(&mut w).await;
    let socks = sockets(&path);
    assert_eq!(socks.len(), 1, "{socks:?}");
    std::fs::write(socks[0].with_extension("missed"), b"").unwrap();
    UnixDatagram::unbound()
        .unwrap()
        .send_to(&encode(Changes::BALLOTS, "other").unwrap(), &socks[0])
        .unwrap();
    let got = next_change(&mut w).await;
    assert_eq!(got, Changes::ALL, "the marker did not wake everything");
    let c = until_counted(&store, "the marker", |c| c.missed >= 1).await;
    assert_eq!(c.missed, 1, "{c:?}");
    assert!(!socks[0].with_extension("missed").exists());
}

/// Where no socket can be bound (its path is longer than a socket address holds), the watch
/// stays incomplete, and this process's writes still wake it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_in_process_wakeups_without_a_socket() {
    let s = Scratch::new("sqlite-wake-long");
    let deep = s.0.join("d".repeat(120));
    std::fs::create_dir_all(&deep).unwrap();
    let path = deep.join("groups.sqlite");
    let watcher = SqliteStore::open(&path).unwrap();
    let writer = SqliteStore::open(&path).unwrap();
    let mut w = watcher.watch("g").unwrap();
    let me = Member {
        id: "m".into(),
        addr: "127.0.0.1:1".into(),
    };
    writer
        .join(
            "g",
            &me,
            Some(&bytes::Bytes::from_static(b"stack")),
            None,
            SLOW,
        )
        .await
        .unwrap();
    let got = tokio::time::timeout(BOUND, w.changed()).await.unwrap();
    assert!(got.contains(Changes::MEMBERS), "{got:?}");
    assert!(!w.is_complete(), "complete without a socket");
    assert!(!watcher.wake_counters().bound);
}

/// A writer's cached listing of the directory follows it: a socket bound after the writer
/// listed (once the listing is old enough to be trusted) still gets the next write's
/// datagram.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_writer_sees_a_socket_bound_after_it_listed() {
    let s = Scratch::new("sqlite-wake-list");
    let path = s.0.join("groups.sqlite");
    let store = SqliteStore::open(&path).unwrap();
    let dir = wake_dir(&path);
    std::fs::create_dir_all(&dir).unwrap();
    let bind = |name: &str| {
        let sock = UnixDatagram::bind(dir.join(name)).unwrap();
        sock.set_nonblocking(true).unwrap();
        sock
    };
    let want = encode(Changes::MEMBERS, "g").unwrap();
    let got_one = |sock: &UnixDatagram, who: &str| {
        let mut buf = [0u8; 256];
        let n = sock
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("{who} got no datagram: {e}"));
        assert_eq!(&buf[..n], &want[..], "{who}");
    };
    let a = bind("0-a.sock");
    store.leave("g", "nobody").await.unwrap();
    got_one(&a, "a, bound before the first write");
    // Past the time a listing is re-read on every write: the next one is cached by the
    // directory's modification time.
    tokio::time::sleep(chunnel_rendezvous::sqlite_wake::RACY + Duration::from_millis(500)).await;
    store.leave("g", "nobody").await.unwrap();
    got_one(&a, "a, on the write that cached the listing");
    let b = bind("0-b.sock");
    store.leave("g", "nobody").await.unwrap();
    got_one(&a, "a, after b was bound");
    got_one(&b, "b, bound after the listing was cached");
    assert_eq!(store.wake_counters().sent, 4);
}

/// The socket outlives the tokio runtime of the watch that bound it: a watch made in another
/// runtime stays complete and woken after that runtime shut down.
#[test]
fn sqlite_watch_outlives_the_runtime_that_bound_the_socket() {
    let s = Scratch::new("sqlite-wake-rt");
    let path = s.0.join("groups.sqlite");
    let store = SqliteStore::open(&path).unwrap();
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    };
    let (first_rt, second_rt) = (runtime(), runtime());
    let first = first_rt.block_on(async {
        let mut w = store.watch("g").unwrap();
        until_complete(&mut w).await;
        w
    });
    let mut second = second_rt.block_on(async {
        let mut w = store.watch("g").unwrap();
        until_complete(&mut w).await;
        // Made complete: the read it calls for.
        assert_eq!(w.changed().await, Changes::ALL);
        w
    });
    drop(first);
    drop(first_rt);
    second_rt.block_on(async {
        assert!(
            second.is_complete(),
            "the first runtime took the socket along"
        );
        let socks = sockets(&path);
        assert_eq!(socks.len(), 1, "{socks:?}");
        UnixDatagram::unbound()
            .unwrap()
            .send_to(&encode(Changes::BALLOTS, "g").unwrap(), &socks[0])
            .unwrap();
        assert_eq!(next_change(&mut second).await, Changes::BALLOTS);
    });
}

/// The child of the tests above (`CHILD_ENV`): `switch` joins the group and follows and makes
/// switches; `watch` holds a watch and waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child half of the cross-process tests in this file"]
async fn wake_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(3, '\n');
    let (role, path, group) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let store = Arc::new(SqliteStore::open(path).unwrap());
    match role {
        "switch" => {
            let me = Group::join(
                store,
                group,
                "child",
                any_port(),
                select(Xor(1), Xor(2)),
                None,
                polling(SLOW, SLOW),
            )
            .await
            .unwrap();
            println!("CHILD-JOINED");
            until(&me, "epoch 2", BOUND, |v| v.epoch == 2 && v.option == 1).await;
            println!("CHILD-EPOCH-2");
            me.propose(0).await.expect("the parent did not vote");
            println!("CHILD-COMMITTED-3");
            std::future::pending::<()>().await;
        }
        "watch" => {
            let mut w = store.watch(group).unwrap();
            until_complete(&mut w).await;
            println!("CHILD-WATCHING");
            std::future::pending::<()>().await;
        }
        other => panic!("unknown child role {other}"),
    }
}
