//! The offer tree against the flattened offers it replaces.
//!
//! * Over random trees (leaves with random capabilities from a small vocabulary, so that
//!   compatible and incompatible pairs are both common; availability; selects, layers and
//!   explicit option lists nested at random), `choose_tree` gives exactly what the flattened
//!   algorithm (`negotiate::choose`, the oracle) gives on `options()`: the same server and
//!   client picks, or the same mismatch list.
//! * A real stack's `offer_tree()` allows exactly its `offers()`, in the same order.
//! * A stack of k two-way selects is described in space linear in k, and the search for the
//!   only compatible option (the last of each select) takes steps linear in k (16, 64, 256).

use chunnel::negotiate::{Capability, ChunnelInfo, Negotiate, choose};
use chunnel::offer_tree::{Limits, NoChoice, choose_tree};
use chunnel::{Identity, OfferTree, Offers, Pick, select, stack};

/// xorshift64*: a small deterministic generator (each case reproducible from its seed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn capability(r: &mut Rng) -> Capability {
    const KINDS: [&str; 3] = ["ser", "rel", "shard"];
    const LABELS: [&str; 3] = ["x", "y", "z"];
    let kind = KINDS[r.below(3) as usize];
    let n = 1 + r.below(2) as usize;
    let labels: Vec<&'static str> = (0..n).map(|_| LABELS[r.below(3) as usize]).collect();
    if r.below(3) == 0 {
        Capability::compositional(kind, labels)
    } else {
        Capability::exact(kind, labels)
    }
}

fn leaf(r: &mut Rng) -> ChunnelInfo {
    const IDS: [&str; 4] = ["a", "b", "c", "d"];
    let caps = (0..r.below(3)).map(|_| capability(r)).collect();
    ChunnelInfo {
        id: IDS[r.below(4) as usize].into(),
        capabilities: caps,
    }
}

fn tree(r: &mut Rng, depth: u32) -> OfferTree {
    let k = if depth == 0 { 0 } else { r.below(10) };
    match k {
        0..=2 => {
            if r.below(12) == 0 {
                OfferTree::Options(Vec::new()) // an unavailable Chunnel
            } else {
                OfferTree::Leaf(leaf(r))
            }
        }
        3..=5 => OfferTree::Select(Box::new(tree(r, depth - 1)), Box::new(tree(r, depth - 1))),
        6..=8 => OfferTree::Seq((0..r.below(4)).map(|_| tree(r, depth - 1)).collect()),
        _ => {
            // An explicit list, as a tree without its own description makes: the options of
            // a random subtree.
            OfferTree::Options(tree(r, depth - 1).options())
        }
    }
}

#[test]
fn choose_tree_agrees_with_the_flattened_oracle() {
    let cases: u64 = 20_000;
    let (mut ok, mut refused) = (0, 0);
    for seed in 1..=cases {
        let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let depth = 1 + r.below(4) as u32;
        let (server, client) = (tree(&mut r, depth), tree(&mut r, depth));
        let (so, co) = (server.options(), client.options());
        assert_eq!(so.len() as u128, server.count(), "seed {seed}: count");
        let oracle = choose(&so, &co, 16);
        let got = choose_tree(&server, &client, Limits::default());
        match (oracle, got) {
            (Ok(c), Ok(t)) => {
                assert_eq!(
                    (&so[c.server_option].pick, &co[c.client_option].pick),
                    (&t.server_pick, &t.client_pick),
                    "seed {seed}: picks\nserver {server:?}\nclient {client:?}"
                );
                assert_eq!(so[c.server_option].chunnels, t.server_stack, "seed {seed}");
                assert_eq!(co[c.client_option].chunnels, t.client_stack, "seed {seed}");
                assert_eq!(
                    server.option(&t.server_pick).as_ref(),
                    Some(&t.server_stack),
                    "seed {seed}: the pick names the stack"
                );
                ok += 1;
            }
            (Err(m), Err(NoChoice::Incompatible(n))) => {
                assert_eq!(m, n, "seed {seed}: mismatches");
                refused += 1;
            }
            (o, g) => panic!(
                "seed {seed}: oracle {o:?}, tree search {g:?}\nserver {server:?}\nclient {client:?}"
            ),
        }
    }
    eprintln!("{cases} random pairs: {ok} agreed on a pick, {refused} on a refusal");
    // Both outcomes are common, so the comparison means something either way.
    assert!(
        ok > cases / 10 && refused > cases / 10,
        "ok {ok}, refused {refused}"
    );
}

#[derive(Clone)]
struct L(&'static str, &'static str, &'static str);

impl Negotiate for L {
    fn id(&self) -> &'static str {
        self.0
    }
    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::exact(self.1, [self.2])]
    }
}

#[test]
fn a_real_stacks_tree_allows_its_offers_in_order() {
    let s = stack![
        select(L("a", "ser", "x"), L("b", "ser", "y")),
        Identity,
        L("c", "rel", "x"),
        select(
            select(L("d", "shard", "x"), L("e", "shard", "y")),
            stack![L("f", "shard", "z"), L("g", "ser2", "x")]
        ),
        select(Identity, L("h", "zip", "x")),
    ];
    assert_eq!(s.offer_tree().options(), s.offers());
    assert_eq!(s.offer_tree().count(), 12);
    for o in s.offers() {
        assert_eq!(s.offer_tree().option(&o.pick), Some(o.chunnels.clone()));
    }
    assert_eq!(s.offer_tree().option(&Pick::from_slice(&[0, 0])), None);
}

/// `k` selects, each between `pre{i}` (preferred) and `alt{i}`, of kind `k{i}`.
fn selects(k: usize, only_last: bool) -> OfferTree {
    let layer = |i: usize, label: &'static str| {
        OfferTree::Leaf(ChunnelInfo {
            id: format!("layer{i}/{label}").into(),
            capabilities: vec![Capability::exact(format!("k{i}"), [label])],
        })
    };
    OfferTree::Seq(
        (0..k)
            .map(|i| {
                if only_last {
                    layer(i, "alt")
                } else {
                    OfferTree::Select(Box::new(layer(i, "pre")), Box::new(layer(i, "alt")))
                }
            })
            .collect(),
    )
}

#[test]
fn many_selects_are_searched_in_linear_steps() {
    let mut prev = None;
    for k in [16usize, 64, 256] {
        let client = selects(k, false);
        let server = selects(k, true);
        assert_eq!(client.nodes(), 1 + 3 * k, "linear description");
        let t = choose_tree(&server, &client, Limits::default()).expect("compatible");
        assert_eq!(t.client_pick.branches(), vec![1u8; k].as_slice());
        eprintln!("{k} selects: {} steps", t.steps);
        assert!(
            t.steps <= 8 * k as u64 + 8,
            "{k} selects took {} steps",
            t.steps
        );
        if let Some(p) = prev {
            assert!(t.steps < 8 * p, "steps grow linearly");
        }
        prev = Some(t.steps);
        // And the other way round: a server with the selects, a client with only the
        // fallbacks; and an incompatible client is refused quickly.
        let t = choose_tree(&client, &server, Limits::default()).expect("compatible");
        assert_eq!(t.server_pick.branches(), vec![1u8; k].as_slice());
        let mut other = selects(k, true);
        if let OfferTree::Seq(parts) = &mut other {
            parts.push(OfferTree::Leaf(ChunnelInfo {
                id: "extra".into(),
                capabilities: vec![Capability::exact("nobody-else", ["x"])],
            }));
        }
        match choose_tree(&client, &other, Limits::default()) {
            Err(NoChoice::Incompatible(m)) => assert!(!m.is_empty() && m.len() <= 16),
            r => panic!("{k} selects: expected a refusal, got {r:?}"),
        }
    }
}

#[test]
fn a_search_past_its_limits_says_so() {
    let client = selects(20, false);
    let server = selects(20, true);
    assert_eq!(
        choose_tree(&server, &client, Limits::default().with_steps(10)),
        Err(NoChoice::TooComplex { steps: 11 })
    );
    assert!(matches!(
        choose_tree(&server, &client, Limits::default().with_work(100)),
        Err(NoChoice::TooComplex { .. })
    ));
    // The most choices a hello may carry (512 selects) are decided within the default limits
    // (the work per step is linear in the trees) and the default 2 MiB stack of a thread (the
    // search recurses once per choice on a path), in a debug build too.
    let (client, server) = (selects(512, false), selects(512, true));
    let t = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || choose_tree(&server, &client, Limits::default()))
        .unwrap()
        .join()
        .unwrap()
        .expect("within the limits");
    assert_eq!(t.client_pick.branches(), vec![1u8; 512].as_slice());
}

/// An adversarial pair: every Chunnel carries a capability of one kind, so no check can be
/// confined to a small group, and nothing is compatible. The search stops at its work limit;
/// the time it took is printed (a figure, not an assertion: `cargo test --release -p chunnel
/// --test offer_tree adversarial -- --nocapture`).
#[test]
fn an_adversarial_pair_stops_at_the_work_limit() {
    let one_kind = |k: usize, base: usize| {
        let leaf = |l: usize| {
            OfferTree::Leaf(ChunnelInfo {
                id: "x".into(),
                capabilities: vec![Capability::exact("k", [format!("{l}")])],
            })
        };
        OfferTree::Seq(
            (0..k)
                .map(|i| {
                    OfferTree::Select(
                        Box::new(leaf(base + 2 * i)),
                        Box::new(leaf(base + 2 * i + 1)),
                    )
                })
                .collect(),
        )
    };
    let (server, client) = (one_kind(256, 0), one_kind(256, 1));
    let t = std::time::Instant::now();
    let r = choose_tree(&server, &client, Limits::default());
    eprintln!(
        "adversarial 256 x 256 selects of one kind: {:?} in {:?}",
        r.as_ref().err(),
        t.elapsed()
    );
    assert!(matches!(r, Err(NoChoice::TooComplex { .. })), "{r:?}");
}
