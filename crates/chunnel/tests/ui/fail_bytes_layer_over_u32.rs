// A layer that needs `Bytes` below it, stacked over a datapath carrying `u32`.
use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Error, stack};

struct U32Echo;
struct U32Conn;

impl Chunnel<()> for U32Echo {
    type Connection = U32Conn;
    async fn connect_wrap(&mut self, _: ()) -> Result<U32Conn, Error> {
        Ok(U32Conn)
    }
}

impl ChunnelConnection for U32Conn {
    type Data = u32;
    async fn send<B>(&self, _burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = u32> + Send,
        B::IntoIter: Send,
    {
        Ok(())
    }
    async fn recv<'a>(&'a self, _slots: &'a mut [Option<u32>]) -> Result<usize, Error> {
        Ok(0)
    }
}

/// Parses the `Bytes` of the connection below it.
struct Parse;

impl<C: ChunnelConnection<Data = Bytes>> Chunnel<C> for Parse {
    type Connection = C;
    async fn connect_wrap(&mut self, inner: C) -> Result<C, Error> {
        Ok(inner)
    }
}

fn main() {
    let mut stack = stack![Parse, U32Echo];
    // Fully qualified so that rustc names the mismatch itself; `stack.connect_wrap(())` is
    // rejected too (E0599), but only names the failing boundary.
    let _conn = Chunnel::<()>::connect_wrap(&mut stack, ());
}
