// A base datapath (`Chunnel<()>`) put on top of a stack instead of at the bottom.
use chunnel::{Chunnel, ChunnelConnection, Error, Noop, stack};

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

fn main() {
    let mut stack = stack![U32Echo, Noop, U32Echo];
    // Fully qualified so that rustc names the mismatch itself; `stack.connect_wrap(())` is
    // rejected too (E0599), but only names the failing boundary.
    let _conn = Chunnel::<()>::connect_wrap(&mut stack, ());
}
