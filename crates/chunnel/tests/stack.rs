//! Core behaviour of stacks, selects, negotiation metadata and boxing, over an in-memory echo
//! datapath defined here.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use chunnel::{
    BoxConnection, Capability, Chunnel, ChunnelConnection, ChunnelExt, ConnectionExt, Either,
    Error, Identity, Negotiate, Noop, NoopConnection, Offers, Pick, Side, select, stack,
};
use tokio::sync::Notify;

/// A shared record of what the Chunnels of a test did, in order.
type Log = Arc<Mutex<Vec<String>>>;

fn entries(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

/// A base datapath: every message sent is queued and received back on the same connection.
#[derive(Clone, Default)]
struct Mem {
    log: Log,
}

impl Mem {
    fn new(log: &Log) -> Self {
        Mem { log: log.clone() }
    }
}

impl Negotiate for Mem {
    fn id(&self) -> &'static str {
        "test/mem/1"
    }
}

impl Chunnel<()> for Mem {
    type Connection = MemConn;

    async fn connect_wrap(&mut self, _: ()) -> Result<MemConn, Error> {
        self.log.lock().unwrap().push("wrap mem".into());
        Ok(MemConn::default())
    }
}

#[derive(Debug, Default)]
struct MemConn {
    queue: Mutex<VecDeque<u32>>,
    ready: Notify,
}

impl ChunnelConnection for MemConn {
    type Data = u32;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = u32> + Send,
        B::IntoIter: Send,
    {
        self.queue.lock().unwrap().extend(burst);
        self.ready.notify_one();
        Ok(())
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<u32>]) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        loop {
            {
                let mut q = self.queue.lock().unwrap();
                if !q.is_empty() {
                    let n = q.len().min(slots.len());
                    for (s, m) in slots.iter_mut().zip(q.drain(..n)) {
                        *s = Some(m);
                    }
                    return Ok(n);
                }
            }
            self.ready.notified().await;
        }
    }
}

/// A pass-through layer that logs when it is wrapped, with a configurable
/// availability.
#[derive(Clone)]
struct Leaf {
    id: &'static str,
    log: Log,
    available: bool,
}

fn leaf(id: &'static str, log: &Log) -> Leaf {
    Leaf {
        id,
        log: log.clone(),
        available: true,
    }
}

fn unavailable(id: &'static str, log: &Log) -> Leaf {
    Leaf {
        available: false,
        ..leaf(id, log)
    }
}

impl Negotiate for Leaf {
    fn id(&self) -> &'static str {
        self.id
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::exact("leaf", [self.id])]
    }

    fn check_available(&self) -> Result<(), Error> {
        if self.available {
            Ok(())
        } else {
            Err(Error::NotAvailable {
                chunnel: self.id,
                reason: "switched off by the test".into(),
            })
        }
    }
}

impl<C: ChunnelConnection> Chunnel<C> for Leaf {
    type Connection = C;

    async fn connect_wrap(&mut self, inner: C) -> Result<C, Error> {
        self.log.lock().unwrap().push(format!("wrap {}", self.id));
        Ok(inner)
    }
}

/// The ids of every option's Chunnels, top first.
fn option_ids(s: &impl Offers) -> Vec<Vec<String>> {
    s.offers()
        .iter()
        .map(|o| o.chunnels.iter().map(|c| c.id.to_string()).collect())
        .collect()
}

fn option_picks(s: &impl Offers) -> Vec<Vec<u8>> {
    s.offers()
        .iter()
        .map(|o| o.pick.branches().to_vec())
        .collect()
}

async fn round_trip<C: ChunnelConnection<Data = u32>>(conn: &C) {
    conn.send([7, 8, 9]).await.unwrap();
    let mut slots = [None, None, None, None];
    let n = conn.recv(&mut slots).await.unwrap();
    assert_eq!(&slots[..n], &[Some(7), Some(8), Some(9)]);
    assert_eq!(slots[3], None, "slots past n are left alone");
}

// ---- stack! ----------------------------------------------------------------------------------

#[tokio::test]
async fn stack_macro_nests_top_first_and_connects_bottom_up() {
    let log = Log::default();
    let mut s = stack![leaf("top", &log), leaf("mid", &log), Mem::new(&log)];
    // The cons-list puts the first element outermost.
    assert_eq!(s.outer.id, "top");
    assert_eq!(s.inner.outer.id, "mid");

    let conn = s.connect_wrap(()).await.unwrap();
    assert_eq!(entries(&log), ["wrap mem", "wrap mid", "wrap top"]);
    round_trip(&conn).await;
}

#[tokio::test]
async fn stack_of_noops_and_identity_passes_messages_through() {
    let mut s = stack![Noop, Identity, Noop, Mem::default()];
    let conn = s.connect_wrap(()).await.unwrap();
    let _: &NoopConnection<NoopConnection<MemConn>> = &conn;
    round_trip(&conn).await;
    conn.send_one(42).await.unwrap();
    assert_eq!(conn.recv_one().await.unwrap(), 42);
}

// ---- Offers::offers ----------------------------------------------------------------------------

#[test]
fn offers_flatten_two_selects_in_preference_order() {
    let log = Log::default();
    let s = stack![
        Noop,
        select(leaf("a", &log), leaf("b", &log)),
        select(leaf("c", &log), leaf("d", &log)),
    ];
    assert_eq!(
        option_picks(&s),
        [vec![0, 0], vec![0, 1], vec![1, 0], vec![1, 1]]
    );
    assert_eq!(
        option_ids(&s),
        [
            ["chunnel/noop/1", "a", "c"],
            ["chunnel/noop/1", "a", "d"],
            ["chunnel/noop/1", "b", "c"],
            ["chunnel/noop/1", "b", "d"],
        ]
    );
    // Capabilities travel with each Chunnel.
    let first = &s.offers()[0];
    assert!(first.chunnels[0].capabilities.is_empty());
    assert_eq!(
        first.chunnels[1].capabilities,
        [Capability::exact("leaf", ["a"])]
    );
    // Describing the options neither builds nor picks anything.
    assert!(entries(&log).is_empty());
}

#[test]
fn offers_encode_nested_selects_in_pre_order() {
    let log = Log::default();
    let s = stack![
        select(select(leaf("a", &log), leaf("b", &log)), leaf("c", &log)),
        select(leaf("d", &log), leaf("e", &log)),
        Mem::new(&log),
    ];
    assert_eq!(
        option_picks(&s),
        [
            vec![0, 0, 0],
            vec![0, 0, 1],
            vec![0, 1, 0],
            vec![0, 1, 1],
            vec![1, 0],
            vec![1, 1],
        ]
    );
    assert_eq!(
        option_ids(&s),
        [
            ["a", "d", "test/mem/1"],
            ["a", "e", "test/mem/1"],
            ["b", "d", "test/mem/1"],
            ["b", "e", "test/mem/1"],
            ["c", "d", "test/mem/1"],
            ["c", "e", "test/mem/1"],
        ]
    );
}

#[test]
fn select_inside_a_stack_inside_a_select_branch() {
    let log = Log::default();
    let s = select(
        stack![leaf("x", &log), select(leaf("a", &log), leaf("b", &log))],
        leaf("c", &log),
    );
    assert_eq!(option_picks(&s), [vec![0, 0], vec![0, 1], vec![1]]);
    assert_eq!(option_ids(&s), [vec!["x", "a"], vec!["x", "b"], vec!["c"]]);
}

// ---- Offers::apply ---------------------------------------------------------------------------

#[tokio::test]
async fn every_offered_pick_builds_exactly_its_option() {
    let log = Log::default();
    let template = stack![
        select(select(leaf("a", &log), leaf("b", &log)), leaf("c", &log)),
        select(leaf("d", &log), leaf("e", &log)),
        Mem::new(&log),
    ];
    let options = template.offers();
    assert_eq!(options.len(), 6);
    for option in options {
        log.lock().unwrap().clear();
        let mut s = template.clone();
        s.apply(&option.pick).unwrap();
        s.connect_wrap(()).await.unwrap();
        let built: Vec<String> = entries(&log)
            .into_iter()
            .filter_map(|e| e.strip_prefix("wrap ").map(str::to_owned))
            .collect();
        let mut expected: Vec<String> = option
            .chunnels
            .iter()
            .map(|c| c.id.replace("test/mem/1", "mem"))
            .collect();
        expected.reverse(); // built bottom-up
        assert_eq!(built, expected, "pick {:?}", option.pick);
    }
}

#[tokio::test]
async fn apply_fixes_the_branch() {
    let log = Log::default();
    let fresh = || stack![select(leaf("a", &log), leaf("b", &log)), Mem::new(&log)];

    // Without a pick the preferred, available branch is built.
    let conn = fresh().connect_wrap(()).await.unwrap();
    assert!(matches!(conn, Either::Left(_)));
    assert_eq!(entries(&log), ["wrap mem", "wrap a"]);

    log.lock().unwrap().clear();
    let mut s = fresh();
    s.apply(&Pick::from_branches(vec![1])).unwrap();
    assert_eq!(s.outer.choice(), Some(Side::Right));
    assert!(entries(&log).is_empty(), "applying a pick builds nothing");

    let conn = s.connect_wrap(()).await.unwrap();
    assert!(matches!(conn, Either::Right(_)));
    assert_eq!(conn.side(), Side::Right);
    assert_eq!(entries(&log), ["wrap mem", "wrap b"]);
    round_trip(&conn).await;
}

#[tokio::test]
async fn apply_overrides_prefer() {
    let log = Log::default();
    let mut s = stack![
        select(leaf("a", &log), leaf("b", &log)).prefer(Side::Right),
        Mem::new(&log),
    ];
    assert_eq!(s.outer.choice(), Some(Side::Right));
    s.apply(&Pick::from_branches(vec![0])).unwrap();
    assert_eq!(s.outer.choice(), Some(Side::Left));
    let conn = s.connect_wrap(()).await.unwrap();
    assert_eq!(conn.side(), Side::Left);
}

#[test]
fn apply_rejects_picks_that_do_not_fit() {
    let log = Log::default();
    let fresh = || {
        stack![
            select(leaf("a", &log), leaf("b", &log)),
            select(leaf("c", &log), leaf("d", &log)),
            Mem::new(&log),
        ]
    };
    let apply = |branches: Vec<u8>| fresh().apply(&Pick::from_branches(branches));

    assert!(apply(vec![1, 0]).is_ok(), "a fitting pick is accepted");
    for bad in [
        vec![],
        vec![0],
        vec![0, 0, 0],
        vec![2, 0],
        vec![0, 2],
        vec![1, 1, 1],
    ] {
        let err = apply(bad.clone()).unwrap_err();
        assert!(matches!(err, Error::BadPick { .. }), "{bad:?}: {err:?}");
    }
    // A stack without any select takes only the empty pick.
    assert!(Noop.apply(&Pick::default()).is_ok());
    assert!(matches!(
        Noop.apply(&Pick::from_branches(vec![0])),
        Err(Error::BadPick { .. })
    ));
}

// ---- Select availability -----------------------------------------------------------------------

#[tokio::test]
async fn select_falls_back_when_the_left_branch_is_unavailable() {
    let log = Log::default();
    let mut s = stack![
        select(unavailable("a", &log), leaf("b", &log)),
        Mem::new(&log),
    ];
    assert_eq!(s.outer.resolve().unwrap(), Side::Right);
    assert!(s.available().is_ok());

    let conn = s.connect_wrap(()).await.unwrap();
    assert!(matches!(conn, Either::Right(_)));
    assert_eq!(entries(&log), ["wrap mem", "wrap b"]);
    round_trip(&conn).await;

    // The control: with both available, the left branch wins.
    let mut s = select(leaf("a", &log), unavailable("b", &log));
    assert_eq!(s.resolve().unwrap(), Side::Left);
    let conn = s.connect_wrap(MemConn::default()).await.unwrap();
    assert_eq!(conn.side(), Side::Left);
}

#[tokio::test]
async fn select_fails_with_no_branch_when_both_are_unavailable() {
    let log = Log::default();
    let mut s = stack![
        select(unavailable("a", &log), unavailable("b", &log)),
        Mem::new(&log),
    ];
    let check = |err: Error| match err {
        Error::NoBranch { left, right } => {
            assert!(
                matches!(*left, Error::NotAvailable { chunnel: "a", .. }),
                "{left:?}"
            );
            assert!(
                matches!(*right, Error::NotAvailable { chunnel: "b", .. }),
                "{right:?}"
            );
        }
        other => panic!("expected NoBranch, got {other:?}"),
    };
    check(s.available().unwrap_err());
    check(s.connect_wrap(()).await.unwrap_err());
    assert!(!entries(&log).iter().any(|e| e == "wrap a" || e == "wrap b"));
}

#[test]
fn nested_select_unavailable_subtree_falls_back_to_the_outer_right() {
    let log = Log::default();
    let s = select(
        select(unavailable("a", &log), unavailable("b", &log)),
        leaf("c", &log),
    );
    assert_eq!(s.resolve().unwrap(), Side::Right);
    let s = select(
        select(unavailable("a", &log), leaf("b", &log)),
        leaf("c", &log),
    );
    assert_eq!(s.resolve().unwrap(), Side::Left);
    assert_eq!(s.left.resolve().unwrap(), Side::Right);
}

// ---- Capability::compatible --------------------------------------------------------------------

#[test]
fn exact_capabilities_need_equal_label_sets() {
    let json_cbor = Capability::exact("serialize", ["json", "cbor"]);
    let cbor_json = Capability::exact("serialize", ["cbor", "json"]);
    let json = Capability::exact("serialize", ["json"]);
    let bincode = Capability::exact("serialize", ["bincode"]);

    assert!(json_cbor.compatible(&cbor_json), "order does not matter");
    assert!(cbor_json.compatible(&json_cbor));
    assert!(json.compatible(&json.clone()));
    assert!(!json.compatible(&json_cbor), "a subset is not equal");
    assert!(!json_cbor.compatible(&json), "a superset is not equal");
    assert!(!json.compatible(&bincode));
}

#[test]
fn compositional_capabilities_need_an_intersection() {
    let ab = Capability::compositional("shard", ["a", "b"]);
    let bc = Capability::compositional("shard", ["b", "c"]);
    let c = Capability::compositional("shard", ["c"]);
    let d = Capability::compositional("shard", ["d"]);

    assert!(ab.compatible(&bc));
    assert!(bc.compatible(&ab));
    assert!(c.compatible(&bc), "a subset intersects");
    assert!(!ab.compatible(&c));
    assert!(!c.compatible(&d));
}

#[test]
fn capabilities_of_different_kinds_or_rules_never_match() {
    let ser = Capability::exact("serialize", ["json"]);
    let frame = Capability::exact("framing", ["json"]);
    assert!(!ser.compatible(&frame));
    assert!(!frame.compatible(&ser));

    let shard = Capability::compositional("shard", ["x"]);
    let route = Capability::compositional("route", ["x"]);
    assert!(!shard.compatible(&route));

    let exact_x = Capability::exact("k", ["x"]);
    let comp_x = Capability::compositional("k", ["x"]);
    assert!(exact_x.compatible(&exact_x.clone()), "the control matches");
    assert!(comp_x.compatible(&comp_x.clone()), "the control matches");
    assert!(!exact_x.compatible(&comp_x));
    assert!(!comp_x.compatible(&exact_x));
}

// ---- BoxChunnel --------------------------------------------------------------------------------

#[tokio::test]
async fn boxed_stack_round_trips_and_still_offers() {
    let mut b = stack![Noop, select(Noop, Identity), Mem::default()].boxed();
    assert_eq!(option_picks(&b), [vec![0], vec![1]]);
    assert_eq!(
        option_ids(&b),
        [
            vec!["chunnel/noop/1", "chunnel/noop/1", "test/mem/1"],
            // The identity is no layer: it adds nothing to the offered stack.
            vec!["chunnel/noop/1", "test/mem/1"],
        ]
    );
    let conn: BoxConnection<u32> = b.connect_wrap(()).await.unwrap();
    round_trip(&conn).await;
    // Several calls in a row on the same connection.
    conn.send([1]).await.unwrap();
    conn.send([2, 3]).await.unwrap();
    let mut slots = [None; 2];
    assert_eq!(conn.recv(&mut slots).await.unwrap(), 2);
    assert_eq!(slots, [Some(1), Some(2)]);
    assert_eq!(conn.recv_one().await.unwrap(), 3);
}

#[tokio::test]
async fn boxed_stack_forwards_apply_and_availability() {
    let log = Log::default();
    let mut b = stack![select(leaf("a", &log), leaf("b", &log)), Mem::new(&log)].boxed();
    assert!(b.available().is_ok());
    b.apply(&Pick::from_branches(vec![1])).unwrap();
    assert!(matches!(
        b.apply(&Pick::from_branches(vec![])),
        Err(Error::BadPick { .. })
    ));
    b.apply(&Pick::from_branches(vec![1])).unwrap();
    b.connect_wrap(()).await.unwrap();
    let wraps: Vec<_> = entries(&log)
        .into_iter()
        .filter(|e| e.starts_with("wrap"))
        .collect();
    assert_eq!(wraps, ["wrap mem", "wrap b"]);

    let none = select(unavailable("a", &log), unavailable("b", &log));
    let b = stack![none, Mem::new(&log)].boxed();
    assert!(matches!(b.available(), Err(Error::NoBranch { .. })));
}

// ---- Send + Sync -------------------------------------------------------------------------------

fn assert_send_sync<T: Send + Sync>() {}

fn assert_send_type<T: Send>() {}

fn assert_send<T: Send>(_: &T) {}

#[test]
fn connections_are_send_and_sync() {
    assert_send_sync::<Either<MemConn, NoopConnection<MemConn>>>();
    assert_send_sync::<NoopConnection<MemConn>>();
    assert_send_sync::<BoxConnection<u32>>();
    assert_send_type::<chunnel::BoxChunnel<(), u32>>();
}

#[tokio::test]
async fn noop_stack_futures_are_send() {
    let mut s = stack![Noop, select(Noop, Identity), Noop, Mem::default()];
    let connecting = s.connect_wrap(());
    assert_send(&connecting);
    let conn = Arc::new(connecting.await.unwrap());

    let sending = conn.send(vec![5, 6]);
    assert_send(&sending);
    sending.await.unwrap();
    let mut slots = [None, None];
    let receiving = conn.recv(&mut slots);
    assert_send(&receiving);
    assert_eq!(receiving.await.unwrap(), 2);
    assert_eq!(slots, [Some(5), Some(6)]);

    // And the connection really works from a spawned task.
    let remote = Arc::clone(&conn);
    tokio::spawn(async move { remote.send_one(11).await })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(conn.recv_one().await.unwrap(), 11);
}

#[test]
fn exact_capabilities_compare_label_sets_symmetrically() {
    let aa = Capability::exact("k", ["a", "a"]);
    let ab = Capability::exact("k", ["a", "b"]);
    assert!(!aa.compatible(&ab));
    assert!(!ab.compatible(&aa));
    assert!(aa.compatible(&Capability::exact("k", ["a"])));
}

#[test]
fn a_rejected_pick_changes_nothing() {
    let mut s = stack![select(Noop, Noop), select(Noop, Noop)];
    assert!(matches!(
        s.apply(&chunnel::Pick::from_branches(vec![1])),
        Err(Error::BadPick { .. })
    ));
    assert_eq!(
        s.outer.choice(),
        None,
        "a half-applied pick fixed the first select"
    );
}
