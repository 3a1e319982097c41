use super::*;
use crate::virtio::fake::{Driver, DATA, RAM};

#[test]
fn a_chain_comes_back_as_written() {
    let mut d = Driver::new(8);
    let mut q = d.queue(false);
    assert_eq!(q.pop(&d.mem).unwrap(), None);
    d.chain(2, &[(DATA, 16, false), (DATA + 0x100, 512, true), (DATA + 0x400, 1, true)]);
    d.publish(2);
    let c = q.pop(&d.mem).unwrap().unwrap();
    assert_eq!(c.head, 2);
    assert_eq!(
        c.descs,
        [
            Desc { addr: DATA, len: 16, write: false },
            Desc { addr: DATA + 0x100, len: 512, write: true },
            Desc { addr: DATA + 0x400, len: 1, write: true }
        ]
    );
    assert_eq!(q.pop(&d.mem).unwrap(), None);
    assert!(q.push_used(&d.mem, 2, 513).unwrap(), "no suppression: interrupt");
    assert_eq!(d.used_idx(), 1);
    assert_eq!(d.used_elem(0), (2, 513));
}

#[test]
fn indirect_tables_are_followed() {
    let mut d = Driver::new(8);
    let mut q = d.queue(false);
    let table = DATA + 0x8000;
    d.chain_at(table, 0, &[(DATA, 16, false), (DATA + 0x200, 4096, true), (DATA + 0x2000, 1, true)]);
    d.indirect(5, table, 3);
    d.publish(5);
    let c = q.pop(&d.mem).unwrap().unwrap();
    assert_eq!(c.head, 5);
    assert_eq!(c.descs.len(), 3);
    assert_eq!(c.descs[1], Desc { addr: DATA + 0x200, len: 4096, write: true });
}

#[test]
fn ring_indices_wrap() {
    let mut d = Driver::new(4);
    let mut q = d.queue(false);
    for k in 0..70000u32 {
        let head = (k % 4) as u16;
        d.chain(head, &[(DATA, 1, true)]);
        d.publish(head);
        let c = q.pop(&d.mem).unwrap().unwrap();
        assert_eq!(c.head, head);
        q.push_used(&d.mem, c.head, 1).unwrap();
    }
    assert_eq!(d.used_idx(), 70000u32 as u16);
}

#[test]
fn event_idx_suppresses_interrupts_as_the_driver_asks() {
    let mut d = Driver::new(8);
    let mut q = d.queue(true);
    for h in 0..4 {
        d.chain(h, &[(DATA, 1, true)]);
        d.publish(h);
    }
    // The driver wants an interrupt once the used index passes 2 (used_event = 2).
    d.set_used_event(2);
    let mut irq = Vec::new();
    for _ in 0..4 {
        let c = q.pop(&d.mem).unwrap().unwrap();
        irq.push(q.push_used(&d.mem, c.head, 1).unwrap());
    }
    assert_eq!(irq, [false, false, true, false]);
}

#[test]
fn event_idx_suppresses_notifications_as_the_device_asks() {
    let mut d = Driver::new(8);
    let mut q = d.queue(true);
    assert_eq!(q.set_notify(&d.mem, true).unwrap(), 0);
    assert_eq!(d.avail_event(), 0, "notify me for the next buffer");
    d.chain(0, &[(DATA, 1, true)]);
    d.publish(0);
    q.pop(&d.mem).unwrap().unwrap();
    q.set_notify(&d.mem, false).unwrap();
    // The driver's rule (2.7.10): notify iff avail_event lies in [old, new).
    let (old, new, ev) = (1u16, 2u16, d.avail_event());
    assert!(new.wrapping_sub(ev).wrapping_sub(1) >= new.wrapping_sub(old), "suppressed: avail_event {ev}");
    assert_eq!(q.set_notify(&d.mem, true).unwrap(), 1);
    assert_eq!(d.avail_event(), 1);
}

#[test]
fn without_event_idx_the_flags_suppress() {
    let mut d = Driver::new(8);
    let mut q = d.queue(false);
    q.set_notify(&d.mem, false).unwrap();
    assert_eq!(d.r16(crate::virtio::fake::USED), USED_F_NO_NOTIFY);
    d.w16(crate::virtio::fake::AVAIL, AVAIL_F_NO_INTERRUPT);
    d.chain(0, &[(DATA, 1, true)]);
    d.publish(0);
    q.pop(&d.mem).unwrap().unwrap();
    assert!(!q.push_used(&d.mem, 0, 1).unwrap());
}

/// One hostile ring: the error the device reports.
fn hostile(setup: impl FnOnce(&mut Driver)) -> QueueError {
    let mut d = Driver::new(8);
    let mut q = d.queue(false);
    setup(&mut d);
    q.pop(&d.mem).unwrap_err()
}

#[test]
fn hostile_rings_are_errors_not_panics() {
    // Head index beyond the queue.
    assert!(matches!(hostile(|d| d.publish(8)), QueueError::BadIndex { index: 8, .. }));
    // NEXT beyond the queue.
    let e = hostile(|d| {
        d.desc_at(DESC_T, 0, DATA, 1, DESC_F_NEXT, 200);
        d.publish(0)
    });
    assert!(matches!(e, QueueError::BadIndex { index: 200, .. }), "{e:?}");
    // A loop: 0 -> 1 -> 0.
    let e = hostile(|d| {
        d.desc_at(DESC_T, 0, DATA, 1, DESC_F_NEXT, 1);
        d.desc_at(DESC_T, 1, DATA, 1, DESC_F_NEXT, 0);
        d.publish(0)
    });
    assert_eq!(e, QueueError::TooLong(8));
    // A self-loop inside an indirect table.
    let e = hostile(|d| {
        d.desc_at(DATA + 0x8000, 0, DATA, 1, DESC_F_NEXT, 0);
        d.indirect(0, DATA + 0x8000, 4);
        d.publish(0)
    });
    assert_eq!(e, QueueError::TooLong(4));
    // Indirect inside indirect.
    let e = hostile(|d| {
        d.desc_at(DATA + 0x8000, 0, DATA + 0x9000, 16, DESC_F_INDIRECT, 0);
        d.indirect(0, DATA + 0x8000, 1);
        d.publish(0)
    });
    assert_eq!(e, QueueError::NestedIndirect);
    // Indirect tables: odd size, empty, huge, outside memory, with NEXT.
    for (len, addr, flags) in [
        (24, DATA, DESC_F_INDIRECT),
        (0, DATA, DESC_F_INDIRECT),
        (16 * (MAX_INDIRECT + 1), DATA, DESC_F_INDIRECT),
        (64, RAM - 32, DESC_F_INDIRECT),
        (64, DATA, DESC_F_INDIRECT | DESC_F_NEXT),
    ] {
        let e = hostile(|d| {
            d.desc_at(DESC_T, 0, addr, len, flags, 1);
            d.publish(0)
        });
        assert!(
            matches!(e, QueueError::BadIndirect(_) | QueueError::Memory { .. } | QueueError::IndirectNext),
            "{len} {addr:#x}: {e:?}"
        );
    }
    // Buffers beyond memory, and wrapping the address space.
    for (addr, len) in [(RAM - 4, 8), (RAM, 1), (u64::MAX - 2, 16)] {
        let e = hostile(|d| {
            d.desc_at(DESC_T, 0, addr, len, 0, 0);
            d.publish(0)
        });
        assert!(matches!(e, QueueError::Memory { .. }), "{e:?}");
    }
    // A readable buffer after a writable one.
    let e = hostile(|d| {
        d.chain(0, &[(DATA, 1, true), (DATA, 1, false)]);
        d.publish(0)
    });
    assert_eq!(e, QueueError::ReadAfterWrite);
    // The available index more than a ring ahead.
    let e = hostile(|d| d.w16(crate::virtio::fake::AVAIL + 2, 9));
    assert!(matches!(e, QueueError::AvailIndex { ahead: 9, .. }), "{e:?}");
}

#[test]
fn rings_outside_memory_or_misaligned_are_refused() {
    let d = Driver::new(8);
    let mut q = d.queue(false);
    q.used = RAM - 8;
    assert!(q.validate(&d.mem).is_err());
    q.used = crate::virtio::fake::USED + 2;
    assert!(q.validate(&d.mem).is_err());
    q.used = crate::virtio::fake::USED;
    q.num = 6;
    assert!(q.validate(&d.mem).is_err());
    let mut nq = Queue::new(8);
    assert_eq!(nq.pop(&d.mem), Err(QueueError::NotReady));
}

const DESC_T: u64 = crate::virtio::fake::DESC;
