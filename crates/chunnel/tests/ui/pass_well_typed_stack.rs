// The pieces of the `fail_*` cases, stacked so that every boundary lines up.
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Error, Identity, Noop, select, stack};

struct BytesEcho;
struct BytesConn;

impl chunnel::Negotiate for BytesEcho {
    fn id(&self) -> &'static str {
        "ui/bytes-echo/1"
    }
}

impl Chunnel<()> for BytesEcho {
    type Connection = BytesConn;
    async fn connect_wrap(&mut self, _: ()) -> Result<BytesConn, Error> {
        Ok(BytesConn)
    }
}

impl ChunnelConnection for BytesConn {
    type Data = Bytes;
    async fn send<B>(&self, _burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        Ok(())
    }
    async fn recv<'a>(&'a self, _slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        Ok(0)
    }
}

/// Turns the `Bytes` below it into `u32`s.
struct Parse;
struct ParseConn<C>(C);

impl chunnel::Negotiate for Parse {
    fn id(&self) -> &'static str {
        "ui/parse/1"
    }
}

impl<C: ChunnelConnection<Data = Bytes>> Chunnel<C> for Parse {
    type Connection = ParseConn<C>;
    async fn connect_wrap(&mut self, inner: C) -> Result<ParseConn<C>, Error> {
        Ok(ParseConn(inner))
    }
}

impl<C: ChunnelConnection<Data = Bytes>> ChunnelConnection for ParseConn<C> {
    type Data = u32;
    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = u32> + Send,
        B::IntoIter: Send,
    {
        let raw = burst
            .into_iter()
            .map(|n| Bytes::copy_from_slice(&n.to_be_bytes()));
        self.0.send(raw).await
    }
    async fn recv<'a>(&'a self, _slots: &'a mut [Option<u32>]) -> Result<usize, Error> {
        Ok(0)
    }
}

fn main() {
    // `Parse` over `Bytes`, and a select whose branches both carry `u32` (or both `Bytes`).
    let mut stack = stack![
        select(Noop, stack![Noop, Noop]),
        Parse,
        select(Noop, Identity),
        BytesEcho
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let conn = rt.block_on(stack.connect_wrap(())).unwrap();
    rt.block_on(conn.send([1u32, 2, 3])).unwrap();
}
