//! INQUIRY data, VPD pages, mode pages and READ CAPACITY data, built as pure
//! functions of a [`UnitInfo`] snapshot. Everything advertised here is
//! derived from the volume's one [`Capabilities`] description.

use crate::block::Capabilities;

/// Logical block size of every LUN.
pub const BLOCK_BYTES: u32 = 512;
/// Largest COMPARE AND WRITE, in blocks (the CDB field is one byte).
pub const MAX_COMPARE_AND_WRITE_BLOCKS: u32 = 255;
/// Largest UNMAP or WRITE SAME range, in blocks (512 MiB of 512-byte blocks).
pub const MAX_UNMAP_BLOCKS: u32 = 1 << 20;
/// Largest number of UNMAP block descriptors in one parameter list.
pub const MAX_UNMAP_DESCRIPTORS: u32 = 256;
pub const VENDOR: &[u8; 8] = b"STRATA  ";
pub const PRODUCT: &[u8; 16] = b"VOLUME          ";
pub const REVISION: &[u8; 4] = b"0001";

/// What the pages describe, captured once per command.
#[derive(Debug, Clone)]
pub struct UnitInfo {
    pub capacity_blocks: u64,
    pub caps: Capabilities,
    /// The volume's `wce` property (the caching page's WCE bit).
    pub wce: bool,
    /// IEEE registered NAA designator (16 bytes, NAA type 6).
    pub naa: [u8; 16],
    pub serial: String,
    pub target_name: String,
}

impl UnitInfo {
    fn max_transfer_blocks(&self) -> u32 {
        self.caps.max_request_bytes / BLOCK_BYTES
    }

    fn preferred_blocks(&self) -> u32 {
        (self.caps.preferred_block_bytes / BLOCK_BYTES).max(1)
    }
}

/// The NAA designator for a volume: NAA 6 (IEEE registered extended) with a
/// locally administered company id and 100 bits derived from the name.
pub fn naa_for(name: &str) -> [u8; 16] {
    let mut hash: u64 = 0xcbf29ce484222325;
    let mut hash2: u64 = 0x84222325cbf29ce4;
    for byte in name.bytes() {
        hash = (hash ^ byte as u64).wrapping_mul(0x100000001b3);
        hash2 = (hash2 ^ byte as u64).wrapping_mul(0x1000193).rotate_left(5);
    }
    let mut naa = [0u8; 16];
    // NAA 6, then a 24-bit OUI (0x0a0b0c, arbitrary and stable), then vendor bits.
    naa[0] = 0x60;
    naa[1] = 0xa0;
    naa[2] = 0xb0;
    naa[3] = 0xc0 | ((hash >> 60) as u8 & 0x0f);
    naa[4..8].copy_from_slice(&(hash as u32).to_be_bytes());
    naa[8..16].copy_from_slice(&hash2.to_be_bytes());
    naa
}

/// Standard INQUIRY data (SPC-4 6.6.2).
pub fn standard_inquiry() -> Vec<u8> {
    let mut data = vec![0u8; 96];
    data[0] = 0x00; // connected, direct access block device
    data[2] = 0x06; // SPC-4
    data[3] = 0x12; // HISUP, response data format 2
    data[4] = (data.len() - 5) as u8;
    data[7] = 0x02; // CMDQUE
    data[8..16].copy_from_slice(VENDOR);
    data[16..32].copy_from_slice(PRODUCT);
    data[32..36].copy_from_slice(REVISION);
    // Version descriptors: SAM-5, SPC-4, SBC-3, iSCSI.
    for (i, descriptor) in [0x00a0u16, 0x0460, 0x04c0, 0x0960].iter().enumerate() {
        data[58 + 2 * i..60 + 2 * i].copy_from_slice(&descriptor.to_be_bytes());
    }
    data
}

pub const SUPPORTED_VPD_PAGES: [u8; 6] = [0x00, 0x80, 0x83, 0xb0, 0xb1, 0xb2];

fn vpd(page: u8, body: Vec<u8>) -> Vec<u8> {
    let mut data = vec![0x00, page];
    data.extend_from_slice(&(body.len() as u16).to_be_bytes());
    data.extend(body);
    data
}

/// A VPD page, or `None` for a page we do not have.
pub fn vpd_page(page: u8, unit: &UnitInfo) -> Option<Vec<u8>> {
    Some(match page {
        0x00 => vpd(page, SUPPORTED_VPD_PAGES.to_vec()),
        0x80 => vpd(page, unit.serial.as_bytes().to_vec()),
        0x83 => vpd(page, device_identification(unit)),
        0xb0 => vpd(page, block_limits(unit)),
        0xb1 => {
            let mut body = vec![0u8; 0x3c];
            // Medium rotation rate: 1 = non-rotating, 0 = not reported.
            let rate: u16 = if unit.caps.rotational { 0 } else { 1 };
            body[0..2].copy_from_slice(&rate.to_be_bytes());
            vpd(page, body)
        }
        0xb2 => {
            let mut body = vec![0u8; 4];
            if unit.caps.can_trim {
                // Threshold sets of 2^THRESHOLD EXPONENT blocks count the
                // soft threshold of the Logical Block Provisioning mode page.
                body[0] = threshold_exponent(unit.capacity_blocks);
                // LBPU, LBPWS, LBPWS10, LBPRZ.
                body[1] = 0x80 | 0x40 | 0x20 | 0x04;
                body[2] = 0x02; // thin provisioned
            }
            vpd(page, body)
        }
        _ => return None,
    })
}

fn designator(protocol_and_code_set: u8, piv_assoc_type: u8, value: &[u8]) -> Vec<u8> {
    let mut out = vec![protocol_and_code_set, piv_assoc_type, 0, value.len() as u8];
    out.extend_from_slice(value);
    out
}

fn device_identification(unit: &UnitInfo) -> Vec<u8> {
    let mut body = Vec::new();
    // NAA, binary, associated with the logical unit.
    body.extend(designator(0x01, 0x03, &unit.naa));
    // T10 vendor id, ASCII: vendor followed by the serial number.
    let mut t10 = VENDOR.to_vec();
    t10.extend_from_slice(unit.serial.as_bytes());
    body.extend(designator(0x02, 0x01, &t10));
    // Relative target port 1, associated with the target port (iSCSI, PIV).
    body.extend(designator(0x51, 0x94, &[0, 0, 0, 1]));
    // Target port group 1 is not reported (no ALUA); the SCSI name string of
    // the target device: UTF-8, NUL terminated, padded to a multiple of 4.
    let mut name = unit.target_name.as_bytes().to_vec();
    name.truncate(250);
    name.push(0);
    while !name.len().is_multiple_of(4) {
        name.push(0);
    }
    body.extend(designator(0x53, 0xa8, &name));
    body
}

fn block_limits(unit: &UnitInfo) -> Vec<u8> {
    let mut body = vec![0u8; 0x3c];
    body[0] = 0x01; // WSNZ: WRITE SAME of zero blocks is refused
    body[1] = MAX_COMPARE_AND_WRITE_BLOCKS as u8;
    body[2..4].copy_from_slice(&(unit.preferred_blocks() as u16).to_be_bytes());
    body[4..8].copy_from_slice(&unit.max_transfer_blocks().to_be_bytes());
    body[8..12].copy_from_slice(&unit.preferred_blocks().to_be_bytes());
    body[12..16].copy_from_slice(&unit.max_transfer_blocks().to_be_bytes());
    if unit.caps.can_trim {
        body[16..20].copy_from_slice(&MAX_UNMAP_BLOCKS.to_be_bytes());
        body[20..24].copy_from_slice(&MAX_UNMAP_DESCRIPTORS.to_be_bytes());
        body[24..28].copy_from_slice(&1u32.to_be_bytes());
    }
    body[32..40].copy_from_slice(&(MAX_UNMAP_BLOCKS as u64).to_be_bytes());
    body
}

/// READ CAPACITY (10) data: the last LBA (saturated) and the block length.
pub fn read_capacity10(unit: &UnitInfo) -> Vec<u8> {
    let last = unit.capacity_blocks.saturating_sub(1);
    let last = u32::try_from(last).unwrap_or(u32::MAX);
    let mut data = last.to_be_bytes().to_vec();
    data.extend_from_slice(&BLOCK_BYTES.to_be_bytes());
    data
}

/// READ CAPACITY (16) parameter data (SBC-3 5.16.2).
pub fn read_capacity16(unit: &UnitInfo) -> Vec<u8> {
    let mut data = vec![0u8; 32];
    data[0..8].copy_from_slice(&unit.capacity_blocks.saturating_sub(1).to_be_bytes());
    data[8..12].copy_from_slice(&BLOCK_BYTES.to_be_bytes());
    let per_physical = unit.preferred_blocks().max(1);
    data[13] = per_physical.trailing_zeros().min(15) as u8;
    if unit.caps.can_trim {
        data[14] = 0x80 | 0x40; // LBPME, LBPRZ
    }
    data
}

/// Smallest threshold exponent: threshold sets of 1 MiB (2^11 blocks).
const MIN_THRESHOLD_EXPONENT: u8 = 11;

/// The THRESHOLD EXPONENT of the Logical Block Provisioning VPD page (SBC-4
/// 6.6.7): a threshold set is 2^exponent blocks; 1 MiB, or more when the
/// capacity in threshold sets would not fit the 32-bit THRESHOLD COUNT.
pub fn threshold_exponent(capacity_blocks: u64) -> u8 {
    let mut exponent = MIN_THRESHOLD_EXPONENT;
    while capacity_blocks >> exponent > u32::MAX as u64 {
        exponent += 1;
    }
    exponent
}

pub const CACHING_PAGE: u8 = 0x08;
pub const CONTROL_PAGE: u8 = 0x0a;
/// The Logical Block Provisioning mode page is page 0x1c, subpage 0x02.
pub const LBP_PAGE: u8 = 0x1c;
pub const LBP_SUBPAGE: u8 = 0x02;
pub const ALL_PAGES: u8 = 0x3f;
/// As a subpage code: every subpage of the page(s).
pub const ALL_SUBPAGES: u8 = 0xff;
/// Byte offset of the soft threshold descriptor in the Logical Block
/// Provisioning mode page: the INFORMATION field of the unit attention
/// that reports it (SBC-4 4.7.3.7.6).
pub const SOFT_THRESHOLD_DESCRIPTOR_OFFSET: u64 = 16;

/// Which mode-page values to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeValues {
    Current,
    /// A mask of the bits MODE SELECT may change.
    Changeable,
    Default,
}

/// The caching mode page (SBC-3 6.5.5).
pub fn caching_page(unit: &UnitInfo, values: ModeValues) -> Vec<u8> {
    let mut page = vec![0u8; 20];
    page[0] = CACHING_PAGE;
    page[1] = 0x12;
    page[2] = match values {
        ModeValues::Current => {
            if unit.wce {
                0x04
            } else {
                0
            }
        }
        // A read-only unit (a snapshot) has no write cache to switch.
        ModeValues::Changeable if unit.caps.read_only => 0,
        ModeValues::Changeable => 0x04,
        ModeValues::Default => 0x04,
    };
    page
}

/// The control mode page (SPC-4 7.5.8).
pub fn control_page(values: ModeValues) -> Vec<u8> {
    let mut page = vec![0u8; 12];
    page[0] = CONTROL_PAGE;
    page[1] = 0x0a;
    if values != ModeValues::Changeable {
        // Unrestricted reordering of simple commands.
        page[3] = 0x10;
        // Busy timeout period: unlimited.
        page[8..10].copy_from_slice(&0xffffu16.to_be_bytes());
    }
    page
}

/// The Logical Block Provisioning mode page (SBC-4 6.5.9), thin volumes
/// only: SITUA zero (the soft threshold's unit attention goes to every
/// I_T nexus) and one soft threshold descriptor on the availability of
/// LBA mapping resources (resource 01h, type 000b, armed decreasing 000b),
/// centred at 10 % of the capacity in threshold sets. Nothing in it is
/// changeable: the threshold is the pool's (see docs/ISCSI.md).
pub fn lbp_page(unit: &UnitInfo, values: ModeValues) -> Vec<u8> {
    let mut page = vec![0u8; 24];
    page[0] = 0x40 | LBP_PAGE; // SPF: the subpage format
    page[1] = LBP_SUBPAGE;
    let length = (page.len() - 4) as u16;
    page[2..4].copy_from_slice(&length.to_be_bytes());
    if values != ModeValues::Changeable {
        let at = SOFT_THRESHOLD_DESCRIPTOR_OFFSET as usize;
        // ENABLED, THRESHOLD TYPE 000b (soft), THRESHOLD ARMING 000b.
        page[at] = 0x80;
        // THRESHOLD RESOURCE: available LBA mapping resources.
        page[at + 1] = 0x01;
        let sets = unit.capacity_blocks >> threshold_exponent(unit.capacity_blocks);
        let count = u32::try_from(sets / 10).unwrap_or(u32::MAX);
        page[at + 4..at + 8].copy_from_slice(&count.to_be_bytes());
    }
    page
}

/// The pages MODE SENSE returns for `page` and `subpage`, or `None` if
/// unsupported.
pub fn mode_pages(unit: &UnitInfo, page: u8, subpage: u8, values: ModeValues) -> Option<Vec<u8>> {
    let lbp = unit.caps.can_trim;
    match (page, subpage) {
        (CACHING_PAGE, 0 | ALL_SUBPAGES) => Some(caching_page(unit, values)),
        (CONTROL_PAGE, 0 | ALL_SUBPAGES) => Some(control_page(values)),
        (LBP_PAGE, LBP_SUBPAGE | ALL_SUBPAGES) if lbp => Some(lbp_page(unit, values)),
        (ALL_PAGES, 0 | ALL_SUBPAGES) => {
            let mut all = caching_page(unit, values);
            all.extend(control_page(values));
            if subpage == ALL_SUBPAGES && lbp {
                all.extend(lbp_page(unit, values));
            }
            Some(all)
        }
        _ => None,
    }
}

/// Whether MODE SENSE knows `page` at all (for pointing a refusal at the
/// subpage rather than the page code).
pub fn known_page(page: u8) -> bool {
    matches!(page, CACHING_PAGE | CONTROL_PAGE | LBP_PAGE | ALL_PAGES)
}

/// The mode parameter header, optional block descriptor and `pages`.
pub fn mode_sense_data(unit: &UnitInfo, ten: bool, dbd: bool, llbaa: bool, pages: &[u8]) -> Vec<u8> {
    let mut descriptor = Vec::new();
    if !dbd {
        if ten && llbaa {
            descriptor.extend_from_slice(&unit.capacity_blocks.to_be_bytes());
            descriptor.extend_from_slice(&[0, 0, 0, 0]);
            descriptor.extend_from_slice(&BLOCK_BYTES.to_be_bytes());
        } else {
            let blocks = u32::try_from(unit.capacity_blocks).unwrap_or(u32::MAX);
            descriptor.extend_from_slice(&blocks.to_be_bytes());
            descriptor.push(0);
            descriptor.extend_from_slice(&BLOCK_BYTES.to_be_bytes()[1..]);
        }
    }
    // Device-specific parameter: DPOFUA, and WP for read-only volumes.
    let mut device_specific = 0x10;
    if unit.caps.read_only {
        device_specific |= 0x80;
    }
    let mut data = Vec::new();
    if ten {
        let length = 6 + descriptor.len() + pages.len();
        data.extend_from_slice(&(length.min(0xffff) as u16).to_be_bytes());
        data.extend_from_slice(&[0, device_specific, if llbaa && !dbd { 1 } else { 0 }, 0]);
        data.extend_from_slice(&(descriptor.len() as u16).to_be_bytes());
    } else {
        let length = 3 + descriptor.len() + pages.len();
        data.extend_from_slice(&[length.min(0xff) as u8, 0, device_specific, descriptor.len() as u8]);
    }
    data.extend(descriptor);
    data.extend_from_slice(pages);
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit() -> UnitInfo {
        UnitInfo {
            capacity_blocks: 2048,
            caps: Capabilities::thin_for_tests(),
            wce: true,
            naa: naa_for("default/vol0"),
            serial: "0123456789abcdef".into(),
            target_name: "iqn.2026-11.io.strata:default.vol0".into(),
        }
    }

    #[test]
    fn read_capacity16_reports_thin_provisioning() {
        let data = read_capacity16(&unit());
        assert_eq!(&data[0..8], &2047u64.to_be_bytes());
        assert_eq!(data[13], 3);
        assert_eq!(data[14] & 0xc0, 0xc0);
    }

    #[test]
    fn caching_page_follows_wce() {
        let mut info = unit();
        assert_eq!(caching_page(&info, ModeValues::Current)[2] & 0x04, 0x04);
        info.wce = false;
        assert_eq!(caching_page(&info, ModeValues::Current)[2] & 0x04, 0);
    }

    #[test]
    fn lbp_vpd_page_and_mode_page_describe_the_soft_threshold() {
        let info = unit();
        let vpd = vpd_page(0xb2, &info).unwrap();
        assert_eq!(vpd[4], 11, "threshold sets of 1 MiB");
        assert_eq!(vpd[6] & 0x07, 0x02, "thin provisioned");
        let page = lbp_page(&info, ModeValues::Current);
        assert_eq!((page[0], page[1]), (0x5c, 0x02));
        assert_eq!(u16::from_be_bytes([page[2], page[3]]) as usize, page.len() - 4);
        assert_eq!(page[4] & 0x01, 0, "SITUA: every I_T nexus");
        assert_eq!(&page[16..20], &[0x80, 0x01, 0, 0]);
        let mut big = unit();
        big.capacity_blocks = 1 << 31; // 1 TiB
        let page = lbp_page(&big, ModeValues::Current);
        assert_eq!(u32::from_be_bytes(page[20..24].try_into().unwrap()), (1 << 20) / 10);
        assert!(lbp_page(&info, ModeValues::Changeable)[4..].iter().all(|&b| b == 0));
        assert_eq!(threshold_exponent(u64::MAX >> 9), 23);
        // Only with subpages asked for, and after the pages without.
        let all = mode_pages(&info, ALL_PAGES, 0, ModeValues::Current).unwrap();
        let with_subpages = mode_pages(&info, ALL_PAGES, ALL_SUBPAGES, ModeValues::Current).unwrap();
        assert_eq!(&with_subpages[..all.len()], &all[..]);
        assert_eq!(with_subpages[all.len()], 0x5c);
        assert!(mode_pages(&info, LBP_PAGE, 0, ModeValues::Current).is_none());
        assert!(mode_pages(&info, CACHING_PAGE, 1, ModeValues::Current).is_none());
        let mut thick = unit();
        thick.caps.can_trim = false;
        assert!(mode_pages(&thick, LBP_PAGE, LBP_SUBPAGE, ModeValues::Current).is_none());
        assert_eq!(vpd_page(0xb2, &thick).unwrap()[4], 0);
    }

    #[test]
    fn vpd_pages_are_listed_sorted_and_exist() {
        let info = unit();
        let list = vpd_page(0, &info).unwrap();
        assert!(list[4..].windows(2).all(|w| w[0] < w[1]));
        for page in &list[4..] {
            assert!(vpd_page(*page, &info).is_some());
        }
        let identification = vpd_page(0x83, &info).unwrap();
        assert_eq!(identification[4 + 1] & 0x0f, 0x03, "first designator is NAA");
        assert_eq!(identification[4 + 4] >> 4, 6);
    }
}
