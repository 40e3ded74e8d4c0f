//! QoS hints over real datapaths (features `shm` and `uring`): a client and a server, each
//! building its datapath select from a registry for a hint, negotiate over chunnel-negotiate
//! on the base datapath their plan names (io_uring or kernel UDP). Shared memory is picked
//! between these co-located peers when the hint asks for it; forcing io_uring unavailable, a
//! forbidding policy, or a peer with another shared-memory directory makes the plan fall
//! back, with a warning and a report naming what was missing.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use chunnel::{BoxConnection, ConnectionExt, End, Listener, PeerHandoff, SendHeader};
use chunnel_discovery::datapaths::{Datapaths, FUNCTION, IO_URING, KERNEL_UDP, SHM};
use chunnel_discovery::{Hint, Policy, QosPlan, QosReport, Registry, Skip};
use chunnel_negotiate::{Client, Config, Negotiated, Tagged, listen};
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(10);

/// Records the fields of every WARN event while `f` runs on this thread.
fn warnings<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    use tracing::field::{Field, Visit};
    struct Capture(Arc<Mutex<Vec<String>>>);
    struct Fields(String);
    impl Visit for Fields {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            let _ = write!(self.0, "{}={:?} ", field.name(), value);
        }
    }
    impl tracing::Subscriber for Capture {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, e: &tracing::Event<'_>) {
            if *e.metadata().level() == tracing::Level::WARN {
                let mut v = Fields(String::new());
                e.record(&mut v);
                self.0.lock().unwrap().push(v.0);
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }
    let log = Arc::new(Mutex::new(Vec::new()));
    let out = tracing::subscriber::with_default(Capture(Arc::clone(&log)), f);
    let v = log.lock().unwrap().clone();
    (out, v)
}

fn plan<C>(dp: &Datapaths, policy: &Policy, hint: Hint) -> (QosPlan<Tagged<C>, Bytes>, Vec<String>)
where
    C: SendHeader + PeerHandoff + Send + Sync + 'static,
{
    let reg = Registry::<Tagged<C>, Bytes>::new();
    reg.set_policy(policy.clone());
    dp.register(&reg).unwrap();
    let (p, w) = warnings(|| reg.for_hint(FUNCTION, hint));
    (p.unwrap(), w)
}

/// An echo server on `listener` whose stack is its plan's select; each connection's picked
/// datapath goes to the receiver.
fn serve<L>(
    listener: L,
    dp: &Datapaths,
    policy: &Policy,
    hint: Hint,
) -> (QosReport, Vec<String>, mpsc::Receiver<String>)
where
    L: Listener + 'static,
    L::Connection: SendHeader + PeerHandoff + Send + Sync + 'static,
{
    let (plan, warned) = plan::<L::Connection>(dp, policy, hint);
    let report = plan.report().clone();
    let mut server = listen(plan.selection().clone(), listener, Config::default());
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            let picked = plan
                .selection()
                .picked(conn.info().server_pick.branches())
                .unwrap_or("?")
                .to_string();
            let _ = tx.send(picked).await;
            tokio::spawn(async move {
                while let Ok(m) = conn.recv_one().await {
                    if conn.send_one(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    (report, warned, rx)
}

/// Binds the base the server's plan names.
async fn serve_on_planned_base(
    dp: &Datapaths,
    policy: &Policy,
    hint: Hint,
) -> anyhow::Result<(SocketAddr, QosReport, Vec<String>, mpsc::Receiver<String>)> {
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let base = dp.base_for(policy, hint)?;
    Ok(match base.as_deref() {
        Some(IO_URING) => {
            let l = chunnel_uring::udp::Listener::bind(any).await?;
            let addr = l.local_addr()?;
            let (r, w, rx) = serve(l, dp, policy, hint);
            (addr, r, w, rx)
        }
        Some(KERNEL_UDP) => {
            let l = chunnel_net::udp::Listener::bind(any).await?;
            let addr = l.local_addr()?;
            let (r, w, rx) = serve(l, dp, policy, hint);
            (addr, r, w, rx)
        }
        other => anyhow::bail!("unexpected base {other:?}"),
    })
}

/// What a client saw: its report, its warnings, the datapath it negotiated, what
/// `negotiated` said was passed over (and warned), and whether an echo went through.
#[derive(Debug)]
struct Dialed {
    report: QosReport,
    warned: Vec<String>,
    picked: String,
    passed_over: Vec<String>,
    negotiation_warned: Vec<String>,
    server_stack: Vec<String>,
}

async fn dial_on<C>(base: C, dp: &Datapaths, policy: &Policy, hint: Hint) -> anyhow::Result<Dialed>
where
    C: SendHeader + PeerHandoff + Send + Sync + 'static,
{
    let (plan, warned) = plan::<C>(dp, policy, hint);
    let conn: Negotiated<BoxConnection<Bytes>> = tokio::time::timeout(
        WAIT,
        Client::new(Config::default()).connect("server", plan.selection().clone(), base),
    )
    .await??;
    for m in ["one", "two", ""] {
        conn.send_one(Bytes::from(m)).await?;
        assert_eq!(tokio::time::timeout(WAIT, conn.recv_one()).await??, m);
    }
    let ((picked, passed), negotiation_warned) =
        warnings(|| plan.negotiated(conn.info().client_pick.branches()));
    Ok(Dialed {
        report: plan.report().clone(),
        warned,
        picked: picked.unwrap_or_default(),
        passed_over: passed.into_iter().map(|m| m.name).collect(),
        negotiation_warned,
        server_stack: conn
            .info()
            .server_stack
            .iter()
            .map(|c| c.id.to_string())
            .collect(),
    })
}

/// Connects on the base the client's plan names.
async fn dial(
    addr: SocketAddr,
    dp: &Datapaths,
    policy: &Policy,
    hint: Hint,
) -> anyhow::Result<Dialed> {
    use chunnel::Chunnel;
    match dp.base_for(policy, hint)?.as_deref() {
        Some(IO_URING) => {
            let base = chunnel_uring::udp::Connect::new(addr)
                .connect_wrap(())
                .await?;
            dial_on(base, dp, policy, hint).await
        }
        Some(KERNEL_UDP) => {
            let base = chunnel_net::udp::Connect::new(addr)
                .connect_wrap(())
                .await?;
            dial_on(base, dp, policy, hint).await
        }
        other => anyhow::bail!("unexpected base {other:?}"),
    }
}

/// The base datapath an unconstrained end runs on for a hint that prefers io_uring.
fn best_base() -> &'static str {
    if chunnel_uring::check_available().is_ok() {
        IO_URING
    } else {
        KERNEL_UDP
    }
}

async fn recv_pick(rx: &mut mpsc::Receiver<String>) -> String {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("a server connection in time")
        .expect("server running")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_sensitive_picks_shared_memory_between_co_located_peers() -> anyhow::Result<()> {
    let policy = Policy::default();
    let hint = Hint::LatencySensitive;
    let (addr, srv, srv_warned, mut picks) =
        serve_on_planned_base(&Datapaths::new(End::Server), &policy, hint).await?;
    assert_eq!(srv.selected, [SHM, best_base()]);
    // No XDP interface was configured: the server fell back from af-xdp, and said so.
    assert_eq!(srv.fallbacks[0].name, "af-xdp");
    assert!(
        srv_warned.iter().any(|w| w.contains("af-xdp")),
        "{srv_warned:?}"
    );

    let cli = dial(addr, &Datapaths::new(End::Client), &policy, hint).await?;
    assert_eq!(cli.report.selected, [SHM, best_base()]);
    assert_eq!(cli.report.base.as_deref(), Some(best_base()));
    // Both ends are in this process: shared memory won the negotiation at both ends.
    assert_eq!(cli.picked, SHM);
    assert_eq!(cli.server_stack, [chunnel_shm::ID]);
    assert_eq!(recv_pick(&mut picks).await, SHM);
    assert!(cli.passed_over.is_empty());
    assert!(cli.negotiation_warned.is_empty());
    // The client has no AF_XDP at all; the report says so, by name.
    assert!(
        cli.report
            .fallbacks
            .iter()
            .any(|m| m.name == "af-xdp" && m.why == Skip::NotRegistered),
        "{:?}",
        cli.report
    );
    assert!(
        cli.warned
            .iter()
            .any(|w| w.contains("af-xdp") && w.contains("not registered"))
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frugal_uses_kernel_udp_even_when_co_located() -> anyhow::Result<()> {
    let policy = Policy::default();
    let hint = Hint::Frugal;
    let (addr, srv, srv_warned, mut picks) =
        serve_on_planned_base(&Datapaths::new(End::Server), &policy, hint).await?;
    assert_eq!(srv.selected, [KERNEL_UDP]);
    assert!(!srv.fell_back() && srv_warned.is_empty());
    let cli = dial(addr, &Datapaths::new(End::Client), &policy, hint).await?;
    assert_eq!(cli.report.selected, [KERNEL_UDP]);
    assert_eq!(cli.picked, KERNEL_UDP);
    assert_eq!(cli.server_stack, ["chunnel/udp/1"]);
    assert_eq!(recv_pick(&mut picks).await, KERNEL_UDP);
    assert!(cli.warned.is_empty(), "{:?}", cli.warned);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_prefers_io_uring_and_warns_when_it_is_forced_unavailable() -> anyhow::Result<()>
{
    let policy = Policy::default();
    let hint = Hint::Throughput;
    let (addr, srv, _, mut picks) =
        serve_on_planned_base(&Datapaths::new(End::Server), &policy, hint).await?;
    assert_eq!(srv.base.as_deref(), Some(best_base()));

    // An unconstrained client runs on io_uring where this host has it.
    let cli = dial(addr, &Datapaths::new(End::Client), &policy, hint).await?;
    match chunnel_uring::check_available() {
        Ok(()) => {
            assert_eq!(cli.report.selected, [IO_URING]);
            assert_eq!(cli.picked, IO_URING);
            assert!(cli.warned.is_empty(), "{:?}", cli.warned);
        }
        Err(e) => {
            // io_uring disabled here: the probe's NotAvailable is what the report names.
            assert!(matches!(e, chunnel::Error::NotAvailable { .. }));
            assert_eq!(cli.report.selected, [KERNEL_UDP]);
            assert_eq!(cli.report.fallbacks[0].name, IO_URING);
        }
    }
    assert_eq!(recv_pick(&mut picks).await, best_base());

    // Forced unavailable: falls back to kernel UDP, warns and reports why, still talks to the
    // same server (the datapaths are wire-compatible).
    let forced = Datapaths::new(End::Client)
        .with_uring_config(chunnel_uring::udp::Config::default().with_forced_unavailable(true));
    let cli = dial(addr, &forced, &policy, hint).await?;
    assert_eq!(cli.report.selected, [KERNEL_UDP]);
    assert_eq!(cli.report.base.as_deref(), Some(KERNEL_UDP));
    assert_eq!(cli.picked, KERNEL_UDP);
    assert_eq!(
        cli.server_stack,
        [format!(
            "chunnel/{}/1",
            if best_base() == IO_URING {
                "uring-udp"
            } else {
                "udp"
            }
        )]
    );
    let io = &cli.report.fallbacks[0];
    assert_eq!(io.name, IO_URING);
    match &io.why {
        Skip::Unavailable { reason } if reason.contains("forced unavailable") => {}
        // Where io_uring is off anyway, the resource check reports it first.
        Skip::MissingResource { resource, .. } if resource == "io_uring" => {
            assert_eq!(best_base(), KERNEL_UDP)
        }
        other => panic!("unexpected reason {other:?}"),
    }
    assert_eq!(cli.warned.len(), 1, "{:?}", cli.warned);
    assert!(cli.warned[0].contains("io-uring"), "{:?}", cli.warned);
    assert!(cli.warned[0].contains("throughput"), "{:?}", cli.warned);
    assert_eq!(recv_pick(&mut picks).await, best_base());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidding_policy_is_a_fallback_the_report_names() -> anyhow::Result<()> {
    let hint = Hint::LatencySensitive;
    let (addr, _, _, mut picks) =
        serve_on_planned_base(&Datapaths::new(End::Server), &Policy::default(), hint).await?;
    let policy = Policy::default().forbid(SHM);
    let cli = dial(addr, &Datapaths::new(End::Client), &policy, hint).await?;
    assert_eq!(cli.report.selected, [best_base()]);
    assert_eq!(cli.picked, best_base());
    assert_eq!(cli.report.fallbacks[0].name, SHM);
    assert_eq!(cli.report.fallbacks[0].why, Skip::Forbidden);
    assert!(
        cli.warned[0].contains("shm (forbidden by the operator policy)"),
        "{:?}",
        cli.warned
    );
    // The server would have taken shared memory; it got the network path.
    assert_eq!(recv_pick(&mut picks).await, best_base());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_same_shared_memory_negotiates_the_network_and_warns()
-> anyhow::Result<()> {
    let hint = Hint::LatencySensitive;
    // The server's shared-memory directory is not the client's /dev/shm: another host
    // identity, as a container with a private /dev/shm has.
    let dir = std::env::temp_dir().join(format!("chunnel-disc-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let server_dp = Datapaths::new(End::Server).with_shm_config(chunnel_shm::Config {
        dir: dir.clone(),
        ..chunnel_shm::Config::default()
    });
    let (addr, srv, _, mut picks) =
        serve_on_planned_base(&server_dp, &Policy::default(), hint).await?;
    assert_eq!(srv.selected[0], SHM, "the server offers shared memory");
    let cli = dial(addr, &Datapaths::new(End::Client), &Policy::default(), hint).await?;
    assert_eq!(cli.report.selected, [SHM, best_base()]);
    assert_eq!(cli.picked, best_base());
    assert_eq!(cli.passed_over, [SHM]);
    assert_eq!(cli.negotiation_warned.len(), 1);
    assert!(
        cli.negotiation_warned[0].contains("shm"),
        "{:?}",
        cli.negotiation_warned
    );
    assert_eq!(recv_pick(&mut picks).await, best_base());
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Set in the child process of [`io_uring_disabled_by_the_environment_falls_back`].
const CHILD: &str = "CHUNNEL_DISCOVERY_TEST_CHILD";

/// Runs only as the child of the test below (with io_uring disabled for its whole process by
/// `CHUNNEL_URING_DISABLE`, which would disturb the other tests of this process); a no-op
/// otherwise, checked by its parent.
#[test]
fn child_io_uring_disabled() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let e = chunnel_uring::check_available().unwrap_err();
    assert!(matches!(e, chunnel::Error::NotAvailable { .. }), "{e:?}");
    let (plan, warned) = plan::<chunnel_net::udp::Connection>(
        &Datapaths::new(End::Client),
        &Policy::default(),
        Hint::Throughput,
    );
    let r = plan.report();
    assert_eq!(r.selected, [KERNEL_UDP]);
    assert_eq!(r.fallbacks[0].name, IO_URING);
    match &r.fallbacks[0].why {
        Skip::MissingResource { resource, reason } => {
            assert_eq!(resource, "io_uring");
            assert!(reason.contains("CHUNNEL_URING_DISABLE=1"), "{reason}");
        }
        other => panic!("unexpected reason {other:?}"),
    }
    assert_eq!(warned.len(), 1);
    assert!(warned[0].contains("CHUNNEL_URING_DISABLE"), "{warned:?}");
    println!("child checked: {}", r.fallbacks[0]);
}

#[test]
fn io_uring_disabled_by_the_environment_falls_back() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_io_uring_disabled", "--nocapture"])
        .env(CHILD, "1")
        .env(chunnel_uring::DISABLE_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("child checked: io-uring (missing resource io_uring: chunnel chunnel/uring-udp/1 is not available here: disabled by the environment"),
        "{stdout}"
    );
}

#[test]
fn select_by_priority_keeps_one_base() {
    let reg = Registry::<Tagged<chunnel_net::udp::Connection>, Bytes>::new();
    Datapaths::new(End::Client).register(&reg).unwrap();
    let sel = reg.select(FUNCTION).unwrap();
    // Priorities: shm 30, io-uring 10, kernel-udp 0 (af-xdp is a server datapath).
    assert_eq!(sel.names(), [SHM, best_base()]);
    if best_base() == IO_URING {
        let k = sel
            .candidates()
            .iter()
            .find(|c| c.name == KERNEL_UDP)
            .unwrap();
        assert_eq!(
            k.outcome,
            Err(Skip::BaseNotUsed {
                used: IO_URING.into()
            })
        );
    }
}
