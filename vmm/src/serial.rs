//! The guest's console: a 16550 UART (vm-superio) at 0x3f8, whose output is
//! split into lines, kept, and handed to an optional per-line callback.

use crate::bus::BusDeviceMut;
use iopath_devices::lock;
use std::io::Write;
use std::sync::{Arc, Mutex};
use vm_superio::{Serial, Trigger};

pub const PORT: u64 = 0x3f8;
pub const LEN: u64 = 8;

/// The UART's interrupt line is not wired: the guest polls.
pub struct NoInterrupt;
impl Trigger for NoInterrupt {
    type E = std::convert::Infallible;
    fn trigger(&self) -> Result<(), Self::E> {
        Ok(())
    }
}

pub type LineCallback = Box<dyn FnMut(&str) + Send>;

/// Collects the guest's output.
pub struct LineSink {
    partial: Vec<u8>,
    pub lines: Arc<Mutex<Vec<String>>>,
    on_line: Option<LineCallback>,
    /// Bytes kept at most, so a guest cannot exhaust host memory.
    limit: usize,
    total: usize,
    /// Told of every line, to ask the vCPU loop for its exit counts.
    pub marks: Option<Arc<crate::vcpu::ExitMarks>>,
}

impl LineSink {
    pub fn new(on_line: Option<LineCallback>) -> Self {
        LineSink {
            partial: Vec::new(),
            lines: Arc::new(Mutex::new(Vec::new())),
            on_line,
            limit: 64 << 20,
            total: 0,
            marks: None,
        }
    }

    fn push_line(&mut self) {
        let line = String::from_utf8_lossy(&self.partial).trim_end_matches('\r').to_string();
        if let Some(m) = &self.marks {
            m.on_line(&line, self.partial.len() as u64 + 1);
        }
        self.partial.clear();
        if let Some(cb) = self.on_line.as_mut() {
            cb(&line);
        }
        lock(&self.lines).push(line);
    }

    pub fn flush_partial(&mut self) {
        if !self.partial.is_empty() {
            self.push_line();
        }
    }
}

impl Write for LineSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for &b in buf {
            self.total += 1;
            if self.total > self.limit {
                break;
            }
            if b == b'\n' {
                self.push_line();
            } else {
                self.partial.push(b);
            }
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub struct Uart(pub Serial<NoInterrupt, vm_superio::serial::NoEvents, LineSink>);

impl Uart {
    pub fn new(sink: LineSink) -> Self {
        Uart(Serial::new(NoInterrupt, sink))
    }
}

impl BusDeviceMut for Uart {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let Some(d) = data.first_mut() {
            *d = self.0.read(offset as u8);
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Some(&v) = data.first() {
            let _ = self.0.write(offset as u8, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_split_into_lines() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        let sink = LineSink::new(Some(Box::new(move |l: &str| s2.lock().unwrap().push(l.to_string()))));
        let lines = sink.lines.clone();
        let mut u = Uart::new(sink);
        for b in b"@row a=1\r\nhello\n" {
            u.write(0, &[*b]);
        }
        assert_eq!(*lines.lock().unwrap(), vec!["@row a=1".to_string(), "hello".to_string()]);
        assert_eq!(seen.lock().unwrap().len(), 2);
        let mut lsr = [0u8];
        u.read(5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0, "transmitter holding register empty");
    }
}
