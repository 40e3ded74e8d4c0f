//! Model checks of the reconfiguration cell with [loom](https://docs.rs/loom): a switch
//! (`ReconfigConnection::reconfigure`) against concurrent `send` and `recv`, every interleaving
//! of 2–3 threads (up to loom's preemption bound), for both mechanisms ([`LockFree`], [`Lock`]).
//!
//! Only built with `--cfg chunnel_loom` (the crate's atomics, mutexes and implementation slots then
//! come from loom, see `src/reconfig/sync.rs`):
//!
//! ```sh
//! RUSTFLAGS="--cfg chunnel_loom" CARGO_TARGET_DIR=target/loom \
//!   cargo test -p chunnel --release --test loom_reconfig -- --test-threads=1 --nocapture
//! ```
//!
//! `LOOM_MAX_PREEMPTIONS` bounds the preemptions per execution (3 when unset); each test prints
//! how many executions it explored.
//!
//! What is checked, on the real `ReconfigConnection` code:
//!
//! * **no use of a switched-out or freed implementation**: loom tracks every access to the
//!   slot that holds the implementation (a shared access for as long as a call holds its
//!   ticket, an exclusive one while the switcher transfers state and installs the new one) and
//!   fails on two that are not ordered by happens-before; the test implementation also asserts,
//!   on entry to and on return from each call, that it has not been exported yet;
//! * **no lost wake-up**: a `recv` blocked in the old implementation when the switch starts
//!   must be woken and finish on the new one; loom fails any execution in which every thread
//!   waits (a deadlock);
//! * **no message through the wrong implementation**: every message records which
//!   implementation sent it; messages sent after the switch returned went through the new one,
//!   each sender's messages switch implementation at most once, and every message sent
//!   arrives exactly once, in order, including the ones the old implementation had buffered
//!   (they move through the carry-over queue).
//!
//! What loom does not model here: the waker of each thread is loom's (`loom::future::block_on`),
//! not a tokio runtime's; `Arc`/`Weak` of the connection and its registry are `std`'s (loom's
//! `Arc` cannot be unsized to `Arc<dyn Switch>`); under loom the lock-free gate has 2 stripes
//! (threads 0 and 2 share one, thread 1 has its own) instead of 8. The `planted_*` tests plant a
//! bug in the cell (`chunnel::plant_bug`, loom builds only) and show the checks fail on it.

#![cfg(chunnel_loom)]

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::task::{Poll, Waker};

use chunnel::{
    Chunnel, ChunnelConnection, ConnectionExt, Error, Handoff, Handover, Lock, LockFree, Mechanism,
    Negotiate, PlantedBug, ReconfigConnection, Shared, Side, plant_bug, select, stack,
};
use loom::sync::Mutex;
use loom::sync::atomic::{AtomicBool, Ordering};

/// A message: a value and the implementation that sent it (0 left, 1 right).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Msg {
    v: u64,
    by: u8,
}

fn msg(v: u64) -> Msg {
    Msg { v, by: u8::MAX }
}

// ---------------------------------------------------------------------------------------------
// The base connection: a loopback queue (what is sent is received), one receiving task.

#[derive(Debug, Default)]
struct Pipe {
    st: Mutex<PipeState>,
}

#[derive(Debug, Default)]
struct PipeState {
    q: VecDeque<Msg>,
    waker: Option<Waker>,
}

impl ChunnelConnection for Pipe {
    type Data = Msg;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Msg> + Send,
        B::IntoIter: Send,
    {
        let waker = {
            let mut st = self.st.lock().unwrap();
            st.q.extend(burst);
            st.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Msg>]) -> Result<usize, Error> {
        poll_fn(|cx| {
            let mut st = self.st.lock().unwrap();
            let n = st.q.len().min(slots.len());
            if n == 0 {
                st.waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
            for (s, m) in slots.iter_mut().zip(st.q.drain(..n)) {
                *s = Some(m);
            }
            Poll::Ready(Ok(n))
        })
        .await
    }
}

// ---------------------------------------------------------------------------------------------
// The two implementations: `Tag<0>` (left) and `Tag<1>` (right) stamp what they send, read two
// messages at a time from below and buffer what the caller has no slot for.

#[derive(Clone, Copy, Debug, Default)]
struct Tag<const BY: u8>;

impl<const BY: u8> Negotiate for Tag<BY> {
    fn id(&self) -> &'static str {
        if BY == 0 {
            "test/tag-left/1"
        } else {
            "test/tag-right/1"
        }
    }
}

#[derive(Debug)]
struct TagConn<const BY: u8> {
    inner: Arc<Pipe>,
    /// Set by `export`: from then on no task may call this implementation.
    exported: AtomicBool,
    /// Read from below, not delivered yet.
    buf: Mutex<VecDeque<Msg>>,
}

impl<const BY: u8> Chunnel<Arc<Pipe>> for Tag<BY> {
    type Connection = TagConn<BY>;

    async fn connect_wrap(&mut self, inner: Arc<Pipe>) -> Result<TagConn<BY>, Error> {
        Ok(TagConn {
            inner,
            exported: AtomicBool::new(false),
            buf: Mutex::new(VecDeque::new()),
        })
    }
}

impl<const BY: u8> TagConn<BY> {
    fn live(&self, what: &str) {
        assert!(
            !self.exported.load(Ordering::Relaxed),
            "{what} on implementation {BY} after it was switched out"
        );
    }
}

impl<const BY: u8> ChunnelConnection for TagConn<BY> {
    type Data = Msg;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Msg> + Send,
        B::IntoIter: Send,
    {
        self.live("send");
        let stamped = burst.into_iter().map(|m| Msg { v: m.v, by: BY });
        self.inner.send(stamped).await?;
        self.live("send (returning)");
        Ok(())
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Msg>]) -> Result<usize, Error> {
        self.live("recv");
        loop {
            {
                let mut buf = self.buf.lock().unwrap();
                let n = buf.len().min(slots.len());
                if n > 0 {
                    for (s, m) in slots.iter_mut().zip(buf.drain(..n)) {
                        *s = Some(m);
                    }
                    return Ok(n);
                }
            }
            let mut batch = [None, None];
            let got = self.inner.recv(&mut batch).await?;
            self.live("recv (returning)");
            self.buf
                .lock()
                .unwrap()
                .extend(batch.iter_mut().take(got).filter_map(Option::take));
        }
    }
}

impl<const BY: u8> Handover for TagConn<BY> {
    fn export(&self, state: &mut Handoff<Msg>) {
        self.live("export");
        self.exported.store(true, Ordering::Relaxed);
        state.buffered.extend(self.buf.lock().unwrap().drain(..));
    }

    fn import(&self, _: &mut Handoff<Msg>) {
        self.live("import");
    }
}

// ---------------------------------------------------------------------------------------------
// Harness

type Conn<M> = ReconfigConnection<TagConn<0>, TagConn<1>, M>;

/// A connection on the left implementation over a fresh pipe (built inside the model).
fn connect<M: Mechanism>() -> Conn<M> {
    let sel = select(Tag::<0>, Tag::<1>).reconfigurable::<M>();
    let conn =
        loom::future::block_on(stack![sel, Shared].connect_wrap(Pipe::default())).expect("connect");
    assert_eq!(conn.side(), Side::Left);
    conn
}

/// Runs `f` under loom with the bug `bug` planted, at most `bound` preemptions per execution
/// (`LOOM_MAX_PREEMPTIONS` overrides it); prints the executions explored.
fn check(name: &str, bug: PlantedBug, bound: usize, f: impl Fn() + Sync + Send + 'static) {
    static EXECUTIONS: AtomicUsize = AtomicUsize::new(0);
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(bound);
    }
    // A switch is a few hundred loom operations (two gates closed, drained and opened, the
    // waker lists): more than loom's default 1,000 branches per execution.
    builder.max_branches = 20_000;
    let bound = builder.preemption_bound;
    plant_bug(bug);
    // Only one `check` runs per test thread at a time; the counter is per test binary, so
    // read it before and after (tests run with --test-threads=1 for exact counts).
    let before = EXECUTIONS.load(std::sync::atomic::Ordering::Relaxed);
    let f = Arc::new(f);
    builder.check(move || {
        EXECUTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        f()
    });
    plant_bug(PlantedBug::None);
    let after = EXECUTIONS.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "loom {name}: {} executions explored (preemption bound {bound:?})",
        after - before
    );
}

fn recv_n<M: Mechanism>(conn: &Conn<M>, n: usize) -> Vec<Msg> {
    (0..n)
        .map(|_| loom::future::block_on(conn.recv_one()).expect("recv"))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The models

/// A `recv` blocked in the old implementation (nothing to read) while another thread switches
/// and then sends: the receiver is woken out of the old implementation and gets the message
/// from the new one.
fn blocked_recv_moves<M: Mechanism>() {
    let conn = connect::<M>();
    let switcher = {
        let conn = conn.clone();
        loom::thread::spawn(move || {
            assert!(loom::future::block_on(conn.reconfigure(Side::Right)).unwrap());
            loom::future::block_on(conn.send_one(msg(7))).unwrap();
        })
    };
    let got = recv_n(&conn, 1);
    switcher.join().unwrap();
    assert_eq!(
        got,
        [Msg { v: 7, by: 1 }],
        "sent after the switch, so by the new one"
    );
    assert_eq!(conn.side(), Side::Right);
}

/// Two messages sent before the switch; the old implementation may have read both from below
/// and delivered one. A receiver takes two messages while another thread switches: each
/// arrives once, in order, whether from the old implementation or the carry-over queue.
fn carry_over<M: Mechanism>() {
    let conn = connect::<M>();
    loom::future::block_on(conn.send([msg(1), msg(2)])).unwrap();
    let switcher = {
        let conn = conn.clone();
        loom::thread::spawn(move || {
            assert!(loom::future::block_on(conn.reconfigure(Side::Right)).unwrap());
        })
    };
    let got = recv_n(&conn, 2);
    switcher.join().unwrap();
    assert_eq!(got, [Msg { v: 1, by: 0 }, Msg { v: 2, by: 0 }]);
    assert_eq!(conn.switches(), 1);
}

/// Three threads: one sends two messages, one switches then sends one, the main thread
/// receives all three. The sender's messages change implementation at most once (left, then
/// right), the switcher's goes through the new one, nothing is lost or duplicated. (Three
/// threads multiply the interleavings: this one runs at preemption bound 1 in CI.)
fn send_recv_switch<M: Mechanism>() {
    let conn = connect::<M>();
    let sender = {
        let conn = conn.clone();
        loom::thread::spawn(move || {
            loom::future::block_on(conn.send_one(msg(1))).unwrap();
            loom::future::block_on(conn.send_one(msg(2))).unwrap();
        })
    };
    let switcher = {
        let conn = conn.clone();
        loom::thread::spawn(move || {
            assert!(loom::future::block_on(conn.reconfigure(Side::Right)).unwrap());
            loom::future::block_on(conn.send_one(msg(3))).unwrap();
        })
    };
    let mut got = recv_n(&conn, 3);
    sender.join().unwrap();
    switcher.join().unwrap();
    assert!(got.contains(&Msg { v: 3, by: 1 }), "{got:?}");
    let ours: Vec<Msg> = got.iter().copied().filter(|m| m.v != 3).collect();
    assert_eq!(
        ours.iter().map(|m| m.v).collect::<Vec<_>>(),
        [1, 2],
        "{got:?}"
    );
    assert!(
        ours[0].by <= ours[1].by,
        "back to the old implementation: {got:?}"
    );
    got.sort_by_key(|m| m.v);
    assert_eq!(got.len(), 3);
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn lock_free_blocked_recv_moves() {
    check(
        "lock_free_blocked_recv_moves",
        PlantedBug::None,
        3,
        blocked_recv_moves::<LockFree>,
    );
}

#[test]
fn lock_blocked_recv_moves() {
    check(
        "lock_blocked_recv_moves",
        PlantedBug::None,
        3,
        blocked_recv_moves::<Lock>,
    );
}

#[test]
fn lock_free_carry_over() {
    check(
        "lock_free_carry_over",
        PlantedBug::None,
        3,
        carry_over::<LockFree>,
    );
}

#[test]
fn lock_carry_over() {
    check("lock_carry_over", PlantedBug::None, 3, carry_over::<Lock>);
}

#[test]
fn lock_free_send_recv_switch() {
    check(
        "lock_free_send_recv_switch",
        PlantedBug::None,
        1,
        send_recv_switch::<LockFree>,
    );
}

#[test]
fn lock_send_recv_switch() {
    check(
        "lock_send_recv_switch",
        PlantedBug::None,
        1,
        send_recv_switch::<Lock>,
    );
}

/// Planted bug: the lock-free gate's `exit` with `Relaxed`. The switcher can then see the gate
/// drained without the receiver's use of the old implementation happening before its state
/// transfer; loom reports the unordered slot accesses.
#[test]
#[should_panic(expected = "Causality violation")]
fn planted_relaxed_exit_is_caught() {
    check(
        "planted_relaxed_exit_is_caught",
        PlantedBug::RelaxedExit,
        3,
        carry_over::<LockFree>,
    );
}

/// Planted bug: a blocked `recv` does not look at the gate again after registering its waker.
/// A switch that starts between the look and the registration never wakes it: the switcher
/// waits for it to leave the old implementation forever, and loom reports the deadlock.
///
/// Unwinding out of a loom deadlock panics again in destructors (an abort), so the model runs
/// in a child process (this test binary, filtered to this test) that must fail with loom's
/// deadlock report.
#[test]
fn planted_lost_wakeup_is_caught() {
    const CHILD: &str = "CHUNNEL_LOOM_PLANTED_CHILD";
    if std::env::var_os(CHILD).is_some() {
        check(
            "planted_lost_wakeup_is_caught",
            PlantedBug::NoRecheck,
            3,
            blocked_recv_moves::<LockFree>,
        );
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "planted_lost_wakeup_is_caught",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the planted lost wake-up went unnoticed"
    );
    assert!(
        stderr.contains("deadlock"),
        "failed, but not on a deadlock: {stderr}"
    );
    println!("loom planted_lost_wakeup_is_caught: the child failed with loom's deadlock report");
}
