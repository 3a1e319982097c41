//! ioregionfd, as an extension of vfio-user: BAR accesses on region fds.
//!
//! ioregionfd (a proposed KVM API, RFC v3 2021, never merged) writes a guest
//! access to a region as a 32-byte `ioregionfd_cmd` on the region's fd; the
//! device answers reads and non-posted writes with a 32-byte
//! `ioregionfd_resp`. Posted writes (KVM_IOREGION_POSTED_WRITES) get no
//! response: the vCPU goes on at once, and order on the fd is kept.
//!
//! Why here and not a protocol of its own: ioregionfd only carries BAR
//! accesses. Its regions are announced through vfio-user's
//! GET_REGION_IO_FDS (type IOREGIONFD, which the vfio-user spec defines) on
//! fds the device process creates, as the RFC's review asked, and
//! everything else (configuration space, DMA maps, interrupts, reset) stays
//! vfio-user messages on the same session. So the transports "ioregionfd"
//! and "ioregionfd-posted" are the vfio-user proxy and server with a
//! different [`IoFds`] offer; this module owns only what ioregionfd adds:
//! the codec ([`wire`]), the region server thread ([`spawn_server`]; a
//! session's regions and their threads end with the session) and the
//! region client ([`RegionClient`]).
//!
//! Upstream KVM has no KVM_SET_IOREGION (0x49 is KVM_SET_USER_MEMORY_REGION2
//! there, and capability 191 is KVM_CAP_SYS_HYPERV_CPUID), so the VMM plays
//! KVM's part in userspace: a vCPU exit on a region becomes a command on its
//! fd ([`RegionClient`]). `iopath_vmm::kvm::ioregionfd_support` looks for a
//! patched kernel.

mod client;
mod server;
pub mod wire;

pub use client::RegionClient;
pub use server::spawn_server;
pub(crate) use server::Region;

use super::{IoFds, ProxyConfig, VfioUserProxy, VfioUserServer};
use crate::function::PciFunction;
use crate::process::DeviceProcess;
use crate::transport::{FunctionTransport, Server};
use crate::Result;
use iopath_devices::irq::IrqLines;
use iopath_devices::SharedDevice;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

/// The proxy counter of commands sent on region fds.
pub const COMMANDS: &str = "ioregionfd.commands";

/// vfio-user with every BAR on an ioregionfd region; `posted` makes writes
/// posted ("ioregionfd-posted").
pub struct IoRegionFd {
    pub posted: bool,
}

impl FunctionTransport for IoRegionFd {
    fn name(&self) -> &'static str {
        if self.posted {
            "ioregionfd-posted"
        } else {
            "ioregionfd"
        }
    }

    fn connect(&self, sock: UnixStream, child: Option<DeviceProcess>, name: &str) -> Result<SharedDevice> {
        VfioUserProxy::shared(sock, child, name)
    }

    fn connect_with(
        &self,
        sock: UnixStream,
        child: Option<DeviceProcess>,
        name: &str,
        cfg: &ProxyConfig,
    ) -> Result<SharedDevice> {
        VfioUserProxy::shared_with(sock, child, name, *cfg)
    }

    fn offers_state_memory(&self) -> bool {
        true
    }

    fn server(&self, f: Arc<Mutex<PciFunction>>, irq: Arc<IrqLines>) -> Result<Box<dyn Server>> {
        Ok(Box::new(VfioUserServer::new(f, irq, IoFds::IoRegionFds { posted: self.posted })))
    }

    fn crossings(&self) -> (&'static str, &'static str) {
        (COMMANDS, "ioregionfd cmds")
    }

    /// As vfio-user: the control channel is a vfio-user session.
    fn refuse(&self, sock: &UnixStream) -> Result<()> {
        crate::vfio_user::refuse_busy(sock)
    }
}

#[cfg(test)]
mod tests {
    use super::wire::{Cmd, CMD_READ};
    use super::*;
    use crate::testing::testdev;
    use std::io::{Read, Write};

    #[test]
    fn sync_and_posted_writes_reach_the_device_in_order() {
        let f = testdev();
        for posted in [false, true] {
            let (a, b) = UnixStream::pair().unwrap();
            let h = spawn_server(b, f.clone(), 0, 0, 4096).unwrap();
            let mut c = RegionClient::new(a, 0, 4096, 0, posted);
            c.write(0, 1, 0).unwrap(); // select test 0
            for _ in 0..100 {
                c.write(2048, 1, 0xfa).unwrap();
            }
            // A read is answered after every posted write before it.
            assert_eq!(c.read(12, 4).unwrap(), 100);
            assert!(c.covers(4092, 4) && !c.covers(4093, 4));
            drop(c);
            h.join().unwrap();
        }
    }

    #[test]
    fn a_command_outside_the_region_closes_it() {
        let f = testdev();
        let (mut a, b) = UnixStream::pair().unwrap();
        let h = spawn_server(b, f, 0, 0, 16).unwrap();
        let c = Cmd { cmd: CMD_READ, size_exponent: 3, resp: true, user_data: 0, offset: 12, data: 0 };
        a.write_all(&c.encode()).unwrap();
        h.join().unwrap();
        let mut r = [0u8; 32];
        assert_eq!(a.read(&mut r).unwrap(), 0, "channel closed, no reply");
    }
}
