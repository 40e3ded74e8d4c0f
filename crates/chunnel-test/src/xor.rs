//! [`Xor`]: a byte layer with an exact-match capability, for negotiation and
//! reconfiguration tests. Peers with different keys garble each other's messages, so a
//! message handled by the wrong stack is caught by comparing contents.

use bytes::Bytes;
use chunnel::{Capability, Chunnel, ChunnelConnection, Error, Handover, Negotiate};

/// XORs every byte with its key; capability `xor = {key}`, exact.
#[derive(Clone, Copy, Debug)]
pub struct Xor(pub u8);

/// The connection of an [`Xor`] layer.
#[derive(Debug)]
pub struct XorConn<C> {
    inner: C,
    key: u8,
}

/// `m` with every byte XORed with `key` (a copy).
pub fn xor(m: &Bytes, key: u8) -> Bytes {
    m.iter().map(|b| b ^ key).collect::<Vec<u8>>().into()
}

impl Negotiate for Xor {
    fn id(&self) -> &'static str {
        "test/xor/1"
    }
    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::exact("xor", [self.0.to_string()])]
    }
}

impl<C: ChunnelConnection<Data = Bytes> + Send> Chunnel<C> for Xor {
    type Connection = XorConn<C>;
    async fn connect_wrap(&mut self, inner: C) -> Result<XorConn<C>, Error> {
        Ok(XorConn { inner, key: self.0 })
    }
}

impl<C: ChunnelConnection<Data = Bytes>> ChunnelConnection for XorConn<C> {
    type Data = Bytes;
    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        let v: Vec<Bytes> = burst.into_iter().map(|m| xor(&m, self.key)).collect();
        self.inner.send(v).await
    }
    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        let n = self.inner.recv(slots).await?;
        for s in slots[..n].iter_mut().flatten() {
            *s = xor(s, self.key);
        }
        Ok(n)
    }
}

/// No state to hand over: the key is the implementation.
impl<C: ChunnelConnection<Data = Bytes>> Handover for XorConn<C> {
    fn export(&self, _: &mut chunnel::Handoff<Self::Data>) {}
    fn import(&self, _: &mut chunnel::Handoff<Self::Data>) {}
}
