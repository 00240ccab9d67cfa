//! CRC-32C (Castagnoli, as iSCSI and ext4 use it): every checksum strata
//! stores or sends.
//!
//! Two implementations from crates.io compute it, and the process uses
//! whichever is faster on the CPU it runs on, measured once at first use:
//! - `crc-fast` folds with carry-less multiplies, AVX-512 VPCLMULQDQ where
//!   the CPU has it: on an AMD EPYC with AVX-512 it checks a 4 KiB sector at
//!   36–42 GB/s, against 17–20 GB/s for the `crc32c` crate;
//! - `crc32c` runs the SSE4.2 `crc32` instruction on three interleaved
//!   streams: on an AMD EPYC without AVX-512 (Zen 3) it checks a sector at
//!   ~12.7 GB/s, against ~7.5 GB/s for `crc-fast`'s SSE code there.
//!
//! A 1 MiB request is 256 sector checksums, so the choice is worth tens of
//! microseconds of CPU per request (BENCHMARKS.md). Both give the same
//! values; the tests check each against published values and a bitwise
//! reference. `STRATA_CRC=crc-fast` or `STRATA_CRC=crc32c` skips the
//! measurement (for benchmarks comparing the two).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crc_fast::{CrcAlgorithm, Digest};

/// One implementation of CRC-32C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The `crc-fast` crate (carry-less-multiply folding, AVX-512 where present).
    CrcFast,
    /// The `crc32c` crate (SSE4.2 `crc32` instruction, three streams).
    Crc32c,
}

impl Backend {
    /// Every backend, in the order a tie is broken.
    pub const ALL: [Backend; 2] = [Backend::CrcFast, Backend::Crc32c];

    pub fn name(self) -> &'static str {
        match self {
            Backend::CrcFast => "crc-fast",
            Backend::Crc32c => "crc32c",
        }
    }

    fn from_name(name: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.name() == name)
    }

    /// The CRC-32C of `data`, computed by this backend.
    #[inline]
    pub fn checksum(self, data: &[u8]) -> u32 {
        match self {
            Backend::CrcFast => crc_fast::crc32_iscsi(data),
            Backend::Crc32c => crc32c::crc32c(data),
        }
    }

    /// The CRC-32C of `parts` laid end to end, computed by this backend.
    pub fn checksum_of_parts(self, parts: &[&[u8]]) -> u32 {
        match self {
            Backend::CrcFast => {
                let mut digest = Digest::new(CrcAlgorithm::Crc32Iscsi);
                for part in parts {
                    digest.update(part);
                }
                digest.finalize() as u32
            }
            Backend::Crc32c => parts.iter().fold(0, |crc, part| crc32c::crc32c_append(crc, part)),
        }
    }
}

static CHOSEN: OnceLock<Backend> = OnceLock::new();

/// The backend this process uses: `STRATA_CRC` if it names one, else the
/// faster on 4 KiB sectors (measured once, in about a millisecond).
pub fn backend() -> Backend {
    *CHOSEN.get_or_init(|| {
        let Ok(forced) = std::env::var("STRATA_CRC") else {
            return fastest();
        };
        Backend::from_name(forced.trim()).unwrap_or_else(|| {
            tracing::warn!("STRATA_CRC={forced:?} names no CRC-32C implementation (crc-fast, crc32c); timing both");
            fastest()
        })
    })
}

/// Times every backend on the same 4 KiB sectors, interleaved over a few
/// rounds so a burst of noise on a shared machine hits each alike; the best
/// round of each decides.
fn fastest() -> Backend {
    const SECTOR: usize = 4096;
    const SECTORS: usize = 16;
    const ROUNDS: usize = 8;
    let data: Vec<u8> = (0..SECTOR * SECTORS)
        .map(|i| (i.wrapping_mul(31) ^ (i >> 7)) as u8)
        .collect();
    let mut best = [Duration::MAX; Backend::ALL.len()];
    for _ in 0..ROUNDS {
        for (index, backend) in Backend::ALL.into_iter().enumerate() {
            let started = Instant::now();
            let mut sink = 0u32;
            for sector in data.chunks(SECTOR) {
                sink = sink.wrapping_add(backend.checksum(std::hint::black_box(sector)));
            }
            std::hint::black_box(sink);
            best[index] = best[index].min(started.elapsed());
        }
    }
    let (index, _) = best
        .iter()
        .enumerate()
        .min_by_key(|(_, time)| **time)
        .expect("backends");
    Backend::ALL[index]
}

/// The CRC-32C of `data`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    backend().checksum(data)
}

/// The CRC-32C of `parts` laid end to end.
pub fn crc32c_of_parts(parts: &[&[u8]]) -> u32 {
    backend().checksum_of_parts(parts)
}

/// The unit [`copy_summing_sectors`] checksums: a 4 KiB sector, as the pool
/// stores its checksums.
pub const SUM_SECTOR_BYTES: usize = 4096;

/// Whether [`copy_summing_sectors`] can run on this CPU (x86-64 with SSE4.2).
pub fn can_copy_summing() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("sse4.2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Copies `dst.len()` bytes (whole [`SUM_SECTOR_BYTES`] sectors) from `src`
/// into `dst` and stores each sector's CRC-32C in `sums`, in one pass: every
/// 8-byte word is loaded once, fed to the `crc32` instruction and stored.
/// Three sectors are summed at once (one dependency chain each, no merging),
/// which keeps the instruction busy every cycle. The point is memory that
/// another party can change (a shared mapping of a device file): what lands
/// in `dst` is exactly what was summed, whatever happens to `src` meanwhile.
///
/// # Safety
/// `src` must be 8-byte aligned and valid for reads of `dst.len()` bytes for
/// the whole call (it may change concurrently: it is read with volatile
/// loads, once each). [`can_copy_summing`] must be true.
///
/// # Panics
/// If `dst` is not whole sectors or `sums` has not one slot per sector.
pub unsafe fn copy_summing_sectors(src: *const u8, dst: &mut [u8], sums: &mut [u32]) {
    assert!(dst.len() % SUM_SECTOR_BYTES == 0 && sums.len() == dst.len() / SUM_SECTOR_BYTES);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's promises, passed on; the CPU has SSE4.2.
    unsafe {
        sse42::copy_summing_sectors(src, dst, sums)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("copy_summing_sectors without can_copy_summing")
}

#[cfg(target_arch = "x86_64")]
mod sse42 {
    use super::SUM_SECTOR_BYTES;
    use std::arch::x86_64::{_mm_crc32_u64, _mm_prefetch, _MM_HINT_T0};

    const WORDS: usize = SUM_SECTOR_BYTES / 8;

    /// See [`super::copy_summing_sectors`].
    #[target_feature(enable = "sse4.2")]
    pub unsafe fn copy_summing_sectors(src: *const u8, dst: &mut [u8], sums: &mut [u32]) {
        let src = src as *const u64;
        let dst = dst.as_mut_ptr() as *mut u64;
        let sectors = sums.len();
        let mut sector = 0;
        while sector + 3 <= sectors {
            let (a, b, c) = (sector * WORDS, (sector + 1) * WORDS, (sector + 2) * WORDS);
            let (mut crc_a, mut crc_b, mut crc_c) = (!0u64, !0u64, !0u64);
            // The hardware prefetcher does not cross into the next page
            // (sector); ask for the next group's lines while this one runs.
            let next = (sector + 6 <= sectors).then_some(c + WORDS);
            for i in 0..WORDS {
                if let (Some(next), 0) = (next, i % 8) {
                    for stream in 0..3 {
                        // SAFETY: a prefetch inside the caller's range (it
                        // never faults, whatever the address).
                        unsafe { _mm_prefetch::<_MM_HINT_T0>(src.add(next + stream * WORDS + i) as *const i8) };
                    }
                }
                // SAFETY: the caller's range covers every sector; `dst` is
                // a slice of the same length (unaligned stores are fine).
                unsafe {
                    let x = std::ptr::read_volatile(src.add(a + i));
                    let y = std::ptr::read_volatile(src.add(b + i));
                    let z = std::ptr::read_volatile(src.add(c + i));
                    crc_a = _mm_crc32_u64(crc_a, x);
                    crc_b = _mm_crc32_u64(crc_b, y);
                    crc_c = _mm_crc32_u64(crc_c, z);
                    dst.add(a + i).write_unaligned(x);
                    dst.add(b + i).write_unaligned(y);
                    dst.add(c + i).write_unaligned(z);
                }
            }
            sums[sector] = !(crc_a as u32);
            sums[sector + 1] = !(crc_b as u32);
            sums[sector + 2] = !(crc_c as u32);
            sector += 3;
        }
        while sector < sectors {
            let a = sector * WORDS;
            let mut crc = !0u64;
            for i in 0..WORDS {
                // SAFETY: as above.
                unsafe {
                    let x = std::ptr::read_volatile(src.add(a + i));
                    crc = _mm_crc32_u64(crc, x);
                    dst.add(a + i).write_unaligned(x);
                }
            }
            sums[sector] = !(crc as u32);
            sector += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_check_values() {
        let incrementing: Vec<u8> = (0..32).collect();
        for backend in Backend::ALL {
            let crc32c = |data: &[u8]| backend.checksum(data);
            // The CRC catalogue's check value for CRC-32/ISCSI.
            assert_eq!(crc32c(b"123456789"), 0xe306_9283, "{backend:?}");
            assert_eq!(crc32c(b""), 0, "{backend:?}");
            // RFC 3720 B.4: 32 bytes of zeros, of 0xff, and an incrementing run.
            assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa, "{backend:?}");
            assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43, "{backend:?}");
            assert_eq!(crc32c(&incrementing), 0x46dd_794e, "{backend:?}");
        }
        // And whichever the process chose.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn strata_crc_names_each_backend_and_nothing_else() {
        for backend in Backend::ALL {
            assert_eq!(Backend::from_name(backend.name()), Some(backend));
        }
        assert_eq!(Backend::from_name("crc32"), None);
        assert_eq!(Backend::from_name(""), None);
        // The measurement picks one of them (and the process keeps its choice).
        assert!(Backend::ALL.contains(&fastest()));
        assert_eq!(backend(), backend());
    }

    #[test]
    fn parts_give_the_checksum_of_the_whole() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 + i / 7) as u8).collect();
        for backend in Backend::ALL {
            let whole = backend.checksum(&data);
            for split in [0, 1, 3, 4096, 9_999, 10_000] {
                let (a, b) = data.split_at(split);
                assert_eq!(
                    backend.checksum_of_parts(&[a, b]),
                    whole,
                    "{backend:?} split at {split}"
                );
            }
            assert_eq!(backend.checksum_of_parts(&[]), 0, "{backend:?}");
        }
        assert_eq!(crc32c_of_parts(&[&data[..5], &data[5..]]), crc32c(&data));
    }

    #[test]
    fn sector_sized_inputs_match_a_bitwise_reference() {
        // A plain bit-at-a-time CRC-32C, to check the SIMD paths on the
        // lengths the engine uses (512-byte to 64 KiB, odd tails).
        fn reference(data: &[u8]) -> u32 {
            let mut crc = !0u32;
            for &byte in data {
                crc ^= byte as u32;
                for _ in 0..8 {
                    crc = if crc & 1 != 0 {
                        (crc >> 1) ^ 0x82f6_3b78
                    } else {
                        crc >> 1
                    };
                }
            }
            !crc
        }
        let data: Vec<u8> = (0..65_537u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for backend in Backend::ALL {
            for len in [1, 7, 63, 64, 255, 512, 4096, 4097, 16_384, 65_536, 65_537] {
                let expected = reference(&data[..len]);
                assert_eq!(backend.checksum(&data[..len]), expected, "{backend:?} length {len}");
            }
        }
    }
    #[test]
    fn copying_while_summing_gives_the_bytes_and_each_sectors_checksum() {
        if !can_copy_summing() {
            eprintln!("no SSE4.2 on this CPU: copy_summing_sectors is never used here");
            return;
        }
        // 1 to 7 sectors: every mix of three-at-once groups and single tails.
        let data: Vec<u64> = (0..7 * SUM_SECTOR_BYTES as u64 / 8)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i << 17))
            .collect();
        // SAFETY: a Vec<u64> is 8-byte aligned plain data.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, data.len() * 8) };
        for sectors in 1..=7 {
            let len = sectors * SUM_SECTOR_BYTES;
            // An odd offset into a larger buffer: the destination need not be aligned.
            let mut dst = vec![0u8; len + 3];
            let mut sums = vec![0u32; sectors];
            // SAFETY: `bytes` is aligned and holds `len` bytes.
            unsafe { copy_summing_sectors(bytes.as_ptr(), &mut dst[3..], &mut sums) };
            assert_eq!(&dst[3..], &bytes[..len], "{sectors} sectors");
            for (index, sum) in sums.iter().enumerate() {
                let sector = &bytes[index * SUM_SECTOR_BYTES..(index + 1) * SUM_SECTOR_BYTES];
                for backend in Backend::ALL {
                    assert_eq!(
                        *sum,
                        backend.checksum(sector),
                        "{sectors} sectors, sector {index}, {backend:?}"
                    );
                }
            }
        }
    }
}
