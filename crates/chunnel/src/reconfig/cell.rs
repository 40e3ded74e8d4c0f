//! The reconfiguration cell: the shared core of one connection ([`Core`]), two implementation
//! slots behind the send and receive gates, and the switch steps that fill, swap and empty
//! them. All of the module's `unsafe` code is here; its invariant is stated on `Core`'s `Sync`
//! impl.

use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::task::{Poll, Waker};

use super::gate::{Event, lock};
use super::sync::{AtomicBool, AtomicU8, AtomicU64, Mutex, Ordering, Slot, SlotRef};
use super::{Build, Handoff, Handover, Mechanism};
use crate::{ChunnelConnection, Either, Error, Side};

pub(super) struct Core<L: ChunnelConnection, R, M: Mechanism> {
    /// Admits `send` calls. A switch drains it before `rx`: a send in flight may need the
    /// peer to read, and the peer may need this end to read (flow control), so receivers
    /// keep going until every send has left.
    pub(super) tx: M::Gate,
    /// Admits `recv` calls; carries the carry-over bit.
    pub(super) rx: M::Gate,
    /// The implementations. `slots[send_at]` sends and `slots[recv_at]` receives; they are
    /// the same one except during a multilateral switch, when this end already sends on the
    /// new implementation but still receives, on the old one, what the peer sent before its
    /// switch point. The other slot is empty.
    slots: [Slot<Option<Either<L, R>>>; 2],
    /// Read under a `tx` ticket; written only while `tx` is closed and drained.
    send_at: AtomicU8,
    /// Read under an `rx` ticket; written only while `rx` is closed and drained.
    recv_at: AtomicU8,
    /// [`SPLIT_NONE`], [`SPLIT_RETIRED`], [`SPLIT_RETIRING`] or [`SPLIT_WAITING`].
    pub(super) split: AtomicU8,
    /// The branch `send` uses.
    side: AtomicU8,
    /// Woken when a switch starts (blocked receivers) and when it ends (waiting calls).
    pub(super) event: Event,
    /// The switcher waiting for a gate to drain.
    drain: Mutex<Option<Waker>>,
    /// Messages the previous implementations received but did not deliver, oldest first.
    pub(super) carry: Mutex<VecDeque<L::Data>>,
    /// One switch at a time.
    busy: AtomicBool,
    pub(super) switches: AtomicU64,
    builder: Box<dyn Build<L, R>>,
}

/// Send and receive use the same implementation.
pub(super) const SPLIT_NONE: u8 = 0;
/// This end switched (sends on the new implementation) but the peer has not: receivers read
/// the old one until it reports the peer's switch point.
pub(super) const SPLIT_RETIRED: u8 = 1;
/// A receiver saw the peer's switch point in the old implementation and is dropping it.
pub(super) const SPLIT_RETIRING: u8 = 2;
/// The peer switched (its switch point came out of the current implementation) and this end
/// has not yet: receivers wait for this end's switch.
pub(super) const SPLIT_WAITING: u8 = 3;

// SAFETY: `slots` is the only field that is not `Sync` by itself. A shared reference to
// `slots[i]` is handed out only to the holder of a ticket of the gate that owns index `i`
// (`tx` for `send_at`, `rx` for `recv_at`). A slot is written only (a) when neither index
// names it (it is empty and nobody can reach it), or (b) after every gate whose index names
// it is closed and drained (no such ticket exists and none can be issued). The indices
// themselves change only under (b). The gates' atomics/mutex order those accesses (see
// gate.rs). The connections are `Send + Sync` (`ChunnelConnection` requires it), and so is
// `L::Data` behind its mutex when it is `Send`.
unsafe impl<L: ChunnelConnection, R: Send + Sync, M: Mechanism> Sync for Core<L, R, M> {}

/// The implementation in a slot, borrowed for as long as a ticket is held (loom tracks the
/// access under `cfg(chunnel_loom)`).
pub(super) struct Current<'a, L, R>(SlotRef<'a, Option<Either<L, R>>>);

impl<L, R> std::ops::Deref for Current<'_, L, R> {
    type Target = Either<L, R>;

    #[inline]
    fn deref(&self) -> &Either<L, R> {
        self.0.as_ref().expect("an index names a filled slot")
    }
}

/// Proof of admission through a gate; leaving it (drop) lets a switch proceed.
pub(super) struct Ticket<'a, L: ChunnelConnection, R, M: Mechanism> {
    pub(super) core: &'a Core<L, R, M>,
    pub(super) gate: &'a M::Gate,
    pub(super) t: usize,
}

impl<L: ChunnelConnection, R, M: Mechanism> Drop for Ticket<'_, L, R, M> {
    fn drop(&mut self) {
        if M::exit(self.gate, self.t) {
            self.core.wake_drain();
        }
    }
}

fn side_of(v: u8) -> Side {
    if v == 0 { Side::Left } else { Side::Right }
}

fn side_u8(s: Side) -> u8 {
    match s {
        Side::Left => 0,
        Side::Right => 1,
    }
}

impl<L: ChunnelConnection, R, M: Mechanism> Core<L, R, M> {
    pub(super) fn new(conn: Either<L, R>, builder: Box<dyn Build<L, R>>) -> Self {
        Core {
            tx: M::Gate::default(),
            rx: M::Gate::default(),
            side: AtomicU8::new(side_u8(conn.side())),
            slots: [Slot::new(Some(conn)), Slot::new(None)],
            send_at: AtomicU8::new(0),
            recv_at: AtomicU8::new(0),
            split: AtomicU8::new(SPLIT_NONE),
            event: Event::default(),
            drain: Mutex::new(None),
            carry: Mutex::new(VecDeque::new()),
            busy: AtomicBool::new(false),
            switches: AtomicU64::new(0),
            builder,
        }
    }

    pub(super) fn side(&self) -> Side {
        side_of(self.side.load(Ordering::Acquire))
    }

    fn slot_ref(&self, i: u8) -> Current<'_, L, R> {
        // SAFETY: callers hold a ticket of the gate whose index is `i` (see `Sync`).
        Current(unsafe { self.slots[usize::from(i & 1)].get() })
    }

    /// The implementation that sends, for as long as `ticket` (a `tx` ticket) is held.
    pub(super) fn sender<'a>(&'a self, ticket: &'a Ticket<'_, L, R, M>) -> Current<'a, L, R> {
        debug_assert!(std::ptr::eq(ticket.gate, &self.tx));
        self.slot_ref(self.send_at.load(Ordering::Acquire))
    }

    /// The implementation that receives, for as long as `ticket` (an `rx` ticket) is held.
    pub(super) fn receiver<'a>(&'a self, ticket: &'a Ticket<'_, L, R, M>) -> Current<'a, L, R> {
        debug_assert!(std::ptr::eq(ticket.gate, &self.rx));
        self.slot_ref(self.recv_at.load(Ordering::Acquire))
    }

    /// Admission through `gate` (`tx` or `rx`): immediate on the fast path; during a
    /// switch, waits for its end.
    pub(super) async fn enter<'a>(&'a self, gate: &'a M::Gate) -> (Ticket<'a, L, R, M>, bool) {
        loop {
            match M::enter(gate) {
                Ok((t, carry)) => {
                    return (
                        Ticket {
                            core: self,
                            gate,
                            t,
                        },
                        carry,
                    );
                }
                Err(wake) => {
                    if wake {
                        self.wake_drain();
                    }
                    self.wait_until(|| !M::is_switching(gate)).await;
                }
            }
        }
    }

    /// Waits (on `event`) until `ready` holds.
    pub(super) async fn wait_until(&self, ready: impl Fn() -> bool) {
        if ready() {
            return;
        }
        let mut waiter = self.event.waiter();
        poll_fn(|cx| {
            waiter.register(cx.waker());
            if ready() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }

    fn wake_drain(&self) {
        if let Some(w) = lock(&self.drain).take() {
            w.wake();
        }
    }

    pub(super) fn take_carry(&self, slots: &mut [Option<L::Data>]) -> usize {
        let mut q = lock(&self.carry);
        let n = q.len().min(slots.len());
        for (s, m) in slots.iter_mut().zip(q.drain(..n)) {
            *s = Some(m);
        }
        if q.is_empty() {
            M::clear_carry(&self.rx);
        }
        n
    }

    /// Appends to the carry-over queue; true if it is not empty.
    fn add_carry(&self, msgs: impl IntoIterator<Item = L::Data>) -> bool {
        let mut q = lock(&self.carry);
        q.extend(msgs);
        !q.is_empty()
    }

    /// Takes the connection for a switch (one at a time); returns the guard that frees it
    /// and reopens whatever gates it closed.
    async fn take_busy(&self) -> SwitchGuard<'_, L, R, M> {
        loop {
            if self
                .busy
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                break;
            }
            self.wait_until(|| !self.busy.load(Ordering::Acquire)).await;
        }
        SwitchGuard {
            core: self,
            tx_closed: false,
            rx_closed: false,
        }
    }

    /// Closes `gate`, wakes the calls waiting in it, and waits until no call holds a ticket.
    async fn close_one(&self, gate: &M::Gate) {
        M::close(gate);
        self.event.notify_all();
        poll_fn(|cx| {
            *lock(&self.drain) = Some(cx.waker().clone());
            if M::drained(gate) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        lock(&self.drain).take();
    }
}

impl<L, R, M> Core<L, R, M>
where
    L: Handover,
    R: Handover<Data = L::Data>,
    M: Mechanism,
{
    pub(super) async fn switch_to(&self, to: Side) -> Result<bool, Error> {
        if self.side() == to {
            return Ok(false);
        }
        let new = self.build(to).await?;
        Ok(self.commit(new).await)
    }

    pub(super) async fn build(&self, to: Side) -> Result<Either<L, R>, Error> {
        self.builder
            .build(to)
            .await
            .map_err(|e| Error::SwitchFailed {
                to,
                failed: 1,
                of: 1,
                source: Box::new(e),
            })
    }

    /// Installs `new` (steps 1-4 of the module docs). Returns false if the connection already
    /// ran on `new`'s branch (then `new` is dropped). Cancel safe: dropped before the switch
    /// point, it reopens the gates and nothing changes.
    pub(super) async fn commit(&self, new: Either<L, R>) -> bool {
        let mut guard = self.take_busy().await;
        // A multilateral switch in progress finishes first.
        while self.split.load(Ordering::Acquire) != SPLIT_NONE {
            drop(guard);
            self.wait_until(|| self.split.load(Ordering::Acquire) == SPLIT_NONE)
                .await;
            guard = self.take_busy().await;
        }
        if self.side() == new.side() {
            return false;
        }
        // 1-2. Sends leave first (receivers keep reading meanwhile), then receivers are woken
        // out of the old implementation: the barrier.
        guard.tx_closed = true;
        self.close_one(&self.tx).await;
        guard.rx_closed = true;
        self.close_one(&self.rx).await;
        // The switch point. 3. State transfer, 4. install.
        let i = usize::from(self.send_at.load(Ordering::Acquire) & 1);
        // SAFETY: both gates are closed and drained and both indices name slot `i` (no
        // multilateral switch is in progress), so nothing else refers to it.
        let (carry, old) = {
            let mut slot = unsafe { self.slots[i].get_mut() };
            let mut handoff = Handoff::new();
            if let Some(old) = slot.as_ref() {
                old.export(&mut handoff);
            }
            new.import(&mut handoff);
            let carry = self.add_carry(handoff.buffered.drain(..));
            self.side.store(side_u8(new.side()), Ordering::Release);
            (carry, slot.replace(new))
        };
        self.switches.fetch_add(1, Ordering::Relaxed);
        guard.reopen(carry);
        drop(guard);
        drop(old);
        true
    }

    /// A multilateral switch of this end to `new`: sends switch now — `marker` runs at the
    /// switch point, after the last send of the old implementation and before the first of
    /// the new one (it sends the protocol's marker) — while receivers go on reading the old
    /// implementation until the peer's switch point comes out of it
    /// ([`Error::EndOfEpoch`]), unless it already has. Receivers are not stopped while the
    /// marker is sent (it may wait for the peer to read, and the peer for this end).
    pub(super) async fn switch_split<F, Fut>(
        &self,
        new: Either<L, R>,
        marker: F,
    ) -> Result<(), Error>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), Error>>,
    {
        let mut guard = self.take_busy().await;
        if self.split.load(Ordering::Acquire) == SPLIT_RETIRED {
            return Err(Error::BadPick {
                what: "a multilateral switch is already half done on this connection",
            });
        }
        guard.tx_closed = true;
        self.close_one(&self.tx).await;
        // The switch point: this end's side changes here, before the marker tells the peer
        // (so a peer that has read the marker, and any answer it sends after, never finds
        // this end on the old side). If the marker cannot be sent (or the switch is
        // cancelled while sending it), the side goes back and nothing changes.
        let old_side = self.side.swap(side_u8(new.side()), Ordering::AcqRel);
        // A local flag (std's even under loom: only this task reads it).
        let marked = std::sync::atomic::AtomicBool::new(false);
        let _restore = Undo(|| {
            if !marked.load(Ordering::Relaxed) {
                self.side.store(old_side, Ordering::Release);
            }
        });
        marker().await?;
        marked.store(true, Ordering::Relaxed);
        let old_at = self.send_at.load(Ordering::Acquire) & 1;
        let new_at = old_at ^ 1;
        {
            // SAFETY: no index names `new_at` (it is empty, see `slots`): nobody reaches it.
            let mut free = unsafe { self.slots[usize::from(new_at)].get_mut() };
            // SAFETY: `tx` is drained, and receivers only read `slot_ref(recv_at)` through
            // shared references, as this does; `export` takes `&self`.
            let old = unsafe { self.slots[usize::from(old_at)].get() };
            let mut handoff = Handoff::new();
            if let Some(old) = old.as_ref() {
                old.export(&mut handoff);
            }
            new.import(&mut handoff);
            *free = Some(new);
            let carry = self.add_carry(handoff.buffered.drain(..));
            if carry {
                M::set_carry(&self.rx);
            }
        }
        self.send_at.store(new_at, Ordering::Release);
        self.switches.fetch_add(1, Ordering::Relaxed);
        if self.split.load(Ordering::Acquire) == SPLIT_WAITING {
            // The peer's switch point already came out of the old implementation: receivers
            // wait for this; move them to the new one now.
            self.retire_locked(&mut guard, old_at, new_at).await;
        } else {
            self.split.store(SPLIT_RETIRED, Ordering::Release);
        }
        let carry = !lock(&self.carry).is_empty();
        guard.reopen(carry);
        Ok(())
    }

    /// Moves receivers from slot `old_at` to `new_at` and drops the old implementation
    /// (its undelivered messages join the carry-over queue). Holds the busy guard.
    async fn retire_locked(&self, guard: &mut SwitchGuard<'_, L, R, M>, old_at: u8, new_at: u8) {
        guard.rx_closed = true;
        self.close_one(&self.rx).await;
        // SAFETY: `rx` is drained and `send_at` names `new_at`, so nothing refers to
        // `old_at`.
        let old = unsafe { self.slots[usize::from(old_at)].get_mut().take() };
        let mut handoff = Handoff::new();
        if let Some(old) = &old {
            old.export(&mut handoff);
        }
        self.add_carry(handoff.buffered.drain(..));
        self.recv_at.store(new_at, Ordering::Release);
        self.split.store(SPLIT_NONE, Ordering::Release);
        drop(old);
    }

    /// A receiver read the peer's switch point ([`Error::EndOfEpoch`]) while receivers were
    /// in state `seen`.
    pub(super) async fn end_of_epoch(&self, seen: u8) -> Result<(), Error> {
        match seen {
            // The peer switched first: wait for this end's switch (`switch_split`).
            SPLIT_NONE => {
                let _ = self.split.compare_exchange(
                    SPLIT_NONE,
                    SPLIT_WAITING,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                Ok(())
            }
            // The old implementation has delivered everything the peer sent on the old
            // stack: receivers move to the new one (one receiver does it; the others wait).
            SPLIT_RETIRED => {
                if self
                    .split
                    .compare_exchange(
                        SPLIT_RETIRED,
                        SPLIT_RETIRING,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
                {
                    // Cancelled before it is done (the receive was dropped), the next
                    // receiver starts over.
                    let undo = Undo(|| {
                        let _ = self.split.compare_exchange(
                            SPLIT_RETIRING,
                            SPLIT_RETIRED,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        );
                        self.event.notify_all();
                    });
                    let mut guard = self.take_busy().await;
                    let old_at = self.recv_at.load(Ordering::Acquire) & 1;
                    let new_at = self.send_at.load(Ordering::Acquire) & 1;
                    self.retire_locked(&mut guard, old_at, new_at).await;
                    let carry = !lock(&self.carry).is_empty();
                    guard.reopen(carry);
                    drop(undo);
                }
                Ok(())
            }
            // A second switch point before this end switched: the peer is not following
            // the protocol.
            _ => Err(Error::BadPick {
                what: "the peer switched stacks twice without this end switching",
            }),
        }
    }
}

/// Runs a closure on drop.
struct Undo<F: FnMut()>(F);

impl<F: FnMut()> Drop for Undo<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Releases a switch: reopens the gates it left closed (a cancelled switch), frees the
/// connection for the next switch and wakes everyone waiting.
struct SwitchGuard<'a, L: ChunnelConnection, R, M: Mechanism> {
    core: &'a Core<L, R, M>,
    tx_closed: bool,
    rx_closed: bool,
}

impl<L: ChunnelConnection, R, M: Mechanism> SwitchGuard<'_, L, R, M> {
    fn reopen(&mut self, carry: bool) {
        if self.rx_closed {
            M::open(&self.core.rx, carry);
            self.rx_closed = false;
        } else if carry {
            M::set_carry(&self.core.rx);
        }
        if self.tx_closed {
            M::open(&self.core.tx, false);
            self.tx_closed = false;
        }
    }
}

impl<L: ChunnelConnection, R, M: Mechanism> Drop for SwitchGuard<'_, L, R, M> {
    fn drop(&mut self) {
        let carry = !lock(&self.core.carry).is_empty();
        self.reopen(carry);
        lock(&self.core.drain).take();
        self.core.busy.store(false, Ordering::Release);
        self.core.event.notify_all();
    }
}
