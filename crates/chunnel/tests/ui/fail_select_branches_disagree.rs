// A select whose branches produce different `Data` types: `Parse` yields `u32`, `Noop` passes
// the datapath's `Bytes` through.
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Error, Noop, select, stack};

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
    let mut stack = stack![select(Parse, Noop), BytesEcho];
    // Fully qualified so that rustc names the mismatch itself; `stack.connect_wrap(())` is
    // rejected too (E0599), but only names the failing boundary.
    let _conn = Chunnel::<()>::connect_wrap(&mut stack, ());
}
