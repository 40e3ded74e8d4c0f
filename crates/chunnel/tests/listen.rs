//! The server side of a select: `Select<A, B>` as a [`Listen`] binds the first branch that
//! is available and binds, with the same fallback as `Chunnel<()>`'s select, and its
//! [`Either`] listener accepts connections of the bound branch. Over an in-memory datapath
//! defined here whose availability check and bind result each test sets.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use chunnel::{
    ChunnelConnection, ConnectionExt, Either, Error, Listen, Listener, Negotiate, Side, select,
};

/// What the in-memory bind config's availability check or bind reports.
#[derive(Clone, Copy, Debug)]
enum Outcome {
    Ok,
    /// `Error::NotAvailable`.
    Unavailable,
    /// `Error::AddrInUse` (a failure that is not about availability).
    InUse,
}

fn outcome(id: &'static str, o: Outcome, when: &str) -> Result<(), Error> {
    match o {
        Outcome::Ok => Ok(()),
        Outcome::Unavailable => Err(Error::NotAvailable {
            chunnel: id,
            reason: format!("{id} switched off at {when}"),
        }),
        Outcome::InUse => Err(Error::AddrInUse {
            addr: format!("{id}:{when}"),
        }),
    }
}

/// A bind config of an in-memory datapath: `check` is its availability check, `bind` what
/// `listen` does; `binds` counts the calls of `listen`.
#[derive(Clone)]
struct Mem {
    id: &'static str,
    check: Outcome,
    bind: Outcome,
    binds: Arc<AtomicUsize>,
}

fn mem(id: &'static str, check: Outcome, bind: Outcome) -> Mem {
    Mem {
        id,
        check,
        bind,
        binds: Arc::default(),
    }
}

impl Negotiate for Mem {
    fn id(&self) -> &'static str {
        self.id
    }

    fn check_available(&self) -> Result<(), Error> {
        outcome(self.id, self.check, "check")
    }
}

impl Listen for Mem {
    type Listener = MemListener;

    async fn listen(&self) -> Result<MemListener, Error> {
        self.binds.fetch_add(1, Ordering::SeqCst);
        outcome(self.id, self.bind, "bind")?;
        Ok(MemListener {
            id: self.id,
            hints: Arc::default(),
        })
    }
}

/// Hands out one new echo connection per `accept`, tagged with its datapath's id; records the
/// hints it was given.
struct MemListener {
    id: &'static str,
    hints: Arc<Mutex<Vec<&'static str>>>,
}

impl Listener for MemListener {
    type Connection = MemConn;

    async fn accept(&mut self) -> Result<MemConn, Error> {
        Ok(MemConn {
            id: self.id,
            queue: Mutex::default(),
        })
    }

    fn accepting_in_loop(&mut self) {
        self.hints.lock().unwrap().push("accepting_in_loop");
    }

    fn recognise_sessions(&mut self, _session_of: fn(&[u8]) -> Option<u64>) {
        self.hints.lock().unwrap().push("recognise_sessions");
    }
}

/// Every message sent is received back, prefixed with the datapath's id.
struct MemConn {
    id: &'static str,
    queue: Mutex<std::collections::VecDeque<String>>,
}

impl ChunnelConnection for MemConn {
    type Data = String;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = String> + Send,
        B::IntoIter: Send,
    {
        let mut q = self.queue.lock().unwrap();
        q.extend(burst.into_iter().map(|m| format!("{}: {m}", self.id)));
        std::future::ready(Ok(()))
    }

    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<String>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        let mut q = self.queue.lock().unwrap();
        let n = q.len().min(slots.len());
        for (s, m) in slots.iter_mut().zip(q.drain(..n)) {
            *s = Some(m);
        }
        std::future::ready(if n == 0 { Err(Error::Closed) } else { Ok(n) })
    }
}

/// The reason a `NotAvailable` error gives, or a panic naming what came instead.
fn reason(e: &Error) -> &str {
    match e {
        Error::NotAvailable { reason, .. } => reason,
        other => panic!("expected NotAvailable, got {other:?}"),
    }
}

#[tokio::test]
async fn the_preferred_branch_is_bound_when_it_is_available() {
    let s = select(
        mem("fast", Outcome::Ok, Outcome::Ok),
        mem("plain", Outcome::Ok, Outcome::Ok),
    );
    let mut l = s.listen().await.unwrap();
    assert_eq!(l.side(), Side::Left);
    assert_eq!(s.right.binds.load(Ordering::SeqCst), 0);
    let c = l.accept().await.unwrap();
    assert!(matches!(c, Either::Left(_)));
    c.send_one("hi".into()).await.unwrap();
    assert_eq!(c.recv_one().await.unwrap(), "fast: hi");
}

#[tokio::test]
async fn an_unavailable_preferred_branch_leaves_the_fallback_bound() {
    // Unavailable at its check: never bound.
    let s = select(
        mem("fast", Outcome::Unavailable, Outcome::Ok),
        mem("plain", Outcome::Ok, Outcome::Ok),
    );
    let mut l = s.listen().await.unwrap();
    assert_eq!(l.side(), Side::Right);
    assert_eq!(s.left.binds.load(Ordering::SeqCst), 0);
    let c = l.accept().await.unwrap();
    assert_eq!(c.side(), Side::Right);
    c.send_one("hi".into()).await.unwrap();
    assert_eq!(c.recv_one().await.unwrap(), "plain: hi");

    // Available at its check, NotAvailable when it binds (a program the kernel refuses).
    let s = select(
        mem("fast", Outcome::Ok, Outcome::Unavailable),
        mem("plain", Outcome::Ok, Outcome::Ok),
    );
    let mut l = s.listen().await.unwrap();
    assert_eq!(l.side(), Side::Right);
    assert_eq!(s.left.binds.load(Ordering::SeqCst), 1);
    assert_eq!(s.right.binds.load(Ordering::SeqCst), 1);
    let c = l.accept().await.unwrap();
    c.send_one("hi".into()).await.unwrap();
    assert_eq!(c.recv_one().await.unwrap(), "plain: hi");
}

#[tokio::test]
async fn no_branch_holds_both_reasons_when_neither_can_listen() {
    // Both unavailable at their checks.
    let s = select(
        mem("fast", Outcome::Unavailable, Outcome::Ok),
        mem("plain", Outcome::Unavailable, Outcome::Ok),
    );
    match s.listen().await {
        Err(Error::NoBranch { left, right }) => {
            assert_eq!(reason(&left), "fast switched off at check");
            assert_eq!(reason(&right), "plain switched off at check");
        }
        other => panic!("expected NoBranch, got {:?}", other.map(|l| l.side())),
    }
    assert_eq!(s.left.binds.load(Ordering::SeqCst), 0);
    assert_eq!(s.right.binds.load(Ordering::SeqCst), 0);

    // The preferred one fails when it binds, the fallback at its check.
    let s = select(
        mem("fast", Outcome::Ok, Outcome::Unavailable),
        mem("plain", Outcome::Unavailable, Outcome::Ok),
    );
    match s.listen().await {
        Err(Error::NoBranch { left, right }) => {
            assert_eq!(reason(&left), "fast switched off at bind");
            assert_eq!(reason(&right), "plain switched off at check");
        }
        other => panic!("expected NoBranch, got {:?}", other.map(|l| l.side())),
    }
    assert_eq!(s.right.binds.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn other_bind_errors_and_fixed_branches_do_not_fall_back() {
    // An address in use is not a reason to serve on another datapath.
    let s = select(
        mem("fast", Outcome::Ok, Outcome::InUse),
        mem("plain", Outcome::Ok, Outcome::Ok),
    );
    assert!(matches!(s.listen().await, Err(Error::AddrInUse { .. })));
    assert_eq!(s.right.binds.load(Ordering::SeqCst), 0);

    // A fixed branch is bound or fails; the other is never tried.
    let s = select(
        mem("fast", Outcome::Ok, Outcome::Unavailable),
        mem("plain", Outcome::Ok, Outcome::Ok),
    )
    .prefer(Side::Left);
    match s.listen().await {
        Err(e) => assert_eq!(reason(&e), "fast switched off at bind"),
        Ok(l) => panic!("bound {:?} with the left branch fixed", l.side()),
    }
    assert_eq!(s.right.binds.load(Ordering::SeqCst), 0);
    let s = select(
        mem("fast", Outcome::Ok, Outcome::Ok),
        mem("plain", Outcome::Ok, Outcome::Ok),
    )
    .prefer(Side::Right);
    assert_eq!(s.listen().await.unwrap().side(), Side::Right);
    assert_eq!(s.left.binds.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn selects_nest_and_pass_listener_hints_to_the_bound_branch() {
    let s = select(
        mem("xdp", Outcome::Unavailable, Outcome::Ok),
        select(
            mem("uring", Outcome::Ok, Outcome::Unavailable),
            mem("udp", Outcome::Ok, Outcome::Ok),
        ),
    );
    let mut l = s.listen().await.unwrap();
    l.accepting_in_loop();
    l.recognise_sessions(|_| None);
    let hints = match &l {
        Either::Right(Either::Right(udp)) => Arc::clone(&udp.hints),
        _ => panic!("bound {:?}, expected the udp branch", l.side()),
    };
    assert_eq!(
        *hints.lock().unwrap(),
        ["accepting_in_loop", "recognise_sessions"]
    );
    let c = l.accept().await.unwrap();
    c.send_one("hi".into()).await.unwrap();
    assert_eq!(c.recv_one().await.unwrap(), "udp: hi");
}
