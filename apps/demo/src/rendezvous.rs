//! The multi-party part of the tour (paper §5.3 and §7.2): a publisher and its receivers form a
//! group that agrees on its stack through a rendezvous store (the embedded SQLite default, a
//! file in a temporary directory). With one receiver the group orders messages at the receiver
//! (cheap); when a second receiver joins, the publisher proposes a switch to service-side
//! ordering, every member votes, and the group switches; when the receiver leaves, it switches
//! back. The two ordering Chunnels are stand-ins (a header naming the mode) until the pub/sub
//! Chunnels exist; a message decoded by the wrong one is an error, so the demo checks that
//! every member switched at the same point.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::{BufMut, Bytes, BytesMut};
use chunnel::{Capability, Chunnel, ChunnelConnection, Negotiate, Select, select};
use chunnel_rendezvous::{Config, Group, SqliteStore};

/// Where a group's messages are put in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Each receiver reorders (one receiver: cheapest).
    Receiver,
    /// The service orders for everyone (several receivers).
    Service,
}

/// A stand-in ordering Chunnel: one header byte naming its mode; exact capability
/// `ordering = {receiver}` or `{service}`.
#[derive(Clone, Copy, Debug)]
pub struct Ordering(pub Mode);

impl Ordering {
    fn tag(self) -> u8 {
        match self.0 {
            Mode::Receiver => b'R',
            Mode::Service => b'S',
        }
    }
}

impl Negotiate for Ordering {
    fn id(&self) -> &'static str {
        "demo/ordering/1"
    }
    fn capabilities(&self) -> Vec<Capability> {
        let label = match self.0 {
            Mode::Receiver => "receiver",
            Mode::Service => "service",
        };
        vec![Capability::exact("ordering", [label])]
    }
}

/// The connection of an [`Ordering`] layer.
pub struct OrderingConn<C> {
    inner: C,
    tag: u8,
}

impl<C: ChunnelConnection<Data = Bytes> + Send> Chunnel<C> for Ordering {
    type Connection = OrderingConn<C>;
    async fn connect_wrap(&mut self, inner: C) -> Result<OrderingConn<C>, chunnel::Error> {
        Ok(OrderingConn {
            inner,
            tag: self.tag(),
        })
    }
}

impl<C: ChunnelConnection<Data = Bytes>> ChunnelConnection for OrderingConn<C> {
    type Data = Bytes;
    async fn send<B>(&self, burst: B) -> Result<(), chunnel::Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        let v: Vec<Bytes> = burst
            .into_iter()
            .map(|m| {
                let mut b = BytesMut::with_capacity(m.len() + 1);
                b.put_u8(self.tag);
                b.put_slice(&m);
                b.freeze()
            })
            .collect();
        self.inner.send(v).await
    }
    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, chunnel::Error> {
        let n = self.inner.recv(slots).await?;
        for m in slots[..n].iter_mut().flatten() {
            if m.first() != Some(&self.tag) {
                return Err(chunnel::Error::Malformed {
                    what: "a message encoded by the other ordering mode",
                });
            }
            *m = m.slice(1..);
        }
        Ok(n)
    }
}

type Stack = Select<Ordering, Ordering>;

fn stack() -> Stack {
    select(Ordering(Mode::Receiver), Ordering(Mode::Service))
}

async fn member(store: &Arc<SqliteStore>, id: &str) -> Result<Group<Stack>> {
    let config = Config {
        poll: Duration::from_millis(10),
        ..Config::default()
    };
    Group::join(
        store.clone(),
        "orders",
        id,
        "127.0.0.1:0".parse()?,
        stack(),
        None,
        config,
    )
    .await
    .with_context(|| format!("{id} joining"))
}

fn mode(g: &Group<Stack>) -> &'static str {
    match g.participant().view().option {
        0 => "receiver-side ordering",
        _ => "service-side ordering",
    }
}

/// Waits (bounded) until `g` sees `n` members.
async fn members(g: &Group<Stack>, n: usize) -> Result<()> {
    let mut w = g.participant().watch();
    tokio::time::timeout(Duration::from_secs(10), async {
        while w.borrow_and_update().members.len() != n {
            w.changed().await?;
        }
        anyhow::Ok(())
    })
    .await
    .with_context(|| format!("waiting for {n} members"))?
}

/// The publisher sends `n` numbered messages (in rounds of 100, which every receiver drains);
/// every receiver gets each exactly once, in order.
async fn publish(
    publisher: &Group<Stack>,
    receivers: &[&Group<Stack>],
    from: u32,
    n: u32,
) -> Result<(u64, u64)> {
    let first_epoch = publisher.participant().view().epoch;
    let mut next = from;
    while next < from + n {
        let round = next..(next + 100).min(from + n);
        for i in round.clone() {
            publisher
                .send([Bytes::from(i.to_be_bytes().to_vec())])
                .await?;
        }
        for r in receivers {
            for i in round.clone() {
                let m = tokio::time::timeout(Duration::from_secs(5), r.recv())
                    .await
                    .context("a receiver got nothing")??;
                ensure!(m[..] == i.to_be_bytes(), "message {i} lost or out of order");
            }
        }
        next = round.end;
        // Paced (20,000 messages/s) so that a switch happens while messages flow.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok((first_epoch, publisher.participant().view().epoch))
}

/// The publisher's policy: service-side ordering exactly when there are several receivers.
async fn adapt(publisher: &Group<Stack>) -> Result<Option<Duration>> {
    let v = publisher.participant().view();
    let receivers = v.members.len() - 1;
    let want = usize::from(receivers > 1);
    if v.option == want {
        return Ok(None);
    }
    let t = Instant::now();
    publisher.propose(want).await?;
    Ok(Some(t.elapsed()))
}

pub async fn tour() -> Result<()> {
    println!("\n== Multi-party negotiation: a group agrees through a rendezvous store ==");
    let dir = std::env::temp_dir().join(format!("chunnel-demo-rdv-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run(&dir).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn run(dir: &std::path::Path) -> Result<()> {
    let store = Arc::new(SqliteStore::open(dir.join("groups.sqlite"))?);
    println!("store: embedded SQLite at {}", store.path().display());
    let publisher = member(&store, "publisher").await?;
    println!(
        "publisher created group `orders` (epoch {}): {}",
        publisher.participant().view().epoch,
        mode(&publisher)
    );
    let r1 = member(&store, "receiver-1").await?;
    members(&publisher, 2).await?;
    ensure!(
        adapt(&publisher).await?.is_none(),
        "one receiver must not switch"
    );
    publish(&publisher, &[&r1], 0, 1000).await?;
    println!("receiver-1 joined: 1,000 messages in order, {}", mode(&r1));

    let r2 = member(&store, "receiver-2").await?;
    members(&publisher, 3).await?;
    // Messages flow while the group switches.
    let both = [&r1, &r2];
    let (switch, sent) = tokio::join!(adapt(&publisher), publish(&publisher, &both, 1000, 2000));
    let (e0, e1) = sent?;
    let took = switch?.context("a second receiver must switch the group")?;
    ensure!(r2.participant().view().option == 1 && r1.participant().view().option == 1);
    println!(
        "receiver-2 joined -> the publisher proposed, all 3 voted, the group switched to {} \
         (epoch {}) in {:.1} ms; 2,000 messages sent meanwhile (epochs {e0} to {e1}) reached \
         both receivers exactly once, in order",
        mode(&r1),
        r1.participant().view().epoch,
        took.as_secs_f64() * 1e3
    );

    r2.leave().await?;
    members(&publisher, 2).await?;
    let took = adapt(&publisher)
        .await?
        .context("one receiver again must switch back")?;
    publish(&publisher, &[&r1], 3000, 1000).await?;
    println!(
        "receiver-2 left -> back to {} (epoch {}) in {:.1} ms; 1,000 more messages in order",
        mode(&r1),
        r1.participant().view().epoch,
        took.as_secs_f64() * 1e3
    );

    // A member whose only stack the group cannot use is refused; the group carries on.
    let odd = Group::join(
        store.clone(),
        "orders",
        "causal-receiver",
        "127.0.0.1:0".parse()?,
        select(Ordering(Mode::Service), Ordering(Mode::Service)),
        None,
        Config::default(),
    )
    .await;
    match odd {
        Err(e) => println!("a receiver offering only service-side ordering tries to join now: {e}"),
        Ok(_) => bail!("an incompatible receiver joined"),
    }
    publish(&publisher, &[&r1], 4000, 100).await?;
    println!("the group goes on: 100 more messages in order");
    r1.leave().await?;
    publisher.leave().await?;
    Ok(())
}
