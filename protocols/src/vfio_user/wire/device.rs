//! DEVICE_GET_INFO and DEVICE_FEATURE.

use super::*;

pub const DEVICE_FLAGS_RESET: u32 = 1 << 0;
pub const DEVICE_FLAGS_PCI: u32 = 1 << 1;

pub const DEVICE_FEATURE_MASK: u32 = 0xffff;
pub const DEVICE_FEATURE_GET: u32 = 1 << 16;
pub const DEVICE_FEATURE_SET: u32 = 1 << 17;
pub const DEVICE_FEATURE_PROBE: u32 = 1 << 18;

/// DEVICE_GET_INFO request and reply (16 bytes). A request sets only `argsz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceInfo {
    pub argsz: u32,
    pub flags: u32,
    pub num_regions: u32,
    pub num_irqs: u32,
}

impl DeviceInfo {
    pub fn request() -> Self {
        DeviceInfo { argsz: INFO16_SIZE as u32, flags: 0, num_regions: 0, num_irqs: 0 }
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("device_info", b, INFO16_SIZE, true)?;
        let d = DeviceInfo { argsz: r.u32()?, flags: r.u32()?, num_regions: r.u32()?, num_irqs: r.u32()? };
        check_argsz("device_info", d.argsz, INFO16_SIZE).map(|_| d)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(INFO16_SIZE).u32(self.argsz).u32(self.flags).u32(self.num_regions).u32(self.num_irqs).0
    }
}

/// DEVICE_FEATURE request and reply: `argsz`, `flags` (feature index in bits
/// 0-15, GET/SET/PROBE above), then feature-specific data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFeature {
    pub argsz: u32,
    pub flags: u32,
    pub data: Vec<u8>,
}

impl DeviceFeature {
    pub fn feature(&self) -> u32 {
        self.flags & DEVICE_FEATURE_MASK
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("device_feature", b, 8, false)?;
        let (argsz, flags) = (r.u32()?, r.u32()?);
        let (ops, get_set) = (flags & !DEVICE_FEATURE_MASK, DEVICE_FEATURE_GET | DEVICE_FEATURE_SET);
        let known = ops & !(get_set | DEVICE_FEATURE_PROBE) == 0;
        if !known || ops == 0 || (ops & get_set == get_set && ops & DEVICE_FEATURE_PROBE == 0) {
            return Err(invalid(format!("device_feature: bad flags {flags:#x}")));
        }
        check_argsz("device_feature", argsz, 8)?;
        Ok(DeviceFeature { argsz, flags, data: r.rest().to_vec() })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(8 + self.data.len()).u32(self.argsz).u32(self.flags).bytes(&self.data).0
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::vfio_user::wire::testutil::*;

    #[test]
    fn device_info_and_irq_info() {
        let req = DeviceInfo::request();
        assert_eq!(req.to_bytes(), le(&[(16, 4), (0, 4), (0, 4), (0, 4)]));
        check(&req, &req.to_bytes(), DeviceInfo::parse);
        let rep = DeviceInfo { argsz: 16, flags: DEVICE_FLAGS_PCI | DEVICE_FLAGS_RESET, num_regions: 9, num_irqs: 5 };
        check(&rep, &rep.to_bytes(), DeviceInfo::parse);
        assert!(DeviceInfo::parse(&DeviceInfo { argsz: 4, ..rep }.to_bytes()).is_err());
        let q = IrqInfo::request(PCI_MSIX_IRQ_INDEX);
        assert_eq!(q.to_bytes(), le(&[(16, 4), (0, 4), (2, 4), (0, 4)]));
        check(&q, &q.to_bytes(), IrqInfo::parse);
        let a = IrqInfo { argsz: 16, flags: IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE, index: 2, count: 64 };
        check(&a, &a.to_bytes(), IrqInfo::parse);
    }

    #[test]
    fn device_feature() {
        let probe = DeviceFeature { argsz: 8, flags: 1 | DEVICE_FEATURE_PROBE | DEVICE_FEATURE_GET, data: vec![] };
        assert_eq!(DeviceFeature::parse(&probe.to_bytes()).unwrap(), probe);
        prefixes_fail(&probe.to_bytes(), |b| DeviceFeature::parse(b).is_ok(), &[]);
        let get = DeviceFeature { argsz: 16, flags: 1 | DEVICE_FEATURE_GET, data: vec![1, 0, 0, 0, 0, 0, 0, 0] };
        assert_eq!((DeviceFeature::parse(&get.to_bytes()).unwrap(), get.feature()), (get.clone(), 1));
        // Data has no length field of its own: only prefixes shorter than 8 bytes fail.
        prefixes_fail(&get.to_bytes(), |b| DeviceFeature::parse(b).is_ok(), &[8, 9, 10, 11, 12, 13, 14, 15]);
        for flags in [1, 1 | DEVICE_FEATURE_GET | DEVICE_FEATURE_SET, 1 << 20 | DEVICE_FEATURE_GET] {
            assert!(DeviceFeature::parse(&DeviceFeature { flags, ..probe.clone() }.to_bytes()).is_err());
        }
    }
}
