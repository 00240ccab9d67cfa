//! What a device already holds, before strata writes over it.
//!
//! `pool create` and `pool add-device` refuse a device that is not empty
//! unless forced: a file system, partition table, volume manager or other
//! storage system recognised by its magic bytes at the offsets where
//! wipefs/libblkid look for them, or else any non-zero byte in the first
//! or last MiB. A pure function over those two windows, so every signature
//! is unit-tested with a buffer.

/// How much of each end of a device is examined.
pub const WINDOW_BYTES: usize = 1 << 20;

/// Something found on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// What it is, for the message ("an XFS file system").
    pub what: &'static str,
    /// Byte offset on the device where it was seen.
    pub offset: u64,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (at byte {})", self.what, self.offset)
    }
}

/// A magic string at a fixed offset from the start.
struct Magic {
    what: &'static str,
    offset: usize,
    bytes: &'static [u8],
}

const fn magic(what: &'static str, offset: usize, bytes: &'static [u8]) -> Magic {
    Magic { what, offset, bytes }
}

/// Signatures near the start, most specific first (a FAT or NTFS boot
/// sector also ends in 0x55AA; LVM and GPT sit after an MBR).
const HEAD_MAGICS: &[Magic] = &[
    magic("a LUKS encrypted volume", 0, b"LUKS\xba\xbe"),
    magic("a LUKS2 encrypted volume", 0, b"SKUL\xba\xbe"),
    magic("an XFS file system", 0, b"XFSB"),
    magic("a squashfs file system", 0, b"hsqs"),
    magic("a Ceph BlueStore device", 0, b"bluestore block device"),
    magic("a btrfs file system", 0x10040, b"_BHRfS_M"),
    magic("an ISO 9660 file system", 0x8001, b"CD001"),
    magic("an NTFS file system", 3, b"NTFS    "),
    magic("an exFAT file system", 3, b"EXFAT   "),
    magic("a FAT32 file system", 82, b"FAT32   "),
    magic("a FAT file system", 54, b"FAT12   "),
    magic("a FAT file system", 54, b"FAT16   "),
    magic("a GPT partition table", 512, b"EFI PART"),
    magic("a GPT partition table", 4096, b"EFI PART"),
    magic("an LVM2 physical volume", 512 + 24, b"LVM2 001"),
    magic("an LVM2 physical volume", 24, b"LVM2 001"),
    magic("an LVM2 physical volume", 1024 + 24, b"LVM2 001"),
    magic("an LVM2 physical volume", 1536 + 24, b"LVM2 001"),
    magic("a Linux swap area", 4096 - 10, b"SWAPSPACE2"),
    magic("a Linux swap area", 4096 - 10, b"SWAP-SPACE"),
    magic("an ext2/3/4 file system", 1080, b"\x53\xef"),
    // md RAID 1.1 (at the start) and 1.2 (4 KiB in), little-endian magic.
    magic("a Linux md RAID member", 0, b"\xfc\x4e\x2b\xa9"),
    magic("a Linux md RAID member", 4096, b"\xfc\x4e\x2b\xa9"),
    magic(
        "a bcache device",
        4096 + 24,
        b"\xc6\x85\x73\xf6\x4e\x1a\x45\xca\x82\x65\xf5\x7f\x48\xba\x6d\x81",
    ),
    magic("a DOS partition table or boot sector", 510, b"\x55\xaa"),
];

/// ZFS labels hold an array of 1 KiB uberblocks from 128 KiB to 256 KiB
/// into the label, each starting with this magic (either byte order).
const ZFS_UBERBLOCK_MAGIC: u64 = 0x00ba_b10c;

/// Looks at the first and last bytes of a device `size` bytes long (`head`
/// from offset 0, `tail` ending at `size`) and says what is there, if
/// anything: a known signature, else the first non-zero byte.
pub fn identify(head: &[u8], tail: &[u8], size: u64) -> Option<Finding> {
    for m in HEAD_MAGICS {
        if head.get(m.offset..m.offset + m.bytes.len()) == Some(m.bytes) {
            return Some(Finding {
                what: m.what,
                offset: m.offset as u64,
            });
        }
    }
    for offset in (128 << 10..256 << 10).step_by(1 << 10) {
        if let Some(word) = head.get(offset..offset + 8) {
            let word: [u8; 8] = word.try_into().expect("eight bytes");
            if u64::from_le_bytes(word) == ZFS_UBERBLOCK_MAGIC || u64::from_be_bytes(word) == ZFS_UBERBLOCK_MAGIC {
                return Some(Finding {
                    what: "a ZFS pool member",
                    offset: offset as u64,
                });
            }
        }
    }
    let tail_start = size - tail.len() as u64;
    // md RAID 0.90 (64 KiB-aligned, 64 KiB from the end) and 1.0 (8 KiB
    // from the end, 4 KiB-aligned) keep their superblock at the end.
    let md_magic = 0xa92b_4efcu32.to_le_bytes();
    let md_090 = (size & !0xffff).checked_sub(0x10000);
    let md_10 = size.checked_sub(8192).map(|o| o & !4095);
    for offset in [md_090, md_10].into_iter().flatten() {
        if offset >= tail_start {
            let at = (offset - tail_start) as usize;
            if tail.get(at..at + 4) == Some(&md_magic[..]) {
                return Some(Finding {
                    what: "a Linux md RAID member",
                    offset,
                });
            }
        }
    }
    // The backup GPT header sits in the last sector.
    if tail.len() >= 512 && &tail[tail.len() - 512..tail.len() - 504] == b"EFI PART" {
        return Some(Finding {
            what: "a GPT partition table (backup header)",
            offset: size - 512,
        });
    }
    if let Some(at) = head.iter().position(|&b| b != 0) {
        return Some(Finding {
            what: "data (non-zero bytes)",
            offset: at as u64,
        });
    }
    if let Some(at) = tail.iter().position(|&b| b != 0) {
        return Some(Finding {
            what: "data (non-zero bytes)",
            offset: tail_start + at as u64,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: u64 = 64 << 20;

    fn with(offset: usize, bytes: &[u8]) -> Vec<u8> {
        let mut head = vec![0u8; WINDOW_BYTES];
        head[offset..offset + bytes.len()].copy_from_slice(bytes);
        head
    }

    fn found(head: &[u8], tail: &[u8]) -> Option<&'static str> {
        identify(head, tail, SIZE).map(|f| f.what)
    }

    #[test]
    fn zeros_are_empty() {
        let zeros = vec![0u8; WINDOW_BYTES];
        assert_eq!(identify(&zeros, &zeros, SIZE), None);
        // A device smaller than the windows: both cover it all.
        assert_eq!(identify(&zeros[..4096], &zeros[..4096], 4096), None);
    }

    #[test]
    fn each_signature_is_named() {
        let zeros = vec![0u8; WINDOW_BYTES];
        let cases: &[(usize, &[u8], &str)] = &[
            (1080, b"\x53\xef", "an ext2/3/4 file system"),
            (0, b"XFSB", "an XFS file system"),
            (0x10040, b"_BHRfS_M", "a btrfs file system"),
            (512, b"EFI PART", "a GPT partition table"),
            (536, b"LVM2 001", "an LVM2 physical volume"),
            (4086, b"SWAPSPACE2", "a Linux swap area"),
            (0, b"LUKS\xba\xbe", "a LUKS encrypted volume"),
            (3, b"NTFS    ", "an NTFS file system"),
            (82, b"FAT32   ", "a FAT32 file system"),
            (54, b"FAT16   ", "a FAT file system"),
            (0x8001, b"CD001", "an ISO 9660 file system"),
            (4096, b"\xfc\x4e\x2b\xa9", "a Linux md RAID member"),
            (
                4120,
                b"\xc6\x85\x73\xf6\x4e\x1a\x45\xca\x82\x65\xf5\x7f\x48\xba\x6d\x81",
                "a bcache device",
            ),
            (510, b"\x55\xaa", "a DOS partition table or boot sector"),
            (131072 + 5 * 1024, &0x00bab10cu64.to_le_bytes(), "a ZFS pool member"),
            (0, b"bluestore block device", "a Ceph BlueStore device"),
        ];
        for (offset, bytes, what) in cases {
            assert_eq!(found(&with(*offset, bytes), &zeros), Some(*what), "{what}");
            let finding = identify(&with(*offset, bytes), &zeros, SIZE).unwrap();
            assert_eq!(finding.offset, *offset as u64, "{what}");
        }
        // A FAT boot sector also ends in 0x55AA: the file system is named.
        let mut fat = with(82, b"FAT32   ");
        fat[510..512].copy_from_slice(b"\x55\xaa");
        assert_eq!(found(&fat, &zeros), Some("a FAT32 file system"));
    }

    #[test]
    fn signatures_at_the_end_are_found() {
        let zeros = vec![0u8; WINDOW_BYTES];
        let tail_start = SIZE - WINDOW_BYTES as u64;
        let mut tail = zeros.clone();
        let md10 = ((SIZE - 8192) & !4095) - tail_start;
        tail[md10 as usize..md10 as usize + 4].copy_from_slice(&0xa92b4efcu32.to_le_bytes());
        assert_eq!(found(&zeros, &tail), Some("a Linux md RAID member"));
        let mut tail = zeros.clone();
        let md090 = ((SIZE & !0xffff) - 0x10000) - tail_start;
        tail[md090 as usize..md090 as usize + 4].copy_from_slice(&0xa92b4efcu32.to_le_bytes());
        assert_eq!(found(&zeros, &tail), Some("a Linux md RAID member"));
        let mut tail = zeros.clone();
        let n = tail.len();
        tail[n - 512..n - 504].copy_from_slice(b"EFI PART");
        let finding = identify(&zeros, &tail, SIZE).unwrap();
        assert_eq!(
            (finding.what, finding.offset),
            ("a GPT partition table (backup header)", SIZE - 512)
        );
    }

    #[test]
    fn any_other_data_is_reported_with_its_offset() {
        let zeros = vec![0u8; WINDOW_BYTES];
        let head = with(777_777, b"x");
        assert_eq!(
            identify(&head, &zeros, SIZE),
            Some(Finding {
                what: "data (non-zero bytes)",
                offset: 777_777
            })
        );
        let mut tail = zeros.clone();
        tail[WINDOW_BYTES - 1] = 1;
        assert_eq!(identify(&zeros, &tail, SIZE).unwrap().offset, SIZE - 1);
    }
}
