//! [`Kind`]: a pass-through layer with one exact capability of kind `k` carrying a number,
//! and [`kinds!`](crate::kinds): twelve two-way selects of them. Offers of base 0 against a
//! server of base 0 are decided in microseconds; offers of base 1 are compatible only after
//! a search of tens of milliseconds (the slow decisions of the flood tests and benchmark).

use bytes::Bytes;
use chunnel::{Capability, Error, Layer, LayerState, Negotiate};

/// A pass-through layer whose one exact capability of kind `k` carries a number.
#[derive(Clone, Copy, Debug)]
pub struct Kind(pub u32);

impl Negotiate for Kind {
    fn id(&self) -> &'static str {
        "chunnel-test/kind/1"
    }
    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::exact("k", [self.0.to_string()])]
    }
}

impl Layer for Kind {
    type State = Kind;
    fn state(&mut self) -> Result<Kind, Error> {
        Ok(*self)
    }
}

impl LayerState for Kind {
    type Data = Bytes;
    fn on_send(&self, m: Bytes) -> Bytes {
        m
    }
    fn on_recv(&self, batch: &mut [Option<Bytes>]) -> Result<usize, Error> {
        Ok(batch.len())
    }
}

/// Twelve two-way selects of [`Kind`]s (`Layered`, so the type grows linearly); select `i`
/// offers `base + 2i` and `base + 2i + 1`.
#[macro_export]
macro_rules! kinds {
    ($base:expr) => {{
        use ::chunnel::{Layered, select, stack};
        use $crate::kind::Kind;
        let b: u32 = $base;
        let s = |i: u32| Layered(select(Kind(b + 2 * i), Kind(b + 2 * i + 1)));
        stack![
            s(0),
            s(1),
            s(2),
            s(3),
            s(4),
            s(5),
            s(6),
            s(7),
            s(8),
            s(9),
            s(10),
            s(11)
        ]
    }};
}
