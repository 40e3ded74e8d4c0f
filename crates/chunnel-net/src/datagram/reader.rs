//! Which task reads a listener's socket.
//!
//! The **reader role** is the right to wait on a listener's socket and read it: at most one
//! task holds it at a time, either `accept` or one connection's `recv`, and reads and sorts
//! datagrams for everyone. The other tasks wait on their own queue, or for the reader role to
//! fall vacant. [`Shared::reader`] records who holds it; a [`ReaderGuard`] is a task's claim
//! on it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;

use super::datapath::DatagramIo;
use super::demux::Peer;
use super::listener::Shared;
use super::lock;

/// A receive's wait for the reader role (see [`Shared::want_reader_role`]); it stops waiting
/// on drop. (A receive cancelled after the reader role was offered to it passes the offer on
/// through its [`ReaderGuard`], armed for that.)
pub(super) struct Wanting<'a, S: DatagramIo> {
    shared: &'a Shared<S>,
    peer: &'a Peer<S::Addr>,
}

impl<S: DatagramIo> Drop for Wanting<'_, S> {
    fn drop(&mut self) {
        // The connection's last waiting receive takes it off the count; not if the reader role
        // was offered meanwhile (the offering reader reset the count and took it off).
        let last =
            self.peer
                .wants_reader_role
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if last == Ok(1) {
            self.shared.vacancy_waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Nobody waits on the socket (see [`Shared::reader`]).
pub(super) const NO_READER: u8 = 0;
/// `accept` waits on the socket; a connection about to wait takes the reader role from it.
pub(super) const ACCEPT_READER: u8 = 1;
/// A connection waits on the socket.
pub(super) const CONN_READER: u8 = 2;

/// A task's claim on the reader role (see [`Shared::reader`]): `role` is the role it holds
/// ([`NO_READER`]: none). Dropped (also when the waiting future is cancelled), it gives a
/// held reader role up and wakes the tasks waiting to take it.
///
/// `armed` is set by a connection's `recv` that came back from waiting without the reader role: it
/// may have taken the one wake-up a vacant reader role sends. If it ends without taking the role
/// (its message was queued, or it read one for itself), the role may still be vacant with
/// connections waiting for it: on drop, after giving up the role if it holds it, one of them is
/// woken in its stead. (One struct for both, not two: every receive future holds it.)
pub(super) struct ReaderGuard<'a, S: DatagramIo> {
    shared: &'a Shared<S>,
    role: u8,
    pub(super) armed: bool,
}

impl<'a, S: DatagramIo> ReaderGuard<'a, S> {
    /// Not holding the reader role, not armed.
    pub(super) fn new(shared: &'a Shared<S>) -> Self {
        ReaderGuard {
            shared,
            role: NO_READER,
            armed: false,
        }
    }

    /// Whether the reader role is held.
    pub(super) fn holds(&self) -> bool {
        self.role != NO_READER
    }

    /// Gives up the reader role if held, as a drop does.
    pub(super) fn release(&mut self) {
        let role = std::mem::replace(&mut self.role, NO_READER);
        self.shared.release_reader(role);
    }

    /// The reader role held by a connection goes to `accept` (which then holds it without a
    /// guard until it next waits: see `wait_readable`), and `accept` is woken to notice.
    pub(super) fn hand_to_accept(&mut self) {
        let sh = self.shared;
        let role = std::mem::replace(&mut self.role, NO_READER);
        let handed = role == CONN_READER
            && sh
                .reader
                .compare_exchange(
                    CONN_READER,
                    ACCEPT_READER,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok();
        if !handed {
            sh.release_reader(role); // released as usual
        } else if sh.looping() {
            sh.wake_accept();
        } else {
            // The listener was dropped meanwhile (it closes, then releases the reader role if
            // `accept` holds it; this looks after handing it to `accept`: one of the two sees
            // the other). No `accept` will come for the role: it is released as usual.
            sh.release_reader(ACCEPT_READER);
        }
    }
}

impl<S: DatagramIo> Drop for ReaderGuard<'_, S> {
    fn drop(&mut self) {
        // The reader role first, so the next waiter is woken by that before `armed` is looked at.
        self.release();
        let sh = self.shared;
        if self.armed
            && sh.reader.load(Ordering::SeqCst) == NO_READER
            && sh.vacancy_waiters.load(Ordering::SeqCst) > 0
        {
            sh.offer_reader_role();
        }
    }
}

impl<S: DatagramIo> Shared<S> {
    /// Gives up the reader role held as `role` (nothing for [`NO_READER`]), waking the
    /// tasks waiting to take it.
    pub(super) fn release_reader(&self, role: u8) {
        if role == NO_READER {
            return;
        }
        if role == ACCEPT_READER && self.looping() {
            // A looping `accept` keeps the reader role between calls, also when a call is
            // cancelled: its next call takes it up again (the caller's promise), and the
            // listener's drop gives it up.
            return;
        }
        // `accept` may have lost the reader role to a connection meanwhile: then it is not ours.
        if self
            .reader
            .compare_exchange(role, NO_READER, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            if role == CONN_READER {
                self.wake_accept();
            }
            // Pairs with the increment in `want_reader_role`: a waiter this does not see sees
            // the reader role vacant.
            if self.vacancy_waiters.load(Ordering::SeqCst) > 0 {
                self.offer_reader_role();
            }
        }
    }

    /// Lists `peer`'s connection as waiting for the reader role, then counts it: a reader
    /// that sees the count finds it listed.
    pub(super) fn want_reader_role<'a>(&'a self, peer: &'a Arc<Peer<S::Addr>>) -> Wanting<'a, S> {
        // Under the list's lock, which `offer_reader_role` takes too: the count, the entry and the
        // waiters change together.
        let mut q = lock(&self.vacancy);
        if peer.wants_reader_role.fetch_add(1, Ordering::SeqCst) == 0 {
            // Entries of connections that stopped waiting are skipped when met; a list much
            // longer than the waiters is swept here (of those entries and of this peer's
            // older ones), so it stays bounded.
            let waiting = self.vacancy_waiters.load(Ordering::SeqCst);
            if q.len() > waiting.saturating_mul(2).saturating_add(16) {
                q.retain(|w| {
                    w.upgrade().is_some_and(|p| {
                        !Arc::ptr_eq(&p, peer) && p.wants_reader_role.load(Ordering::SeqCst) > 0
                    })
                });
            }
            q.push_back(Arc::downgrade(peer));
            self.vacancy_waiters.fetch_add(1, Ordering::SeqCst);
        }
        drop(q);
        Wanting { shared: self, peer }
    }

    /// Wakes the connection that has waited longest for the reader role, through its own
    /// wake-up: every receive of it that waits (they look at the reader role again; one takes
    /// it, the others wait again).
    pub(super) fn offer_reader_role(&self) {
        let mut q = lock(&self.vacancy);
        while let Some(w) = q.pop_front() {
            if let Some(p) = w.upgrade()
                && p.wants_reader_role.swap(0, Ordering::SeqCst) > 0
            {
                self.vacancy_waiters.fetch_sub(1, Ordering::SeqCst);
                drop(q);
                p.notify.notify_waiters();
                return;
            }
        }
    }

    /// Whether `accept` is called in a loop (the caller's promise) on a listener not yet
    /// dropped: a reader role held by `accept` is then kept between calls and taken up again.
    pub(super) fn looping(&self) -> bool {
        self.accept_in_loop.load(Ordering::SeqCst) && self.listener_open.load(Ordering::SeqCst)
    }

    /// Records whether the datagram just sorted started a new connection (see
    /// [`Shared::fresh`]); written only on a change.
    pub(super) fn set_fresh(&self, fresh: bool) {
        if self.fresh.load(Ordering::Relaxed) != fresh {
            self.fresh.store(fresh, Ordering::Relaxed);
        }
    }

    /// Whether a connection about to wait may take the reader role from `accept`: not
    /// while the datagrams coming in start new connections (see [`Shared::fresh`]).
    pub(super) fn conn_may_take_from_accept(&self) -> bool {
        !self.fresh.load(Ordering::Relaxed)
    }

    /// Whether a connection about to wait would get the reader role now (it is vacant, or
    /// `accept` holds it and may be asked to give it up).
    pub(super) fn reader_role_open_to_conn(&self) -> bool {
        match self.reader.load(Ordering::SeqCst) {
            NO_READER => true,
            ACCEPT_READER => self.conn_may_take_from_accept(),
            _ => false,
        }
    }

    /// Wakes `accept` if it waits for the reader role to change hands.
    fn wake_accept(&self) {
        let w = lock(&self.accept_waker).take();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Whether the reader role is `held`; if so, registers `cx` to be woken when that
    /// changes (see [`Shared::accept_waker`]).
    fn accept_sees_held(&self, held: u8, cx: &mut std::task::Context<'_>) -> bool {
        if self.reader.load(Ordering::SeqCst) != held {
            return false;
        }
        {
            let mut w = lock(&self.accept_waker);
            match w.as_ref() {
                Some(old) if old.will_wake(cx.waker()) => {}
                _ => *w = Some(cx.waker().clone()),
            }
        }
        // Looked at again after registering: a change before the registration is seen here,
        // one after it takes the waker.
        self.reader.load(Ordering::SeqCst) == held
    }

    /// Waits until the socket may be readable — if no other task is already waiting for
    /// that — or until `other` completes, whichever comes first. Returns `other`'s output if
    /// it completed. `role` is [`ACCEPT_READER`] or [`CONN_READER`]: a connection takes the
    /// reader role from `accept`, which then stops waiting on the socket (`Ok(None)`) and
    /// waits for the role to fall vacant instead. The role, once taken, is kept in `held`,
    /// across calls, until the caller drops it.
    ///
    /// A function returning an `async move` block (an `async fn` would keep its arguments
    /// twice), with its waits as plain `poll_fn`s: every receive future holds this one.
    // Not an `async fn`: it would keep its arguments twice in the future.
    #[allow(clippy::manual_async_fn)]
    pub(super) fn wait_readable<'s, 'h, T, F>(
        &'s self,
        role: u8,
        held: &'h mut ReaderGuard<'s, S>,
        me: Option<&'h Arc<Peer<S::Addr>>>,
        mut other: F,
    ) -> impl Future<Output = io::Result<Option<T>>> + use<'s, 'h, T, F, S>
    where
        F: Future<Output = T> + Unpin,
    {
        async move {
            // A reader role kept from an earlier wait of the same caller is still ours unless a
            // connection took it from `accept`; then the stale guard is let go (its release finds
            // the role not ours and does nothing).
            if held.holds() && self.reader.load(Ordering::SeqCst) != role {
                held.release();
            }
            let taken = if held.holds() {
                Ok(role)
            } else {
                match self.reader.load(Ordering::SeqCst) {
                    NO_READER => self.reader.compare_exchange(
                        NO_READER,
                        role,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    ),
                    // Kept by an earlier `accept` of the loop, or handed to it by a connection.
                    ACCEPT_READER if role == ACCEPT_READER => Ok(ACCEPT_READER),
                    ACCEPT_READER if role == CONN_READER && self.conn_may_take_from_accept() => {
                        let r = self.reader.compare_exchange(
                            ACCEPT_READER,
                            CONN_READER,
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        );
                        if r.is_ok() {
                            // `accept` stops waiting on the socket.
                            self.wake_accept();
                        }
                        r
                    }
                    other_role => Err(other_role),
                }
            };
            if taken.is_ok() {
                // Kept by the caller until it stops reading (returns, or is cancelled): a reader
                // that loops (it read datagrams for other connections, or nothing) keeps the
                // reader role instead of handing it to a waiting connection and taking it back.
                held.role = role;
                if role == ACCEPT_READER {
                    std::future::poll_fn(|cx| {
                        if let Poll::Ready(t) = Pin::new(&mut other).poll(cx) {
                            return Poll::Ready(Ok(Some(t)));
                        }
                        if !self.accept_sees_held(ACCEPT_READER, cx) {
                            return Poll::Ready(Ok(None)); // taken by a connection
                        }
                        self.poll_socket(ACCEPT_READER, cx).map(|r| r.map(|_| None))
                    })
                    .await
                } else {
                    std::future::poll_fn(|cx| {
                        // Readiness first, as the reason to be here.
                        if let Poll::Ready(r) = self.poll_socket(CONN_READER, cx) {
                            return Poll::Ready(r.map(|_| None));
                        }
                        Pin::new(&mut other).poll(cx).map(|t| Ok(Some(t)))
                    })
                    .await
                }
            } else if role == ACCEPT_READER {
                // A connection holds the reader role (and reads for everyone): `accept` waits for
                // it to fall vacant. That happens once per request a connection serves, and the
                // connection usually takes the role back before this task runs, so this path is
                // kept to a look and a registration.
                std::future::poll_fn(|cx| {
                    if let Poll::Ready(t) = Pin::new(&mut other).poll(cx) {
                        return Poll::Ready(Ok(Some(t)));
                    }
                    if self.accept_sees_held(CONN_READER, cx) {
                        Poll::Pending
                    } else {
                        Poll::Ready(Ok(None))
                    }
                })
                .await
            } else if taken == Err(ACCEPT_READER) && self.looping() {
                // A looping `accept` reads for this connection (new peers are coming in): only this
                // connection's own wake-up is waited for. `accept` keeps the reader role between
                // calls (a cancelled call too) until the listener is dropped, which closes first,
                // then wakes every connection (this one registered its wake-up before looking).
                Ok(Some(other.await))
            } else {
                // A connection waits for the reader role to fall vacant. Listed and counted before
                // the role is looked at again: a reader leaving after this offers it the role
                // through `other` (its own wake-up, registered by the caller); one that left
                // before it is seen here. (`accept` never comes here: it has no `me`.)
                let Some(me) = me else {
                    return Ok(Some(other.await));
                };
                let _wanting = self.want_reader_role(me);
                if self.reader_role_open_to_conn() {
                    return Ok(None);
                }
                // Armed while waiting: a receive cancelled after the reader role was offered to
                // it passes the offer on (its guard's drop) instead of losing it.
                held.armed = true;
                Ok(Some(other.await))
            }
        }
    }

    /// The reader's wait on the socket: ready (or `role` does not hold the reader role any
    /// more: the caller looks again), or pending with `cx` registered to be woken when it may
    /// be readable.
    pub(super) fn poll_socket(
        &self,
        role: u8,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<io::Result<()>> {
        let _registering = lock(&self.read_register);
        if self.reader.load(Ordering::SeqCst) != role {
            return Poll::Ready(Ok(()));
        }
        self.sock.poll_recv_ready(cx)
    }
}
