//! The endpoint over a real Unix socket: every operation, malformed and hostile input, the
//! client bound, stale sockets and an unsafe directory.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use chunnel_ctl::proto::{
    Body, Code, MAX_REQUEST, Op, Reply, Response, Target, VERSION, encode_request, parse_request,
};
use chunnel_ctl::{
    BoxFuture, Client, Config, Endpoint, Entry, Error, LayerCounters, Mode, Registry, Switch,
    Switched,
};
use proptest::prelude::*;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("chunnel-ctl-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A switch handle over two named branches that records what it was asked.
#[derive(Default)]
struct Fake {
    current: AtomicUsize,
    epoch: AtomicU64,
}

struct Handle(Arc<Fake>);

impl Switch for Handle {
    fn branches(&self) -> Vec<String> {
        vec!["left".into(), "right".into()]
    }
    fn current(&self) -> usize {
        self.0.current.load(Ordering::Relaxed)
    }
    fn epoch(&self) -> u64 {
        self.0.epoch.load(Ordering::Relaxed)
    }
    fn switch(&self, to: usize, mode: Mode) -> BoxFuture<'_, Result<Switched, String>> {
        Box::pin(async move {
            if mode == Mode::Commit {
                return Err("the peer said no".into());
            }
            let changed = self.0.current.swap(to, Ordering::Relaxed) != to;
            if changed {
                self.0.epoch.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Switched {
                changed,
                detail: "done".into(),
            })
        })
    }
}

async fn raw(
    path: &Path,
) -> (
    BufReader<tokio::net::unix::OwnedReadHalf>,
    tokio::net::unix::OwnedWriteHalf,
) {
    let s = UnixStream::connect(path).await.unwrap();
    let (r, w) = s.into_split();
    (BufReader::new(r), w)
}

async fn answer(r: &mut BufReader<tokio::net::unix::OwnedReadHalf>) -> Option<Response> {
    let mut line = String::new();
    let n = tokio::time::timeout(Duration::from_secs(10), r.read_line(&mut line))
        .await
        .expect("an answer within 10 s")
        .ok()?;
    if n == 0 {
        return None;
    }
    Some(serde_json::from_str(&line).expect("a response line"))
}

fn code(r: &Response) -> Option<Code> {
    match &r.body {
        Body::Error(f) => Some(f.code),
        Body::Ok(_) => None,
    }
}

#[tokio::test]
async fn every_operation() {
    let d = dir("ops");
    let registry = Registry::new("test-app");
    let ep = Endpoint::bind(Config::new(d.join("c.sock")), registry.clone()).unwrap();
    let mode = std::fs::metadata(ep.path()).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");
    let fake = Arc::new(Fake::default());
    let sent = Arc::new(AtomicU64::new(5));
    let s2 = Arc::clone(&sent);
    let conn = registry.register(
        Entry::connection("c1")
            .with_peer("10.0.0.1:9")
            .with_stack(["a", "b"])
            .with_counters(move || {
                vec![LayerCounters::new(
                    "app",
                    [("sent", s2.load(Ordering::Relaxed))],
                )]
            })
            .with_switch(Handle(Arc::clone(&fake))),
    );
    let lst = registry.register(Entry::listener("l1"));
    let policy = registry
        .policy("mode", "a or b", "a", |v| {
            if v == "a" || v == "b" {
                Ok(())
            } else {
                Err("a or b".into())
            }
        })
        .unwrap();

    let mut c = Client::connect(ep.path()).await.unwrap();
    assert_eq!(c.process(), (std::process::id(), "test-app"));
    let Reply::Ls { entries, left_off } = c.request(&Op::Ls).await.unwrap() else {
        panic!()
    };
    assert_eq!((entries.len(), left_off), (2, 0));
    assert_eq!(entries[0].id, conn.id());
    assert_eq!(entries[0].branch.as_deref(), Some("left"));
    assert_eq!(entries[0].stack, ["a", "b"]);
    assert_eq!(entries[1].name, "l1");

    // Show reads the counters live.
    sent.store(9, Ordering::Relaxed);
    let Reply::Show { entry } = c.request(&Op::Show { id: conn.id() }).await.unwrap() else {
        panic!()
    };
    assert_eq!(entry.counters[0].counters[0].value, 9);
    let e = c.request(&Op::Show { id: 999 }).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                code: Code::NoSuchEntry,
                ..
            }
        ),
        "{e}"
    );

    // Switch: by name, by index, unknown branch, not switchable, a refused commit, all.
    let sw = |target, branch: &str, commit| Op::Switch {
        target,
        branch: branch.into(),
        commit,
    };
    let Reply::Switch { results } = c
        .request(&sw(Target::Id(conn.id()), "right", false))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert!(results[0].ok && results[0].changed);
    assert_eq!(
        (
            results[0].from.as_str(),
            results[0].to.as_str(),
            results[0].epoch
        ),
        ("left", "right", 1)
    );
    let Reply::Switch { results } = c
        .request(&sw(Target::Id(conn.id()), "1", false))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert!(results[0].ok && !results[0].changed);
    let e = c
        .request(&sw(Target::Id(conn.id()), "middle", false))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                code: Code::NoSuchBranch,
                ..
            }
        ),
        "{e}"
    );
    let e = c
        .request(&sw(Target::Id(lst.id()), "left", false))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                code: Code::NotSwitchable,
                ..
            }
        ),
        "{e}"
    );
    let e = c
        .request(&sw(Target::Id(conn.id()), "left", true))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Remote { code: Code::SwitchFailed, message } if message.contains("the peer said no")),
        "{e}"
    );
    let Reply::Switch { results } = c.request(&sw(Target::All, "left", false)).await.unwrap()
    else {
        panic!()
    };
    assert_eq!(results.len(), 1, "only the switchable entry");
    assert_eq!(fake.current.load(Ordering::Relaxed), 0);

    // Policy.
    let Reply::Policy { policies } = c
        .request(&Op::Policy {
            name: None,
            value: None,
        })
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(
        (policies[0].name.as_str(), policies[0].value.as_str()),
        ("mode", "a")
    );
    let Reply::Policy { policies } = c
        .request(&Op::Policy {
            name: Some("mode".into()),
            value: Some("b".into()),
        })
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(policies[0].previous.as_deref(), Some("a"));
    assert_eq!(policy.get(), "b");
    let e = c
        .request(&Op::Policy {
            name: Some("mode".into()),
            value: Some("c".into()),
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                code: Code::InvalidValue,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(policy.get(), "b");
    let e = c
        .request(&Op::Policy {
            name: Some("nope".into()),
            value: None,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                code: Code::NoSuchPolicy,
                ..
            }
        ),
        "{e}"
    );

    // Watch: `count` snapshots, the last one ends the stream; then the session goes on.
    c.send(&Op::Watch {
        id: Some(conn.id()),
        interval_ms: 50,
        count: Some(3),
    })
    .await
    .unwrap();
    for k in 0..3u64 {
        let (r, more) = c.next().await.unwrap();
        let Reply::Watch { seq, entries, .. } = r else {
            panic!()
        };
        assert_eq!((seq, entries.len(), more), (k, 1, k < 2));
    }
    assert!(matches!(
        c.request(&Op::Hello).await.unwrap(),
        Reply::Hello {
            version: VERSION,
            ..
        }
    ));

    // The guard's drop removes the entry.
    drop(conn);
    let Reply::Ls { entries, .. } = c.request(&Op::Ls).await.unwrap() else {
        panic!()
    };
    assert_eq!(entries.len(), 1);
    // A watched entry that goes away ends its watch with an error.
    c.send(&Op::Watch {
        id: Some(lst.id()),
        interval_ms: 50,
        count: None,
    })
    .await
    .unwrap();
    assert!(c.next().await.unwrap().1);
    drop(lst);
    let e = loop {
        match c.next().await {
            Ok((_, true)) => continue,
            other => break other.unwrap_err(),
        }
    };
    assert!(
        matches!(
            e,
            Error::Remote {
                code: Code::NoSuchEntry,
                ..
            }
        ),
        "{e}"
    );
    drop(ep);
    assert!(
        !d.join("c.sock").exists(),
        "the socket file is removed with the endpoint"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[tokio::test]
async fn bad_input_gets_an_answer_and_the_session_goes_on() {
    let d = dir("bad");
    let ep = Endpoint::bind(Config::new(d.join("c.sock")), Registry::new("t")).unwrap();
    let (mut r, mut w) = raw(ep.path()).await;
    let cases: [(&[u8], Code); 6] = [
        (b"hello\n", Code::Malformed),
        (b"{\"v\":1,\"op\":\"nope\"}\n", Code::Malformed),
        (b"{\"v\":7,\"op\":\"ls\"}\n", Code::Version),
        (b"{\"op\":\"ls\"}\n", Code::Malformed),
        (b"\xff\xfe\x00\n", Code::Malformed),
        (b"{\"v\":1,\"op\":\"show\",\"id\":-1}\n", Code::Malformed),
    ];
    for (line, want) in cases {
        w.write_all(line).await.unwrap();
        let a = answer(&mut r).await.unwrap();
        assert_eq!(a.v, VERSION);
        assert_eq!(code(&a), Some(want), "{:?}", String::from_utf8_lossy(line));
    }
    // Blank lines are skipped; CRLF is accepted.
    w.write_all(b"\n\r\n{\"v\":1,\"op\":\"ls\"}\r\n")
        .await
        .unwrap();
    assert_eq!(code(&answer(&mut r).await.unwrap()), None);
    // A line longer than the bound: an answer, then the session ends.
    let long = vec![b'x'; MAX_REQUEST + 10];
    w.write_all(&long).await.unwrap();
    assert_eq!(code(&answer(&mut r).await.unwrap()), Some(Code::TooLong));
    assert!(
        answer(&mut r).await.is_none(),
        "closed after a too-long line"
    );
    // The endpoint still serves others.
    let mut c = Client::connect(ep.path()).await.unwrap();
    c.request(&Op::Ls).await.unwrap();
    drop(ep);
    std::fs::remove_dir_all(&d).unwrap();
}

#[tokio::test]
async fn clients_are_bounded() {
    let d = dir("busy");
    let cfg = Config::new(d.join("c.sock")).with_max_clients(2);
    let ep = Endpoint::bind(cfg, Registry::new("t")).unwrap();
    let a = Client::connect(ep.path()).await.unwrap();
    let _b = Client::connect(ep.path()).await.unwrap();
    let e = Client::connect(ep.path()).await.unwrap_err();
    assert!(
        matches!(&e, Error::Refused { code: Code::Busy, message } if message.contains("maximum of 2")),
        "{e}"
    );
    // A slot frees when a session ends.
    drop(a);
    let mut ok = false;
    for _ in 0..100 {
        if Client::connect(ep.path()).await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ok, "a freed slot serves a new client");
    drop(ep);
    std::fs::remove_dir_all(&d).unwrap();
}

#[tokio::test]
async fn idle_clients_are_disconnected() {
    let d = dir("idle");
    let cfg = Config::new(d.join("c.sock")).with_idle_timeout(Duration::from_millis(200));
    let ep = Endpoint::bind(cfg, Registry::new("t")).unwrap();
    let (mut r, _w) = raw(ep.path()).await;
    assert!(answer(&mut r).await.is_none());
    drop(ep);
    std::fs::remove_dir_all(&d).unwrap();
}

#[tokio::test]
async fn binding_checks_the_path() {
    let d = dir("bind");
    let path = d.join("c.sock");
    // No socket: a clear error from the client.
    let e = Client::connect(&path).await.unwrap_err();
    assert!(matches!(e, Error::NoSocket { .. }), "{e}");
    // A stale socket (nobody listens) is replaced; a live one is not.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let e = Client::connect(&path).await.unwrap_err();
    assert!(matches!(e, Error::NotListening { .. }), "{e}");
    let ep = Endpoint::bind(Config::new(&path), Registry::new("t")).unwrap();
    let e = Endpoint::bind(Config::new(&path), Registry::new("t")).unwrap_err();
    assert!(matches!(e, Error::InUse { .. }), "{e}");
    drop(ep);
    // Not a socket: refused, left alone.
    std::fs::write(&path, b"data").unwrap();
    let e = Endpoint::bind(Config::new(&path), Registry::new("t")).unwrap_err();
    assert!(matches!(e, Error::Insecure { .. }), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), b"data");
    // A directory of another user.
    let other = d.join("other");
    std::fs::create_dir(&other).unwrap();
    let uid = unsafe_free_euid();
    if uid == 0 {
        std::os::unix::fs::chown(&other, Some(65534), None).unwrap();
        let e = Endpoint::bind(Config::new(other.join("c.sock")), Registry::new("t")).unwrap_err();
        assert!(
            matches!(&e, Error::Insecure { reason, .. } if reason.contains("uid 65534")),
            "{e}"
        );
    } else {
        println!("skipped the other user's directory: needs root to chown (uid {uid})");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// This process's uid, read from a file it creates.
fn unsafe_free_euid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    let p = std::env::temp_dir().join(format!("chunnel-ctl-uid-{}", std::process::id()));
    std::fs::write(&p, b"").unwrap();
    let uid = std::fs::metadata(&p).unwrap().uid();
    std::fs::remove_file(&p).unwrap();
    uid
}

fn valid_requests() -> Vec<Vec<u8>> {
    [
        Op::Hello,
        Op::Ls,
        Op::Show { id: 12 },
        Op::Switch {
            target: Target::All,
            branch: "server-side".into(),
            commit: true,
        },
        Op::Policy {
            name: Some("rate".into()),
            value: Some("5".into()),
        },
        Op::Watch {
            id: Some(1),
            interval_ms: 100,
            count: Some(2),
        },
    ]
    .iter()
    .map(|op| {
        let mut l = encode_request(op);
        l.pop();
        l
    })
    .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any bytes: an answer or an error, never a panic.
    #[test]
    fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_request(&bytes);
    }

    /// Every strict prefix of a valid request is refused as malformed; a flipped byte is
    /// refused or parses to some request, never panics.
    #[test]
    fn truncated_and_mutated(which in 0usize..6, cut in any::<prop::sample::Index>(), flip in any::<(prop::sample::Index, u8)>()) {
        let line = &valid_requests()[which];
        let n = cut.index(line.len());
        let e = parse_request(&line[..n]).unwrap_err();
        prop_assert_eq!(e.code, Code::Malformed);
        let mut m = line.clone();
        let i = flip.0.index(m.len());
        m[i] ^= flip.1 | 1;
        let _ = parse_request(&m);
    }
}

/// The live endpoint fed arbitrary lines: one answer per line, and it keeps serving.
#[test]
fn live_endpoint_survives_garbage() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let d = dir("fuzz");
    let ep = rt.block_on(async {
        Endpoint::bind(Config::new(d.join("c.sock")), Registry::new("t")).unwrap()
    });
    let path = ep.path().to_owned();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(64));
    let strategy = proptest::collection::vec(
        prop_oneof![
            proptest::collection::vec(
                any::<u8>().prop_filter("no newline", |b| *b != b'\n'),
                1..200
            ),
            (0usize..6, any::<prop::sample::Index>()).prop_map(|(w, cut)| {
                let l = valid_requests()[w].clone();
                let n = cut.index(l.len()).max(1);
                l[..n].to_vec()
            }),
        ],
        1..8,
    );
    runner
        .run(&strategy, |lines| {
            rt.block_on(async {
                let (mut r, mut w) = raw(&path).await;
                for l in &lines {
                    let mut line = l.clone();
                    line.push(b'\n');
                    w.write_all(&line).await.unwrap();
                    let blank = l.iter().all(u8::is_ascii_whitespace);
                    if blank {
                        continue;
                    }
                    let a = answer(&mut r).await.expect("an answer per line");
                    assert_eq!(a.v, VERSION);
                }
                // Still serving on this session.
                w.write_all(&encode_request(&Op::Hello)).await.unwrap();
                let a = answer(&mut r).await.expect("a hello answer");
                assert_eq!(code(&a), None);
            });
            Ok(())
        })
        .unwrap();
    drop(ep);
    std::fs::remove_dir_all(&d).unwrap();
}
