//! `chunnel_metrics::reconfigure` traces a switch: a span `chunnel.reconfigure` with one child
//! span per phase, `prepare` and `commit` (its metrics are checked by tests/prometheus_scrape.rs).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use chunnel::{Chunnel, LockFree, Noop, Shared, Side, select, stack};
use chunnel_net::udp;
use tracing::span;

/// Records the name of every span created and the parent each was created in.
struct Spans {
    spans: Mutex<Vec<(&'static str, Option<u64>)>>,
    current: Mutex<Vec<u64>>,
    next: AtomicU64,
}

impl tracing::Subscriber for &'static Spans {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, a: &span::Attributes<'_>) -> span::Id {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let parent = self.current.lock().unwrap().last().copied();
        self.spans
            .lock()
            .unwrap()
            .push((a.metadata().name(), parent));
        span::Id::from_u64(id)
    }
    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, id: &span::Id) {
        self.current.lock().unwrap().push(id.into_u64());
    }
    fn exit(&self, _: &span::Id) {
        self.current.lock().unwrap().pop();
    }
}

#[tokio::test(flavor = "current_thread")]
async fn reconfigure_is_traced_per_phase() -> Result<(), Box<dyn std::error::Error>> {
    let spans: &'static Spans = Box::leak(Box::new(Spans {
        spans: Mutex::new(Vec::new()),
        current: Mutex::new(Vec::new()),
        next: AtomicU64::new(0),
    }));
    tracing::subscriber::set_global_default(spans)?;

    let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
    let sel = select(Noop, Noop).reconfigurable::<LockFree>();
    let handle = sel.handle();
    let mut s = stack![sel, Shared, udp::Connect::new(listener.local_addr()?)];
    let conn = s.connect_wrap(()).await?;
    assert_eq!(
        chunnel_metrics::reconfigure(&handle, Side::Right, "traced").await?,
        1
    );
    assert_eq!(conn.side(), Side::Right);

    let got = spans.spans.lock().unwrap().clone();
    let names: Vec<_> = got.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        ["chunnel.reconfigure", "prepare", "commit"],
        "{got:?}"
    );
    // Both phases were created inside the reconfigure span (id 1).
    assert_eq!(got[1].1, Some(1));
    assert_eq!(got[2].1, Some(1));
    Ok(())
}
