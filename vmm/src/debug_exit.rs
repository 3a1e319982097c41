//! isa-debug-exit at port 0xf4 (1 byte), with QEMU's semantics: a write of
//! `v` ends the run with exit status `(v << 1) | 1`.

use crate::bus::BusDevice;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

pub const PORT: u64 = 0xf4;

/// The status a guest wrote, or -1 while the guest runs.
#[derive(Clone)]
pub struct ExitStatus(pub Arc<AtomicI32>);

impl ExitStatus {
    pub fn new() -> Self {
        ExitStatus(Arc::new(AtomicI32::new(-1)))
    }
    pub fn get(&self) -> Option<i32> {
        let v = self.0.load(Ordering::Acquire);
        (v >= 0).then_some(v)
    }
}

impl Default for ExitStatus {
    fn default() -> Self {
        Self::new()
    }
}

pub struct DebugExit(pub ExitStatus);

impl BusDevice for DebugExit {
    fn read(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }
    fn write(&self, _offset: u64, data: &[u8]) {
        let v = data.first().copied().unwrap_or(0) as i32;
        self.0 .0.store((v << 1) | 1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_is_value_shifted_or_one() {
        let s = ExitStatus::new();
        assert_eq!(s.get(), None);
        DebugExit(s.clone()).write(0, &[0x3f]);
        assert_eq!(s.get(), Some(0x7f));
        DebugExit(s.clone()).write(0, &[0]);
        assert_eq!(s.get(), Some(1));
    }
}
