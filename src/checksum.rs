//! CRC-32C (Castagnoli, as iSCSI and ext4 use it): every checksum strata
//! stores or sends.
//!
//! Any one buffer ([`crc32c`]) goes to one of two crates, chosen by the CPU
//! ([`backend`]):
//! - `crc-fast` folds with carry-less multiplies, AVX-512 VPCLMULQDQ where
//!   the CPU has it: on an AMD EPYC with AVX-512 it checks a 4 KiB sector at
//!   36–42 GB/s, against 17–20 GB/s for the `crc32c` crate;
//! - `crc32c` runs the SSE4.2 `crc32` instruction on three interleaved
//!   streams: on an AMD EPYC without AVX-512 (Zen 3) it checks a sector at
//!   12.7–18.6 GB/s, against 7.5–14 GB/s for `crc-fast`'s SSE code there.
//!
//! The data path checksums whole 4 KiB sectors, many at a time (a 1 MiB
//! request is 256 of them): [`extend_sector_sums`] does six at once where
//! the CPU has AVX2 VPCLMULQDQ and that measures faster than the backend
//! one by one (on Zen 3: 30 µs per MiB against 57), and
//! [`copy_summing_sectors`] copies and sums in one pass (reads of cached
//! file pages, `device::mapped`). No crate does either; both are checked
//! against the crates, published values and a bitwise reference.
//! `strata serve --crc crc-fast` or `--crc crc32c` forces one backend and
//! sectors one by one with it ([`force_backend`], for benchmarks comparing
//! them); every method gives the same checksums, so a pool written with
//! one is read with any other.

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

    /// The backend called `name` (`crc-fast` or `crc32c`).
    pub fn from_name(name: &str) -> Option<Backend> {
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

/// The process's backend, and whether it was forced ([`force_backend`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Chosen {
    backend: Backend,
    forced: bool,
}

static CHOSEN: OnceLock<Chosen> = OnceLock::new();

fn chosen() -> Chosen {
    *CHOSEN.get_or_init(|| Chosen {
        backend: for_this_cpu(),
        forced: false,
    })
}

/// The backend this process uses: the one [`force_backend`] named, else
/// the one for this CPU (`crc-fast` where it has AVX-512 VPCLMULQDQ, else
/// `crc32c`).
pub fn backend() -> Backend {
    chosen().backend
}

/// Makes `backend` this process's backend, with sectors summed one by one
/// by it ([`sector_method`]) (`strata serve --crc`, for benchmarks
/// comparing them). Call it before anything is checksummed: once the
/// process has chosen, the choice stands and is returned as the error.
pub fn force_backend(backend: Backend) -> Result<(), Backend> {
    let wanted = Chosen { backend, forced: true };
    match *CHOSEN.get_or_init(|| wanted) {
        chosen if chosen == wanted => Ok(()),
        chosen => Err(chosen.backend),
    }
}

/// The backend for this CPU: `crc-fast` where it folds with AVX-512
/// VPCLMULQDQ (twice the `crc32c` crate's speed there), else the `crc32c`
/// crate (a quarter to a third faster than `crc-fast`'s SSE code on an AMD
/// EPYC without AVX-512). Decided by CPU features, not by timing: timed at
/// start, the crate's speed on one buffer varied between processes on the
/// same machine by a third (3.5 or 4.6 µs for 64 KiB), and one start in
/// five picked the slower backend.
fn for_this_cpu() -> Backend {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512vl") && has!("vpclmulqdq") {
            return Backend::CrcFast;
        }
    }
    Backend::Crc32c
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

/// The CRC-32C of `a` followed by `b`, given `crc1` of `a`, `crc2` of `b`
/// and `len2`, the length of `b` (`crc32c::crc32c_combine`'s contract).
///
/// The crate builds 32x32 bit matrices for each call (about 30 µs for a
/// 1 MiB `b` here, where summing the megabyte takes 80); a send stream
/// combines twice per record. This multiplies by x^(8 len2) modulo the
/// polynomial instead: about 20 squarings read from a table and at most 64
/// multiplications of 32-bit polynomials.
pub fn crc32c_combine(crc1: u32, crc2: u32, len2: usize) -> u32 {
    gf2::multiply(gf2::x_to_8n(len2 as u64), crc1) ^ crc2
}

/// Arithmetic on polynomials over GF(2) modulo CRC-32C's, in the CRC's bit
/// order: bit 31 holds the coefficient of x^0, bit 0 that of x^31.
mod gf2 {
    /// CRC-32C's polynomial (x^32 dropped), in that bit order.
    const POLY: u32 = 0x82f6_3b78;
    /// The polynomial 1.
    const ONE: u32 = 1 << 31;

    /// `a * b` modulo the polynomial.
    pub(super) fn multiply(a: u32, mut b: u32) -> u32 {
        let mut product = 0;
        let mut bit = ONE;
        while bit != 0 {
            if a & bit != 0 {
                product ^= b;
            }
            // b *= x: the x^31 coefficient (bit 0) wraps to the polynomial.
            b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
            bit >>= 1;
        }
        product
    }

    /// x^(2^k) modulo the polynomial, k = 0..67 (3 + the bits of a u64).
    fn powers() -> &'static [u32; 67] {
        static POWERS: std::sync::OnceLock<[u32; 67]> = std::sync::OnceLock::new();
        POWERS.get_or_init(|| {
            let mut table = [0; 67];
            let mut power = ONE >> 1; // x^1
            for entry in table.iter_mut() {
                *entry = power;
                power = multiply(power, power);
            }
            table
        })
    }

    /// x^(8 n) modulo the polynomial: shifting a CRC over n zero bytes.
    pub(super) fn x_to_8n(n: u64) -> u32 {
        let powers = powers();
        let mut result = ONE;
        let mut n = n;
        // x^(8 n) = product of x^(2^(k + 3)) over the bits k set in n.
        let mut k = 3;
        while n != 0 {
            if n & 1 != 0 {
                result = multiply(powers[k], result);
            }
            n >>= 1;
            k += 1;
        }
        result
    }
}

/// How whole 4 KiB sectors are checksummed ([`extend_sector_sums`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SectorMethod {
    /// One sector at a time with the process's [`backend`].
    Each(Backend),
    /// Six sectors at once: three folded with 256-bit carry-less multiplies
    /// (AVX2 VPCLMULQDQ) while the `crc32` instruction runs over the other
    /// three, so both units work every cycle (x86-64 only).
    SixAtOnce,
}

impl SectorMethod {
    /// Every method this CPU can run.
    pub fn available() -> Vec<SectorMethod> {
        let mut methods: Vec<SectorMethod> = Backend::ALL.into_iter().map(SectorMethod::Each).collect();
        if six_at_once::available() {
            methods.push(SectorMethod::SixAtOnce);
        }
        methods
    }

    pub fn name(self) -> &'static str {
        match self {
            SectorMethod::Each(backend) => backend.name(),
            SectorMethod::SixAtOnce => "six at once (vpclmulqdq + crc32)",
        }
    }
}

static SECTOR_METHOD: OnceLock<SectorMethod> = OnceLock::new();

/// How this process checksums sectors: six at once where the CPU can and
/// that is faster than the [`backend`] one by one (timed once, like the
/// backend); one by one when [`force_backend`] named the backend.
pub fn sector_method() -> SectorMethod {
    *SECTOR_METHOD.get_or_init(|| {
        let chosen = chosen();
        let each = SectorMethod::Each(chosen.backend);
        if chosen.forced || !six_at_once::available() {
            return each;
        }
        let data: Vec<u8> = (0..SUM_SECTOR_BYTES * 6)
            .map(|i| (i.wrapping_mul(131) ^ (i >> 9)) as u8)
            .collect();
        let mut sums = Vec::with_capacity(6);
        let mut best = [Duration::MAX; 2];
        for _ in 0..8 {
            for (index, method) in [each, SectorMethod::SixAtOnce].into_iter().enumerate() {
                sums.clear();
                let started = Instant::now();
                extend_sector_sums_with(method, std::hint::black_box(&data), &mut sums);
                best[index] = best[index].min(started.elapsed());
                std::hint::black_box(&sums);
            }
        }
        if best[1] < best[0] {
            SectorMethod::SixAtOnce
        } else {
            each
        }
    })
}

/// Appends the CRC-32C of each [`SUM_SECTOR_BYTES`] sector of `data` to
/// `out`, the way [`sector_method`] chose (a shorter last piece gets the
/// checksum of what there is, as `chunks` would give it). Every checksum
/// the pool stores for data, and checks on a read, is one of these.
pub fn extend_sector_sums(data: &[u8], out: &mut Vec<u32>) {
    extend_sector_sums_with(sector_method(), data, out);
}

/// [`extend_sector_sums`] with a given method (for benchmarks and tests).
///
/// # Panics
/// If the method is six at once on a CPU without it.
pub fn extend_sector_sums_with(method: SectorMethod, data: &[u8], out: &mut Vec<u32>) {
    let mut rest = data;
    let backend = match method {
        SectorMethod::Each(backend) => backend,
        SectorMethod::SixAtOnce => {
            while rest.len() >= 6 * SUM_SECTOR_BYTES {
                let (six, tail) = rest.split_at(6 * SUM_SECTOR_BYTES);
                let mut sums = [0u32; 6];
                six_at_once::sums(six, &mut sums);
                out.extend_from_slice(&sums);
                rest = tail;
            }
            backend()
        }
    };
    out.extend(rest.chunks(SUM_SECTOR_BYTES).map(|sector| backend.checksum(sector)));
}

/// Six sectors at once (see [`SectorMethod::SixAtOnce`]).
///
/// Folding: a sector is read as 128-bit blocks, each a polynomial over
/// GF(2) in the bit-reflected order CRC-32C uses. Multiplying a block by
/// x^(8·D) mod P (a 32-bit constant, carry-less) moves it D bytes further
/// without changing the remainder it leaves, so accumulators can absorb the
/// block D bytes on by "fold, then xor". Here each folded sector has two
/// 256-bit accumulators (64 bytes a step); at the end they fold into one,
/// its two halves into one 128-bit value, and the `crc32` instruction over
/// those 16 bytes gives the sector's CRC. The initial CRC state (all ones)
/// is xored into the first four bytes. The constants are x^(8D+31) and
/// x^(8D−33) mod P, bit-reflected, computed at compile time
/// ([`six_at_once::x_pow_mod_p`]).
mod six_at_once {
    /// x^n mod P (CRC-32C's polynomial), bit-reflected: bit 31 is x^0.
    pub const fn x_pow_mod_p(n: u32) -> u64 {
        let mut value: u32 = 0x8000_0000;
        let mut i = 0;
        while i < n {
            let carry = value & 1;
            value >>= 1;
            if carry != 0 {
                value ^= 0x82F6_3B78;
            }
            i += 1;
        }
        value as u64
    }

    /// Fold constants for a distance of `bytes`: (for the low 64 bits of a
    /// block, for the high 64 bits).
    pub const fn fold_by(bytes: u32) -> (u64, u64) {
        (x_pow_mod_p(bytes * 8 + 31), x_pow_mod_p(bytes * 8 - 33))
    }

    #[cfg(target_arch = "x86_64")]
    pub fn available() -> bool {
        use std::arch::is_x86_feature_detected as has;
        has!("avx2") && has!("vpclmulqdq") && has!("pclmulqdq") && has!("sse4.2")
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn available() -> bool {
        false
    }

    /// The CRC-32C of each of the six sectors in `data`.
    #[cfg(target_arch = "x86_64")]
    pub fn sums(data: &[u8], out: &mut [u32; 6]) {
        assert_eq!(data.len(), 6 * super::SUM_SECTOR_BYTES);
        assert!(available());
        // SAFETY: the CPU has the features (checked above); `data` holds six sectors.
        unsafe { x86::sums(data.as_ptr(), out) }
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn sums(_: &[u8], _: &mut [u32; 6]) {
        unreachable!("six_at_once::sums without available()")
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use super::super::SUM_SECTOR_BYTES as SECTOR;
        use super::fold_by;
        use std::arch::x86_64::*;

        const STEP: (u64, u64) = fold_by(64);
        const BY_32: (u64, u64) = fold_by(32);
        const BY_16: (u64, u64) = fold_by(16);

        /// `x` moved on by the constants' distance, plus `next`.
        #[inline(always)]
        unsafe fn fold(x: __m256i, k: __m256i, next: __m256i) -> __m256i {
            let low = _mm256_clmulepi64_epi128::<0x00>(x, k);
            let high = _mm256_clmulepi64_epi128::<0x11>(x, k);
            _mm256_xor_si256(_mm256_xor_si256(low, high), next)
        }

        #[inline(always)]
        unsafe fn load(sector: *const u8, at: usize) -> __m256i {
            // SAFETY: the caller keeps `at + 32` within the sector.
            unsafe { _mm256_loadu_si256(sector.add(at) as *const __m256i) }
        }

        #[inline(always)]
        unsafe fn both(k: (u64, u64)) -> __m256i {
            _mm256_set_epi64x(k.1 as i64, k.0 as i64, k.1 as i64, k.0 as i64)
        }

        /// The CRC of a sector folded into accumulators `a` (its first 32
        /// bytes of each 64) and `b` (the second 32).
        #[inline(always)]
        unsafe fn finish(a: __m256i, b: __m256i) -> u32 {
            let x = fold(a, both(BY_32), b);
            let k16 = _mm_set_epi64x(BY_16.1 as i64, BY_16.0 as i64);
            let (low, high) = (_mm256_castsi256_si128(x), _mm256_extracti128_si256::<1>(x));
            let folded = _mm_xor_si128(
                _mm_xor_si128(
                    _mm_clmulepi64_si128::<0x00>(low, k16),
                    _mm_clmulepi64_si128::<0x11>(low, k16),
                ),
                high,
            );
            let crc = _mm_crc32_u64(0, _mm_cvtsi128_si64(folded) as u64);
            !(_mm_crc32_u64(crc, _mm_extract_epi64::<1>(folded) as u64) as u32)
        }

        /// # Safety
        /// `data` holds six sectors; the CPU has AVX2, VPCLMULQDQ, PCLMULQDQ and SSE4.2.
        #[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
        pub unsafe fn sums(data: *const u8, out: &mut [u32; 6]) {
            // SAFETY: every access below stays inside the six sectors.
            unsafe {
                let folded = [data, data.add(SECTOR), data.add(2 * SECTOR)];
                let summed = [
                    data.add(3 * SECTOR) as *const u64,
                    data.add(4 * SECTOR) as *const u64,
                    data.add(5 * SECTOR) as *const u64,
                ];
                let initial = _mm256_set_epi64x(0, 0, 0, 0xffff_ffff);
                let mut a = [
                    _mm256_xor_si256(load(folded[0], 0), initial),
                    _mm256_xor_si256(load(folded[1], 0), initial),
                    _mm256_xor_si256(load(folded[2], 0), initial),
                ];
                let mut b = [load(folded[0], 32), load(folded[1], 32), load(folded[2], 32)];
                let step = both(STEP);
                let mut crc = [!0u64; 3];
                for word in 0..8 {
                    crc[0] = _mm_crc32_u64(crc[0], summed[0].add(word).read_unaligned());
                    crc[1] = _mm_crc32_u64(crc[1], summed[1].add(word).read_unaligned());
                    crc[2] = _mm_crc32_u64(crc[2], summed[2].add(word).read_unaligned());
                }
                let mut at = 64;
                while at < SECTOR {
                    for s in 0..3 {
                        a[s] = fold(a[s], step, load(folded[s], at));
                        b[s] = fold(b[s], step, load(folded[s], at + 32));
                    }
                    for word in at / 8..at / 8 + 8 {
                        crc[0] = _mm_crc32_u64(crc[0], summed[0].add(word).read_unaligned());
                        crc[1] = _mm_crc32_u64(crc[1], summed[1].add(word).read_unaligned());
                        crc[2] = _mm_crc32_u64(crc[2], summed[2].add(word).read_unaligned());
                    }
                    at += 64;
                }
                for s in 0..3 {
                    out[s] = finish(a[s], b[s]);
                    out[3 + s] = !(crc[s] as u32);
                }
            }
        }
    }
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
    assert!(dst.len().is_multiple_of(SUM_SECTOR_BYTES) && sums.len() == dst.len() / SUM_SECTOR_BYTES);
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

    /// A plain bit-at-a-time CRC-32C: what every fast path must agree with.
    fn bitwise_reference(data: &[u8]) -> u32 {
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

    #[test]
    fn combine_agrees_with_the_crate_and_with_summing_both_parts() {
        let data: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for (split, end) in [
            (0, 0),
            (0, 5),
            (5, 5),
            (1, 2),
            (3, 4099),
            (4096, 8192),
            (12_345, 70_000),
            (0, 70_000),
        ] {
            let (a, b) = data[..end].split_at(split);
            let combined = crc32c_combine(crc32c(a), crc32c(b), b.len());
            assert_eq!(combined, crc32c(&data[..end]), "split {split} end {end}");
            assert_eq!(combined, ::crc32c::crc32c_combine(crc32c(a), crc32c(b), b.len()));
        }
        // Lengths far beyond any buffer (a whole stream, bits 60+ of a u64).
        for len2 in [1 << 20, (1 << 20) + 17, 1 << 32, (1 << 40) + 3, u64::MAX as usize] {
            for (crc1, crc2) in [(0, 0), (0xdead_beef, 0x1234_5678), (!0, 1)] {
                assert_eq!(
                    crc32c_combine(crc1, crc2, len2),
                    ::crc32c::crc32c_combine(crc1, crc2, len2),
                    "{crc1:#x} {crc2:#x} {len2}"
                );
            }
        }
    }

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
    fn crc_option_names_each_backend_and_nothing_else() {
        for backend in Backend::ALL {
            assert_eq!(Backend::from_name(backend.name()), Some(backend));
        }
        assert_eq!(Backend::from_name("crc32"), None);
        assert_eq!(Backend::from_name(""), None);
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
        // Checks the SIMD paths on the lengths the engine uses (512-byte to
        // 64 KiB, odd tails).
        let data: Vec<u8> = (0..65_537u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for backend in Backend::ALL {
            for len in [1, 7, 63, 64, 255, 512, 4096, 4097, 16_384, 65_536, 65_537] {
                let expected = bitwise_reference(&data[..len]);
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
    #[test]
    fn fold_constants_are_the_published_ones() {
        // Fold-by-64-bytes and by-16-bytes constants for CRC-32C as Intel's
        // white paper and every PCLMULQDQ implementation use them.
        assert_eq!(six_at_once::fold_by(64), (0x740e_ef02, 0x9e4a_ddf8));
        assert_eq!(six_at_once::fold_by(16), (0xf20c_0dfe, 0x493c_7d27));
    }

    #[test]
    fn sector_sums_match_each_backend_whatever_the_method_and_count() {
        let data: Vec<u8> = (0..20 * SUM_SECTOR_BYTES as u64)
            .map(|i| (i.wrapping_mul(0x9e37_79b9) >> 11) as u8)
            .collect();
        let mut methods = vec![
            SectorMethod::Each(Backend::Crc32c),
            SectorMethod::Each(Backend::CrcFast),
        ];
        if six_at_once::available() {
            methods.push(SectorMethod::SixAtOnce);
        } else {
            eprintln!("no AVX2 + VPCLMULQDQ here: six at once is not checked on this CPU");
        }
        // 0 to 20 sectors: no group, one group, groups plus every tail length.
        for sectors in 0..=20 {
            let bytes = &data[..sectors * SUM_SECTOR_BYTES];
            let expected: Vec<u32> = bytes
                .chunks(SUM_SECTOR_BYTES)
                .map(|s| Backend::Crc32c.checksum(s))
                .collect();
            for &method in &methods {
                let mut sums = vec![7];
                extend_sector_sums_with(method, bytes, &mut sums);
                assert_eq!(sums[0], 7, "appends");
                assert_eq!(&sums[1..], &expected[..], "{method:?}, {sectors} sectors");
            }
        }
        // A short last piece is summed as it is (as `chunks` would give it).
        let ragged = &data[..13 * SUM_SECTOR_BYTES + 100];
        let expected: Vec<u32> = ragged
            .chunks(SUM_SECTOR_BYTES)
            .map(|s| Backend::Crc32c.checksum(s))
            .collect();
        for &method in &methods {
            let mut sums = Vec::new();
            extend_sector_sums_with(method, ragged, &mut sums);
            assert_eq!(sums, expected, "{method:?}, ragged");
        }
        // A sector of zeros and one of ones, against RFC 3720-style known
        // values computed bitwise (not by the code under test).
        let mut special = vec![0u8; 6 * SUM_SECTOR_BYTES];
        special[SUM_SECTOR_BYTES..2 * SUM_SECTOR_BYTES].fill(0xff);
        special[4 * SUM_SECTOR_BYTES..5 * SUM_SECTOR_BYTES].fill(0xff);
        let mut sums = Vec::new();
        extend_sector_sums(&special, &mut sums);
        let expected: Vec<u32> = special.chunks(SUM_SECTOR_BYTES).map(bitwise_reference).collect();
        assert_eq!(sums, expected);
    }
}
