//! Interrupts: GET_IRQ_INFO and SET_IRQS.

use super::*;

const IRQ_SET_SIZE: usize = 20;

pub const IRQ_INFO_EVENTFD: u32 = 1 << 0;
pub const IRQ_INFO_MASKABLE: u32 = 1 << 1;
pub const IRQ_INFO_AUTOMASKED: u32 = 1 << 2;
pub const IRQ_INFO_NORESIZE: u32 = 1 << 3;

pub const IRQ_SET_DATA_NONE: u32 = 1 << 0;
pub const IRQ_SET_DATA_BOOL: u32 = 1 << 1;
pub const IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
pub const IRQ_SET_ACTION_MASK: u32 = 1 << 3;
pub const IRQ_SET_ACTION_UNMASK: u32 = 1 << 4;
pub const IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;
const IRQ_SET_DATA_ALL: u32 = IRQ_SET_DATA_NONE | IRQ_SET_DATA_BOOL | IRQ_SET_DATA_EVENTFD;
const IRQ_SET_ACTION_ALL: u32 = IRQ_SET_ACTION_MASK | IRQ_SET_ACTION_UNMASK | IRQ_SET_ACTION_TRIGGER;

pub const PCI_INTX_IRQ_INDEX: u32 = 0;
pub const PCI_MSI_IRQ_INDEX: u32 = 1;
pub const PCI_MSIX_IRQ_INDEX: u32 = 2;
pub const PCI_ERR_IRQ_INDEX: u32 = 3;
pub const PCI_REQ_IRQ_INDEX: u32 = 4;
pub const PCI_NUM_IRQS: u32 = 5;

/// GET_IRQ_INFO request and reply (16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IrqInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub count: u32,
}

impl IrqInfo {
    pub fn request(index: u32) -> Self {
        IrqInfo { argsz: INFO16_SIZE as u32, flags: 0, index, count: 0 }
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("irq_info", b, INFO16_SIZE, true)?;
        let i = IrqInfo { argsz: r.u32()?, flags: r.u32()?, index: r.u32()?, count: r.u32()? };
        check_argsz("irq_info", i.argsz, INFO16_SIZE).map(|_| i)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(INFO16_SIZE).u32(self.argsz).u32(self.flags).u32(self.index).u32(self.count).0
    }
}

/// SET_IRQS request (20 bytes + data; no reply payload). `argsz` is the
/// request size, computed on encode and checked on decode. `data` is `count`
/// bool bytes for DATA_BOOL, else empty (DATA_EVENTFD's fds are out of band).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IrqSet {
    pub flags: u32,
    pub index: u32,
    pub start: u32,
    pub count: u32,
    pub data: Vec<u8>,
}

impl IrqSet {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("set_irqs", b, IRQ_SET_SIZE, false)?;
        let (argsz, flags, index, start, count) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        if argsz as usize != b.len() {
            return Err(invalid(format!("set_irqs: argsz {argsz} != payload size {}", b.len())));
        }
        let (data, action) = (flags & IRQ_SET_DATA_ALL, flags & IRQ_SET_ACTION_ALL);
        if flags & !(IRQ_SET_DATA_ALL | IRQ_SET_ACTION_ALL) != 0 || data.count_ones() != 1 || action.count_ones() != 1 {
            return Err(invalid(format!("set_irqs: flags {flags:#x} need exactly one DATA_* and one ACTION_*")));
        }
        if start.checked_add(count).is_none() {
            return Err(invalid(format!("set_irqs: start {start} + count {count} overflows")));
        }
        let want = if data == IRQ_SET_DATA_BOOL { count as usize } else { 0 };
        let data = r.take(want)?.to_vec();
        expect_empty("set_irqs", r.rest())?;
        Ok(IrqSet { flags, index, start, count, data })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let argsz = len_u32(IRQ_SET_SIZE + self.data.len());
        let w = Wr::new(argsz as usize).u32(argsz).u32(self.flags).u32(self.index).u32(self.start);
        w.u32(self.count).bytes(&self.data).0
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::vfio_user::wire::testutil::*;

    #[test]
    fn set_irqs() {
        let flags = IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER;
        let efd = IrqSet { flags, index: PCI_MSIX_IRQ_INDEX, start: 0, count: 4, data: vec![] };
        assert_eq!(efd.to_bytes(), le(&[(20, 4), (0x24, 4), (2, 4), (0, 4), (4, 4)]));
        check(&efd, &efd.to_bytes(), IrqSet::parse);
        let bools = IrqSet {
            flags: IRQ_SET_DATA_BOOL | IRQ_SET_ACTION_MASK,
            index: 1,
            start: 2,
            count: 3,
            data: vec![1, 0, 1],
        };
        check(&bools, &bools.to_bytes(), IrqSet::parse);
        let none =
            IrqSet { flags: IRQ_SET_DATA_NONE | IRQ_SET_ACTION_TRIGGER, index: 0, start: 0, count: 0, data: vec![] };
        check(&none, &none.to_bytes(), IrqSet::parse);
        for flags in [0, IRQ_SET_DATA_NONE, IRQ_SET_ACTION_MASK, 0x3 | 0x20, 0x1 | 0x18, 0x1 | 0x20 | 0x40] {
            assert!(IrqSet::parse(&IrqSet { flags, ..none.clone() }.to_bytes()).is_err(), "{flags:#x}");
        }
        assert!(IrqSet::parse(&IrqSet { count: 4, ..bools }.to_bytes()).is_err()); // 3 bools for count 4
        assert!(IrqSet::parse(&IrqSet { start: u32::MAX, count: 1, ..efd }.to_bytes()).is_err());
    }
}
