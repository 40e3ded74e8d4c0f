//! The server's driver: [`listen`] and [`listen_with`] run [`crate::proto::Server`] over a
//! base listener, one task per connection until its hello is decided, and hand out
//! [`Negotiated`] connections.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Listener, Offers, PeerHandoff, SendHeader};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::Error;
use crate::proto::{Decision, Server};
use crate::tagged::{Tagged, WeakTagged};
use crate::wire::Tag;

use super::{
    Config, HOLD_GRAIN, InfoCache, Negotiated, Transcript, apply_known, coarse_by, control,
    poll_once,
};

/// A listener whose connections are negotiated: each accepted base connection negotiates
/// independently and concurrently (a slow or silent client delays no one else).
///
/// `accept` yields either a negotiated connection or the error of one client (incompatible
/// offers, a malformed hello, no hello in time); after a per-client error the listener keeps
/// working. Only `Error::Chunnel(Closed)` (the base listener ended) is final.
#[derive(Debug)]
pub struct NegotiatedListener<C> {
    rx: mpsc::Receiver<Result<Negotiated<C>, Error>>,
    serving: Serving,
}

/// The accept loop of [`listen_with`] (and of [`listen`]'s listener): it runs until this is
/// dropped, or until the base listener ends.
#[derive(Debug)]
pub struct Serving {
    task: JoinHandle<()>,
    release: JoinHandle<()>,
    server: Arc<Server>,
}

impl Serving {
    /// Hellos refused so far because they were larger than the base listener takes in one
    /// message (each also handed to the callback as [`Error::HelloTooLarge`]).
    pub fn hellos_too_large(&self) -> u64 {
        self.server.hellos_too_large()
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.task.abort();
        self.release.abort();
    }
}

/// Accepts held back for a first reply (see [`Config::accept_hold`]), oldest first; a task
/// per listener sends those still held when their time is up. One timer serves them all.
struct Held<C> {
    queue: Mutex<std::collections::VecDeque<(Instant, WeakTagged<C>)>>,
    added: tokio::sync::Notify,
    hold: Duration,
}

impl<C: SendHeader> Held<C> {
    fn push(&self, t: &Tagged<C>) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.push_back((Instant::now() + self.hold, t.downgrade()));
        if q.len() == 1 {
            // The task may be waiting for an entry; `notify_one` keeps a permit otherwise.
            self.added.notify_one();
        }
    }

    async fn run(&self) {
        loop {
            let next = {
                let q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                q.front().map(|(due, _)| *due)
            };
            let Some(due) = next else {
                self.added.notified().await;
                continue;
            };
            // One wake per grain, for every accept due in it (not one per connection).
            let wake = coarse_by(due, HOLD_GRAIN);
            tokio::time::sleep_until(wake).await;
            let now = Instant::now().max(wake);
            loop {
                // The due entries whose accept already left with a reply (most of them) are
                // dropped under one lock; the first still held is released outside it.
                let entry = {
                    let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                    loop {
                        match q.front() {
                            Some((due, _)) if *due <= now => {
                                if let Some((_, t)) = q.pop_front()
                                    && t.may_hold()
                                {
                                    break Some(t);
                                }
                            }
                            _ => break None,
                        }
                    }
                };
                match entry {
                    Some(t) => t.release_accept().await,
                    None => break,
                }
            }
        }
    }
}

impl<C> NegotiatedListener<C> {
    /// Hellos refused so far because they were larger than the base listener takes in one
    /// message (each also reported by [`NegotiatedListener::accept`] as
    /// [`Error::HelloTooLarge`]).
    pub fn hellos_too_large(&self) -> u64 {
        self.serving.hellos_too_large()
    }

    /// The next negotiated connection, or one client's failure.
    pub async fn accept(&mut self) -> Result<Negotiated<C>, Error> {
        match self.rx.recv().await {
            Some(r) => r,
            None => Err(Error::Chunnel(chunnel::Error::Closed)),
        }
    }
}

/// Serves `stack` on `listener`: every accepted base connection negotiates its own copy of
/// the stack. Must be called within a tokio runtime: it spawns the accept loop, which
/// completes a handshake itself when the hello is already queued and gives any other
/// handshake a task of its own. Results wait for [`NegotiatedListener::accept`] in a queue
/// of `cfg.backlog` (a result that finds it full waits in a task of its own: the loop never
/// stops accepting).
pub fn listen<S, L>(stack: S, listener: L, cfg: Config) -> NegotiatedListener<S::Connection>
where
    L: Listener + 'static,
    L::Connection: SendHeader + PeerHandoff + 'static,
    S: Chunnel<Tagged<L::Connection>> + Offers + Clone + Send + Sync + 'static,
    S::Connection: 'static,
{
    let (tx, rx) = mpsc::channel(cfg.backlog.max(1));
    let serving = listen_with(stack, listener, cfg, move |r| {
        if let Err(mpsc::error::TrySendError::Full(r)) = tx.try_send(r) {
            let tx = tx.clone();
            tokio::spawn(async move {
                let _ = tx.send(r).await;
            });
        }
    });
    NegotiatedListener { rx, serving }
}

/// As [`listen`], but every result (a negotiated connection, or one client's error; last,
/// `Error::Chunnel(Closed)` if the base listener ends) goes to `on`, called by the accept loop
/// itself (or, for a handshake that had to wait for its hello, by that handshake's task): no
/// queue, and no task of the application's to wake per connection. `on` must not wait; to
/// serve a connection, it spawns.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use chunnel::{ConnectionExt, Identity, Noop, select};
/// use chunnel_negotiate::{Config, listen_with};
/// use chunnel_net::udp;
///
/// let l = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
/// # let addr = l.local_addr()?;
/// let _serving = listen_with(select(Noop, Identity), l, Config::default(), |r| {
///     if let Ok(conn) = r {
///         tokio::spawn(async move {
///             while let Ok(m) = conn.recv_one().await {
///                 if conn.send_one(m).await.is_err() {
///                     break;
///                 }
///             }
///         });
///     }
/// });
/// // ... served until `_serving` is dropped.
/// # use chunnel::Chunnel;
/// # let base = udp::Connect::new(addr).connect_wrap(()).await?;
/// # let conn = chunnel_negotiate::Client::new(Config::default())
/// #     .connect(&addr.to_string(), select(Noop, Identity), base)
/// #     .await?;
/// # conn.send_one("hi".into()).await?;
/// # assert_eq!(conn.recv_one().await?, "hi");
/// # Ok(()) }
/// ```
pub fn listen_with<S, L, F>(stack: S, mut listener: L, cfg: Config, on: F) -> Serving
where
    L: Listener + 'static,
    L::Connection: SendHeader + PeerHandoff + 'static,
    S: Chunnel<Tagged<L::Connection>> + Offers + Clone + Send + Sync + 'static,
    S::Connection: 'static,
    F: Fn(Result<Negotiated<S::Connection>, Error>) + Send + Sync + 'static,
{
    // The task below does nothing but accept and hand on (a handshake that must wait gets a
    // task of its own).
    listener.accepting_in_loop();
    // A hello with another connection id from a known address is a new client (one that
    // restarted on the same local port): handed to `accept` even if the old connection is
    // not read.
    listener.recognise_sessions(crate::wire::hello_session);
    let server = Arc::new(Server::new(stack.offer_tree()));
    let held = Arc::new(Held {
        queue: Mutex::new(std::collections::VecDeque::new()),
        added: tokio::sync::Notify::new(),
        hold: cfg.accept_hold,
    });
    let release = tokio::spawn({
        let held = Arc::clone(&held);
        async move { held.run().await }
    });
    let on = Arc::new(on);
    let infos = Arc::new(InfoCache::default());
    let counted = Arc::clone(&server);
    let task = tokio::spawn(async move {
        // The box of a handshake that completed in its first poll, kept for the next one (a
        // handshake's future is most of a kilobyte: not allocated and freed per connection).
        let mut spare = None;
        loop {
            let base = match listener.accept().await {
                Ok(b) => b,
                Err(e) if e.is_closed() => {
                    on(Err(Error::Chunnel(e)));
                    return;
                }
                Err(e) => {
                    // Handed on at once: the loop keeps accepting, as it promised the listener.
                    on(Err(Error::Chunnel(e)));
                    continue;
                }
            };
            // Written straight from `serve_one` (not an `async move` around it, which would
            // hold its arguments twice) into the spare box, or a new one.
            let one = crate::obs::negotiation(
                crate::obs::Side::Server,
                "hello",
                super::zero_rtt_of::<S::Connection>,
                serve_one(
                    base,
                    Arc::clone(&server),
                    stack.clone(),
                    cfg,
                    Arc::clone(&held),
                    Arc::clone(&infos),
                ),
            );
            let mut handshake = boxed_in(&mut spare, one);
            // The hello usually arrived with the datagram that made this connection: then the
            // handshake completes in this first poll and needs no task of its own. Otherwise it
            // continues in its own task, so a slow client delays nobody.
            let Some(first) = handshake.as_mut().as_pin_mut() else {
                continue; // just set
            };
            match poll_once(first).await {
                Poll::Ready(r) => {
                    handshake.as_mut().set(None);
                    spare = Some(handshake);
                    on(r);
                }
                Poll::Pending => {
                    let on = Arc::clone(&on);
                    tokio::spawn(async move {
                        if let Some(rest) = handshake.as_mut().as_pin_mut() {
                            on(rest.await);
                        }
                    });
                }
            }
        }
    });
    Serving {
        task,
        release,
        server: counted,
    }
}

/// `fut` in `spare`'s box (taken) if there is one, else in a new box.
fn boxed_in<F>(spare: &mut Option<Pin<Box<Option<F>>>>, fut: F) -> Pin<Box<Option<F>>> {
    match spare.take() {
        Some(mut b) => {
            b.as_mut().set(Some(fut));
            b
        }
        None => Box::pin(Some(fut)),
    }
}

async fn serve_one<C, S>(
    base: C,
    server: Arc<Server>,
    mut stack: S,
    cfg: Config,
    held: Arc<Held<C>>,
    infos: Arc<InfoCache>,
) -> Result<Negotiated<S::Connection>, Error>
where
    C: SendHeader + PeerHandoff + 'static,
    S: Chunnel<Tagged<C>> + Offers,
{
    // The hello usually came with the datagram that made this connection. Waiting for it
    // is boxed: a receive (and its timer) inline made this future ~2 KiB, which the
    // listener boxes and writes for every connection.
    let hello = match base.take_queued() {
        Some(m) if is_hello(&m) => m,
        // Stale data or answers from an earlier connection of this address are dropped.
        _ => {
            // A hello too large for the base connection started it (only its first bytes
            // were kept): refused at once, saying the limit (docs/wire.md §9.4).
            if let Some(o) = base.take_oversized()
                && let Some(Decision::Reject { reject, response }) =
                    server.handle_oversized(&o.prefix, o.len, o.limit)
            {
                send_reject(&base, &reject, response, cfg.timing.max_message).await;
                return Err(Error::HelloTooLarge {
                    len: o.len,
                    limit: o.limit,
                    hellos_sent: 0,
                });
            }
            Box::pin(recv_hello(&base, cfg.hello_timeout)).await?
        }
    };
    let decision = match server.answer_from_memory(&hello) {
        Some(d) => d,
        None => Box::pin(decide_apart(server, hello.clone())).await?,
    };
    match decision {
        Decision::Accept {
            accept,
            early,
            response,
            coalesce,
            ..
        } => {
            let mut transcript = Transcript::default();
            // An accepted 0-RTT answer waits (briefly) for the reply to the early data.
            let hold = match coalesce {
                Some(h) if !early.is_empty() && !cfg.accept_hold.is_zero() => Some(h),
                _ => {
                    // Boxed, as the receive above (one allocation per 1-RTT connection).
                    Box::pin(base.send_with_header(&[], [response.clone()])).await?;
                    transcript = Transcript {
                        hello: hello.clone(),
                        accept: response.clone(),
                    };
                    None
                }
            };
            apply_known(&mut stack, &accept.server_pick)?;
            let max = cfg.timing.max_message;
            let tagged = match hold {
                Some(h) => {
                    let t = Tagged::server_holding(base, accept.conn_id, h, max);
                    held.push(&t);
                    t
                }
                None => Tagged::server(base, accept.conn_id, response, max),
            };
            if early.is_empty() {
                tagged.await_first_data();
            } else {
                tagged.push_pending(early);
            }
            let control = control(&tagged);
            let conn = stack.connect_wrap(tagged).await?;
            Ok(Negotiated::new(conn, infos.get(accept, 0), control).with_transcript(transcript))
        }
        Decision::Reject { reject, response } => {
            // Best effort: the client retransmits if this is lost and gets the same answer.
            send_reject(&base, &reject, response, cfg.timing.max_message).await;
            Err(match reject.reason {
                crate::wire::RejectReason::Incompatible => Error::Incompatible {
                    found_by: chunnel::End::Server,
                    mismatches: reject.mismatches,
                },
                crate::wire::RejectReason::Version => Error::Version {
                    ours: crate::wire::VERSION,
                    theirs: hello.get(1).copied().unwrap_or(0),
                },
                crate::wire::RejectReason::Malformed => Error::BadHello {
                    message: reject.message,
                },
                crate::wire::RejectReason::TooLarge => Error::HelloTooLarge {
                    len: hello.len(),
                    limit: reject.too_large.map_or(0, |t| t.limit as usize),
                    hellos_sent: 0,
                },
            })
        }
    }
}

/// Hellos that need a search (no answer remembered for their offer list:
/// [`Server::answer_from_memory`]) are decided on tokio's blocking pool, at most this many at
/// a time per process (more wait their turn): a search may take milliseconds (up to its
/// [`chunnel::offer_tree::Limits`]), and the accept loop goes on serving everyone else
/// meanwhile. Remembered answers (nearly every hello of a server's usual clients) are
/// given where the hello is received.
pub fn concurrent_searches() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

/// Decides on a hello away from the accept loop (see [`concurrent_searches`]).
async fn decide_apart(server: Arc<Server>, hello: Bytes) -> Result<Decision, Error> {
    static HEAVY: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    let heavy = HEAVY.get_or_init(|| tokio::sync::Semaphore::new(concurrent_searches()));
    // Never closed.
    let _permit = heavy.acquire().await.ok();
    tokio::task::spawn_blocking(move || server.handle_hello_bytes(&hello))
        .await
        .map_err(|e| Error::BadHello {
            message: format!("the decision on this hello did not complete: {e}"),
        })
}

/// Sends a REJECT (best effort), cut to fit (docs/wire.md §7.4.1): to `max` bytes, and if
/// the base connection still refuses it as too large, to the limit it names.
async fn send_reject<C: SendHeader>(
    base: &C,
    reject: &crate::wire::Reject,
    response: Bytes,
    max: usize,
) {
    let response = if response.len() > max {
        reject.encode_within(max)
    } else {
        response
    };
    if let Err(chunnel::Error::MessageTooLarge { max, .. }) =
        Box::pin(base.send_with_header(&[], [response])).await
    {
        let _ = Box::pin(base.send_with_header(&[], [reject.encode_within(max)])).await;
    }
}

fn is_hello(m: &[u8]) -> bool {
    m.first() == Some(&(Tag::Hello as u8))
}

/// How long a server waits for a new connection's hello while its base listener is crowded
/// (see [`Config::hello_timeout`]).
pub const CROWDED_HELLO_WAIT: Duration = Duration::from_secs(1);

/// Waits up to `wait` for a hello on `base`; other messages are stale (data or answers of an
/// earlier connection of the same address) and dropped. While `base`'s listener is crowded,
/// looks every [`CROWDED_HELLO_WAIT`] and gives up once that long has passed.
async fn recv_hello<C: ChunnelConnection<Data = Bytes> + PeerHandoff>(
    base: &C,
    wait: Duration,
) -> Result<Bytes, Error> {
    let recv = async {
        let mut slot = [None];
        loop {
            if base.recv(&mut slot).await? == 0 {
                continue;
            }
            match slot[0].take() {
                Some(m) if is_hello(&m) => return Ok(m),
                _ => continue,
            }
        }
    };
    tokio::pin!(recv);
    // Arm the timer only if the hello is not already there.
    match poll_once(recv.as_mut()).await {
        Poll::Ready(r) => r,
        Poll::Pending => {
            // Nothing valid from this peer yet: a full listener may end it for a new peer.
            base.mark_silent(true);
            let start = tokio::time::Instant::now();
            let end = start + wait;
            loop {
                let step = end.min(tokio::time::Instant::now() + CROWDED_HELLO_WAIT);
                match tokio::time::timeout_at(step, recv.as_mut()).await {
                    Ok(r) => {
                        base.mark_silent(false);
                        break r;
                    }
                    Err(_) if step >= end || base.crowded() => {
                        return Err(Error::NoHello(start.elapsed()));
                    }
                    Err(_) => {}
                }
            }
        }
    }
    .map_err(Error::Chunnel)
}
