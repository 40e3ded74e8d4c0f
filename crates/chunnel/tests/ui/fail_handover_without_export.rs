// A connection with state that claims a handover without saying what it hands over: a
// branch of a reconfigurable select must implement `export` and `import` (there are no
// defaults, so buffered messages cannot be lost at a switch by omission).
use std::collections::VecDeque;
use std::sync::Mutex;

use chunnel::{ChunnelConnection, Error, Handover};

/// Buffers what it receives.
struct Buffering(Mutex<VecDeque<u32>>);

impl ChunnelConnection for Buffering {
    type Data = u32;
    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = u32> + Send,
        B::IntoIter: Send,
    {
        self.0.lock().unwrap().extend(burst);
        Ok(())
    }
    async fn recv<'a>(&'a self, slots: &'a mut [Option<u32>]) -> Result<usize, Error> {
        slots[0] = self.0.lock().unwrap().pop_front();
        Ok(usize::from(slots[0].is_some()))
    }
}

impl Handover for Buffering {}

fn main() {}
