//! One frontend's session: the requests the `vhost` crate's
//! `BackendReqHandler` decodes (header, sizes, fd counts) land here, and
//! each value in them is checked before use: queue indexes, ring sizes and
//! bases, ring addresses (translated into guest memory, whole rings inside
//! it), feature bits (only those offered), memory tables
//! ([`MemTable::map`]). A refused request is an `Err`: the crate answers it
//! with an error reply where the frontend asked for one (REPLY_ACK), and the
//! session ends with a log line ([`VhostUserBackend::session`](super::VhostUserBackend::session)).
//!
//! Everything the frontend gave lives here or in [`Dev`] only while the
//! session does: [`Session::end`] (also on drop) stops the ring threads,
//! which hold the kick fds, and drops the memory and the call and error fds.

use super::dev::{eventfd, Dev};
use super::inflight::{self, Region};
use super::mem::MemTable;
use super::worker::Worker;
use super::{FEATURES, F_PROTOCOL_FEATURES, NUM_QUEUES};
use iopath_devices::virtio::pci::{NotifyMode, F_EVENT_IDX};
use iopath_devices::virtio::queue::MAX_QUEUE_SIZE;
use std::fs::File;
use std::sync::{Arc, Mutex};
use vhost::vhost_user::message::*;
use vhost::vhost_user::{Backend, Error as VuError, GpuBackend, Result as VuResult, VhostUserBackendReqHandlerMut};

/// The frontend's side of the device during one session.
pub(super) struct Session {
    dev: Arc<Mutex<Dev>>,
    notify: NotifyMode,
    /// Acked virtio features (SET_FEATURES).
    features: u64,
    table: Option<MemTable>,
    /// Ring addresses as the frontend gave them (desc, avail, used; its
    /// virtual addresses), translated when the ring starts.
    addrs: [Option<(u64, u64, u64)>; NUM_QUEUES],
    workers: [Option<Worker>; NUM_QUEUES],
    /// SET_VRING_NUM came for the ring: its addresses can be checked.
    sized: [bool; NUM_QUEUES],
    /// The in-flight region (SET_INFLIGHT_FD): each ring that starts takes
    /// its part, resubmits what it names and notes what it takes.
    inflight: Option<Region>,
    /// Why the last request was refused, for the session's log line.
    pub(super) refusal: Option<String>,
    /// What the frontend's memory is registered under with the SIGBUS handler.
    owner: Arc<crate::sigbus::Owner>,
}

impl Session {
    pub(super) fn new(dev: Arc<Mutex<Dev>>, notify: NotifyMode, owner: Arc<crate::sigbus::Owner>) -> Self {
        iopath_devices::lock(&dev).st.sessions += 1;
        Session {
            dev,
            notify,
            features: 0,
            table: None,
            addrs: Default::default(),
            workers: Default::default(),
            sized: [false; NUM_QUEUES],
            inflight: None,
            refusal: None,
            owner,
        }
    }

    /// Why the session ends if the frontend shrank memory of its table.
    pub(super) fn shrunk(&self) -> Option<crate::Error> {
        self.table.as_ref().and_then(|t| t.shrunk()).or_else(|| self.inflight.as_ref().and_then(|r| r.shrunk()))
    }

    fn dev(&self) -> std::sync::MutexGuard<'_, Dev> {
        iopath_devices::lock(&self.dev)
    }

    /// Refuses the request: counts it, keeps why, and returns the error.
    fn refuse<T>(&mut self, why: String) -> VuResult<T> {
        self.dev().st.refused += 1;
        self.refusal = Some(why);
        Err(VuError::InvalidParam)
    }

    /// The ring `index` names, if there is one.
    fn ring(&mut self, index: u32) -> VuResult<usize> {
        let n = self.dev().rings.len();
        match usize::try_from(index) {
            Ok(i) if i < n => Ok(i),
            _ => self.refuse(format!("queue index {index} (the device has {n})")),
        }
    }

    /// Stops ring `i`'s thread, if it runs (the kick fd goes with it).
    fn stop(&mut self, i: usize) {
        if let Some(w) = self.workers[i].take() {
            w.stop();
        }
        if let Some(r) = self.dev().rings.get_mut(i) {
            r.q.ready = false;
        }
    }

    /// Refuses a change to ring `i` while it runs.
    fn stopped(&mut self, i: usize, what: &str) -> VuResult<()> {
        if self.workers[i].is_some() {
            return self.refuse(format!("{what} of queue {i} while it runs"));
        }
        Ok(())
    }

    /// Points ring `i`'s queue at its rings in guest memory: every ring
    /// whole inside one region, aligned, and inside the mapped memory.
    fn place(&mut self, i: usize) -> VuResult<()> {
        let Some((desc, avail, used)) = self.addrs[i] else {
            return self.refuse(format!("queue {i} started before its addresses were set"));
        };
        let Some(t) = &self.table else { return self.refuse(format!("queue {i} started before any memory")) };
        let mut d = iopath_devices::lock(&self.dev);
        let n = d.rings[i].q.num as u64;
        let gpas = (t.gpa(desc, 16 * n), t.gpa(avail, 6 + 2 * n), t.gpa(used, 6 + 8 * n));
        let (Some(dg), Some(ag), Some(ug)) = gpas else {
            drop(d);
            return self.refuse(format!(
                "queue {i}: rings at {desc:#x}/{avail:#x}/{used:#x} (size {n}) are not inside the memory table"
            ));
        };
        let q = &mut d.rings[i].q;
        (q.desc, q.avail, q.used) = (dg, ag, ug);
        if let Err(e) = q.validate(&t.mem) {
            drop(d);
            return self.refuse(format!("queue {i}: {e}"));
        }
        Ok(())
    }

    /// Ring `i` starts on its part of the in-flight region, if there is
    /// one: the region set up (new) or repaired, the used index taken from
    /// the used ring, the next available one from the region (the chains
    /// in flight follow the used ones), and those chains queued for
    /// resubmission. Without a region the ring takes the vring base.
    fn resume(&mut self, i: usize) -> VuResult<()> {
        let view = self.inflight.as_ref().and_then(|r| r.ring(i));
        let mut d = self.dev();
        let Some(mut view) = view else {
            d.rings[i].inflight = None;
            d.rings[i].resubmit.clear();
            return Ok(());
        };
        let Some(mem) = d.mem.clone() else {
            drop(d);
            return self.refuse(format!("queue {i} started before any memory"));
        };
        let r = &mut d.rings[i];
        let resumed =
            r.q.used_idx(&mem)
                .map_err(|e| e.to_string())
                .and_then(|used| view.start(r.q.num, used).map(|res| (used, res)).map_err(|e| e.to_string()));
        let (used, res) = match resumed {
            Ok(x) => x,
            Err(why) => {
                drop(d);
                return self.refuse(format!("queue {i}: in-flight region: {why}"));
            }
        };
        r.q.next_used = used;
        if let Some(a) = res.next_avail {
            r.q.next_avail = a;
        }
        if !res.resubmit.is_empty() {
            log::warn!(
                "vhost-user-blk: queue {i}: resubmitting {} request(s) a previous device process left in flight",
                res.resubmit.len()
            );
        }
        r.resubmit = res.resubmit.into();
        r.inflight = Some(view);
        // An earlier process noted in this region (a used index came before):
        // the driver is owed a signal, paid below or at SET_VRING_CALL.
        r.owe_call = res.next_avail.is_some();
        Ok(())
    }

    /// Signals ring `i`'s call fd if the driver is owed a signal (see
    /// [`Ring::owe_call`](super::dev::Ring)) and there is one: a spurious
    /// interrupt costs the driver a look at its used ring, a lost one a hang.
    fn pay_call(&mut self, i: usize) {
        let mut d = self.dev();
        let r = &mut d.rings[i];
        if let (true, Some(c)) = (r.owe_call, &r.call) {
            super::dev::signal(c);
            r.owe_call = false;
        }
    }

    /// Ends the session: stops the ring threads, drops the memory and
    /// every fd the frontend gave. Idempotent.
    pub(super) fn end(&mut self) {
        for i in 0..NUM_QUEUES {
            self.stop(i);
        }
        self.table = None;
        self.inflight = None;
        self.addrs = Default::default();
        self.sized = [false; NUM_QUEUES];
        self.features = 0;
        self.dev().clear();
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.end();
    }
}

impl VhostUserBackendReqHandlerMut for Session {
    fn set_owner(&mut self) -> VuResult<()> {
        Ok(())
    }

    fn reset_owner(&mut self) -> VuResult<()> {
        self.end();
        Ok(())
    }

    fn reset_device(&mut self) -> VuResult<()> {
        self.end();
        Ok(())
    }

    fn get_features(&mut self) -> VuResult<u64> {
        Ok(FEATURES)
    }

    fn set_features(&mut self, features: u64) -> VuResult<()> {
        if features & !FEATURES != 0 {
            return self.refuse(format!("features {:#x} not offered", features & !FEATURES));
        }
        self.features = features;
        let mut d = self.dev();
        for r in &mut d.rings {
            r.q.event_idx = features & F_EVENT_IDX != 0;
            // Without PROTOCOL_FEATURES a ring is enabled as it starts.
            if features & F_PROTOCOL_FEATURES == 0 {
                r.enabled = true;
            }
        }
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy: Option<bool>,
    ) -> VuResult<Option<Vec<u64>>> {
        let t = match MemTable::map(ctx, files, &self.owner) {
            Ok(t) => t,
            Err(why) => return self.refuse(format!("SET_MEM_TABLE: {why}")),
        };
        let mut d = self.dev();
        d.mem = Some(t.mem.clone());
        d.st.mem_tables += 1;
        drop(d);
        // The old mapping goes once no ring thread's pass holds it.
        self.table = Some(t);
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VuResult<()> {
        let i = self.ring(index)?;
        self.stopped(i, "SET_VRING_NUM")?;
        if num == 0 || num > MAX_QUEUE_SIZE as u32 || !num.is_power_of_two() {
            return self.refuse(format!("queue {i}: size {num} (a power of 2, 1 ..= {MAX_QUEUE_SIZE})"));
        }
        self.dev().rings[i].q.num = num as u16;
        self.sized[i] = true;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VuResult<()> {
        let i = self.ring(index)?;
        self.stopped(i, "SET_VRING_ADDR")?;
        self.addrs[i] = Some((descriptor, available, used));
        // Checked now if the ring's size is known, so the frontend hears of
        // a bad address at once; else (ADDR before NUM) when it starts.
        if self.sized[i] {
            self.place(i)?;
        }
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VuResult<()> {
        let i = self.ring(index)?;
        self.stopped(i, "SET_VRING_BASE")?;
        let Ok(b) = u16::try_from(base) else { return self.refuse(format!("queue {i}: base {base} > 65535")) };
        // Every request taken was completed before the ring stopped, so the
        // used index starts where the available one does.
        let q = &mut self.dev().rings[i].q;
        (q.next_avail, q.next_used) = (b, b);
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VuResult<VhostUserVringState> {
        let i = self.ring(index)?;
        self.stop(i);
        let mut d = self.dev();
        let r = &mut d.rings[i];
        r.broken = false;
        Ok(VhostUserVringState::new(index, r.q.next_avail as u32))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let i = self.ring(index as u32)?;
        let Some(kick) = fd else {
            return self.refuse(format!("queue {i}: no kick fd (polling without one is not offered)"));
        };
        if let Err(why) = eventfd(&kick) {
            return self.refuse(format!("queue {i}: the kick fd: {why}"));
        }
        self.stop(i);
        self.place(i)?;
        self.resume(i)?;
        {
            let mut d = self.dev();
            let r = &mut d.rings[i];
            r.q.ready = true;
            r.broken = false;
        }
        let poll = self.notify == NotifyMode::Poll;
        self.pay_call(i);
        match Worker::start(self.dev.clone(), i, kick, poll) {
            Ok(w) => {
                w.nudge(); // requests made before the kick fd came
                self.workers[i] = Some(w);
                Ok(())
            }
            Err(e) => {
                self.dev().rings[i].q.ready = false;
                self.refuse(format!("queue {i}: its thread: {e}"))
            }
        }
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let i = self.ring(index as u32)?;
        if let Some(Err(why)) = fd.as_ref().map(eventfd) {
            return self.refuse(format!("queue {i}: the call fd: {why}"));
        }
        self.dev().rings[i].call = fd.map(Arc::new);
        self.pay_call(i);
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let i = self.ring(index as u32)?;
        if let Some(Err(why)) = fd.as_ref().map(eventfd) {
            return self.refuse(format!("queue {i}: the error fd: {why}"));
        }
        self.dev().rings[i].err = fd;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VuResult<VhostUserProtocolFeatures> {
        Ok(super::PROTOCOL_FEATURES)
    }

    fn set_protocol_features(&mut self, features: u64) -> VuResult<()> {
        let offered = (super::PROTOCOL_FEATURES | VhostUserProtocolFeatures::REPLY_ACK).bits();
        if features & !offered != 0 {
            return self.refuse(format!("protocol features {:#x} not offered", features & !offered));
        }
        Ok(())
    }

    fn get_queue_num(&mut self) -> VuResult<u64> {
        Ok(self.dev().rings.len() as u64)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        let i = self.ring(index)?;
        self.dev().rings[i].enabled = enable;
        if let Some(w) = &self.workers[i] {
            w.nudge();
        }
        Ok(())
    }

    fn get_config(&mut self, offset: u32, size: u32, _flags: VhostUserConfigFlags) -> VuResult<Vec<u8>> {
        // The crate bounds offset + size by 4 KiB; past the fields, zeros.
        let cfg = {
            let d = self.dev();
            super::config_space(d.blk.size, d.rings.len())
        };
        let mut out = vec![0u8; size as usize];
        for (k, b) in out.iter_mut().enumerate() {
            *b = cfg.get(offset as usize + k).copied().unwrap_or(0);
        }
        Ok(out)
    }

    fn set_config(&mut self, offset: u32, _buf: &[u8], _flags: VhostUserConfigFlags) -> VuResult<()> {
        self.refuse(format!("SET_CONFIG at {offset}: the configuration space is read-only"))
    }

    fn set_backend_req_fd(&mut self, _backend: Backend) {}

    fn set_gpu_socket(&mut self, _gpu: GpuBackend) -> VuResult<()> {
        self.refuse("GPU_SET_SOCKET: not a GPU".into())
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VuResult<File> {
        self.refuse("GET_SHARED_OBJECT: not offered".into())
    }

    fn get_inflight_fd(&mut self, m: &VhostUserInflight) -> VuResult<(VhostUserInflight, File)> {
        let queues = self.dev().rings.len();
        match inflight::create(m, queues) {
            Ok(r) => Ok(r),
            Err(why) => self.refuse(format!("GET_INFLIGHT_FD: {why}")),
        }
    }

    fn set_inflight_fd(&mut self, m: &VhostUserInflight, file: File) -> VuResult<()> {
        if let Some(i) = self.workers.iter().position(Option::is_some) {
            return self.refuse(format!("SET_INFLIGHT_FD while queue {i} runs"));
        }
        let queues = self.dev().rings.len();
        match Region::map(m, file, queues, &self.owner) {
            Ok(r) => {
                self.inflight = Some(r);
                self.dev().st.inflight_regions += 1;
                Ok(())
            }
            Err(why) => self.refuse(format!("SET_INFLIGHT_FD: {why}")),
        }
    }

    fn get_max_mem_slots(&mut self) -> VuResult<u64> {
        self.refuse("GET_MAX_MEM_SLOTS: not offered".into())
    }

    fn add_mem_region(
        &mut self,
        _region: &VhostUserSingleMemoryRegion,
        _fd: File,
        _postcopy: Option<bool>,
    ) -> VuResult<Option<u64>> {
        self.refuse("ADD_MEM_REG: not offered".into())
    }

    fn remove_mem_region(&mut self, _region: &VhostUserSingleMemoryRegion) -> VuResult<()> {
        self.refuse("REM_MEM_REG: not offered".into())
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VuResult<Option<File>> {
        self.refuse("SET_DEVICE_STATE_FD: not offered".into())
    }

    fn check_device_state(&mut self) -> VuResult<()> {
        self.refuse("CHECK_DEVICE_STATE: not offered".into())
    }

    fn get_shmem_config(&mut self) -> VuResult<VhostUserShMemConfig> {
        self.refuse("GET_SHMEM_CONFIG: not offered".into())
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> VuResult<()> {
        self.refuse("SET_LOG_BASE: not offered".into())
    }
}
