//! Issue 20: a stack of 16 two-way selects compiles with the default settings (the type grows
//! linearly in the number of selects) and carries a message over real UDP.

use bytes::Bytes;
use chunnel::{
    Chunnel, ConnectionExt, Either, Error, Layer, LayerState, Layered, Listener, Negotiate, Offers,
    Side, select, stack,
};
use chunnel_net::udp;

/// Appends its byte to every message sent; checks and strips it on receive.
#[derive(Clone, Copy, Debug)]
struct Mark(u8);

/// The same behaviour as a second type, so every select is between two different layers.
#[derive(Clone, Copy, Debug)]
struct Mark2(u8);

fn mark(b: u8, m: Bytes) -> Bytes {
    let mut v = m.to_vec();
    v.push(b);
    v.into()
}

fn unmark(b: u8, batch: &mut [Option<Bytes>]) -> Result<usize, Error> {
    for m in batch.iter_mut().flatten() {
        if m.last() != Some(&b) {
            return Err(Error::Malformed { what: "mark" });
        }
        m.truncate(m.len() - 1);
    }
    Ok(batch.len())
}

macro_rules! mark_layer {
    ($t:ident, $id:literal) => {
        impl Negotiate for $t {
            fn id(&self) -> &'static str {
                $id
            }
        }
        impl Layer for $t {
            type State = $t;
            fn state(&mut self) -> Result<$t, Error> {
                Ok(*self)
            }
        }
        impl LayerState for $t {
            type Data = Bytes;
            fn on_send(&self, m: Bytes) -> Bytes {
                mark(self.0, m)
            }
            fn on_recv(&self, batch: &mut [Option<Bytes>]) -> Result<usize, Error> {
                unmark(self.0, batch)
            }
        }
    };
}
mark_layer!(Mark, "test/mark/1");
mark_layer!(Mark2, "test/mark2/1");

fn type_name_of<T>(_: &T) -> &'static str {
    std::any::type_name::<T>()
}

#[tokio::test]
async fn sixteen_selects_over_udp() -> Result<(), Error> {
    // An echo server on plain UDP.
    let mut listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap()).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok(conn) = listener.accept().await {
            tokio::spawn(async move {
                while let Ok(m) = conn.recv_one().await {
                    let _ = conn.send_one(m).await;
                }
            });
        }
    });

    let mut client = stack![
        Layered(select(Mark(1), Mark2(0))),
        Layered(select(Mark(3), Mark2(2))),
        Layered(select(Mark(5), Mark2(4))),
        Layered(select(Mark(7), Mark2(6))),
        Layered(select(Mark(9), Mark2(8))),
        Layered(select(Mark(11), Mark2(10))),
        Layered(select(Mark(13), Mark2(12))),
        Layered(select(Mark(15), Mark2(14))),
        Layered(select(Mark(17), Mark2(16))),
        Layered(select(Mark(19), Mark2(18))),
        Layered(select(Mark(21), Mark2(20))),
        Layered(select(Mark(23), Mark2(22))),
        Layered(select(Mark(25), Mark2(24))),
        Layered(select(Mark(27), Mark2(26))),
        Layered(select(Mark(29), Mark2(28))),
        Layered(select(Mark(31), Mark2(30))),
        udp::Connect::new(addr)
    ];
    // Pick a mix of branches: the right one on every third select.
    let pick: Vec<u8> = (0..16).map(|i| u8::from(i % 3 == 0)).collect();
    client.apply(&chunnel::Pick::from_slice(&pick))?;
    let conn = client.connect_wrap(()).await?;

    // The type is linear in the number of selects: its name holds each layer once per select
    // (2^16 copies of the inner connection's name would be megabytes).
    let name = type_name_of(&conn);
    assert!(name.len() < 8 * 1024, "type name of {} bytes", name.len());

    conn.send_one(Bytes::from_static(b"through sixteen selects"))
        .await?;
    let back = tokio::time::timeout(std::time::Duration::from_secs(5), conn.recv_one())
        .await
        .expect("echo")?;
    assert_eq!(back, "through sixteen selects");

    // The outermost select built the branch the pick named.
    let top: Side = match conn.state() {
        Either::Left(_) => Side::Left,
        Either::Right(_) => Side::Right,
    };
    assert_eq!(top, Side::Right);
    Ok(())
}
