//! A shared mapping of a buffered device file, for reads and writes whose
//! pages the kernel already holds in memory.
//!
//! A buffered `pread` copies the page cache into our buffer, and the pool
//! then reads that buffer again to check each sector's CRC-32C. Through a
//! mapping of the file the two become one pass: each word is loaded from
//! the page cache once, summed and stored into the buffer
//! ([`crate::checksum::copy_summing_sectors`]). On the machine of the 1M
//! sequential read benchmark that is ~90 µs per MiB against ~165 for
//! `pread` plus checksums (BENCHMARKS.md, "NBD"): the copy costs what the memory
//! costs, and the checksums come free with it.
//!
//! What makes it safe:
//! - **Only resident pages.** `mincore` first: a range with any page the
//!   page cache does not hold is refused, so a read through the mapping
//!   never waits for the disk (the caller reads the usual way, through the
//!   I/O engine, which does).
//! - **Bytes are copied, never lent.** The reply is built from our buffer,
//!   exactly the bytes that were summed; nothing refers to the mapping once
//!   the copy returns, so freed and reused space can never leak into a reply.
//! - **A page that cannot be read does not kill the process.** Touching a
//!   mapped page that the kernel cannot read (a media error, a file cut
//!   short behind our back) raises SIGBUS. The handler installed here checks
//!   whether the faulting address lies in the range this thread is copying;
//!   if so it maps a page of zeros over it, notes the fault and returns, the
//!   copy finishes, the file is mapped again over the range, and the read is
//!   refused (the usual read then reports the device's own error). Any other
//!   SIGBUS goes to the handler that was there before (Rust's, or the
//!   default action).
//! - **The checksums decide.** A concurrent reader that saw those zeros, or
//!   any other surprise, gets sums that do not match the stored ones; the
//!   pool treats a mismatch here as "read it the usual way", which verifies
//!   again and only then reports and counts corruption.
//!
//! Writes go through the mapping too (a writable device), when the caller
//! chooses (`FileDevice::write_now` does when another thread is inside a
//! `pwrite` of the same file): a write of whole resident pages, up to
//! 64 KiB, is a memory copy into the page cache, where a buffered `pwrite`
//! takes the file's inode lock exclusively (ext4, for every buffered write)
//! and costs ~23 µs per 4 KiB on a small cloud VM; a hundred threads
//! writing one device file spend most of their time spinning and sleeping
//! on that lock. The first store to a clean page faults once (the
//! file system's `page_mkwrite`, under a shared lock); later stores until
//! the page is written back cost only the copy, but a flush write-protects
//! the page again, so pages flushed after every write are cheaper written
//! with `pwrite` (docs/DEVICES.md). Durability is the same: `fdatasync`
//! writes back pages dirtied through a shared mapping as it does those
//! `pwrite` dirtied. What keeps it safe:
//! - **Only resident, whole pages**, as for reads: a write never waits for
//!   the disk to read a page it is about to overwrite (`pwrite` of a whole
//!   page does not read it; a store through the mapping would).
//! - **A failed fault loses nothing.** A store the file system refuses
//!   (no space to back a page of a sparse file, a media error) raises
//!   SIGBUS like a read; the handler puts a writable page of zeros there,
//!   the copy finishes into it, the range is mapped again and the write is
//!   refused, so the caller writes it with `pwrite`, which reports the
//!   error. The pool writes a page from one place at a time (a block's
//!   stripe lock held exclusively, a new slot), so nobody else was writing
//!   that page meanwhile.
//!
//! Only x86-64 with SSE4.2 and 4 KiB pages; elsewhere no mapping is made.

use std::cell::Cell;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{compiler_fence, AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::checksum::{can_copy_summing, copy_summing_sectors, SUM_SECTOR_BYTES};

const PAGE: usize = 4096;
/// The largest write copied through the mapping. The inode lock a
/// `pwrite` takes is paid per call, a fault per clean page: a megabyte
/// `pwrite` spreads its lock over 256 pages, where a copy through the
/// mapping could fault 256 times.
pub const WRITE_MAX: usize = 64 << 10;
/// Pages asked of `mincore` at a time (its answer lives on the stack).
const RESIDENCY_PAGES: usize = 512;

thread_local! {
    /// The address range this thread is copying from (start, end); (0, 0) when none.
    static GUARDED: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// Set by the SIGBUS handler when a page in [`GUARDED`] could not be read.
    static FAULTED: Cell<bool> = const { Cell::new(false) };
}

/// The SIGBUS disposition before ours, for signals that are not ours.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
/// Whether our handler is in place (installed once per process).
static INSTALLED: OnceLock<bool> = OnceLock::new();

fn install_handler() -> bool {
    *INSTALLED.get_or_init(|| {
        // SAFETY: plain sigaction calls with valid (zeroed, then filled)
        // structures; the handler only does async-signal-safe work.
        unsafe {
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut previous) != 0 {
                return false;
            }
            let _ = PREVIOUS.set(previous);
            let mut ours: libc::sigaction = std::mem::zeroed();
            ours.sa_sigaction = on_sigbus as *const () as usize;
            ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut ours.sa_mask);
            libc::sigaction(libc::SIGBUS, &ours, std::ptr::null_mut()) == 0
        }
    })
}

extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let address = unsafe { (*info).si_addr() } as usize;
    let (start, end) = GUARDED.with(|g| g.get());
    if address >= start && address < end {
        let page = address & !(PAGE - 1);
        // SAFETY: replaces one page of our own mapping (inside the range
        // being copied) with zeros; mmap is a plain system call.
        let mapped = unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                PAGE,
                // Writable: a store that faulted runs again on return.
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if mapped != libc::MAP_FAILED {
            FAULTED.with(|f| f.set(true));
            return;
        }
    }
    // Not ours: whatever was there before.
    let previous = PREVIOUS.get();
    match previous {
        Some(previous) if previous.sa_sigaction != libc::SIG_DFL && previous.sa_sigaction != libc::SIG_IGN => {
            // SAFETY: the previous handler, called as it was registered.
            unsafe {
                if previous.sa_flags & libc::SA_SIGINFO != 0 {
                    let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(previous.sa_sigaction);
                    handler(signal, info, context);
                } else {
                    let handler: extern "C" fn(libc::c_int) = std::mem::transmute(previous.sa_sigaction);
                    handler(signal);
                }
            }
        }
        _ => {
            // The default action: put it back. A fault re-runs the access on
            // return and the signal kills the process as it always would; a
            // signal sent by someone is raised again.
            // SAFETY: sigaction and raise are async-signal-safe.
            unsafe {
                let mut default: libc::sigaction = std::mem::zeroed();
                default.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &default, std::ptr::null_mut());
                if (*info).si_code <= 0 {
                    libc::raise(signal);
                }
            }
        }
    }
}

/// A `MAP_SHARED` mapping of a whole device file (writable for a writable
/// device).
pub struct Mapping {
    base: *mut u8,
    len: usize,
    file: Arc<File>,
    writable: bool,
    /// Restoring the file over a faulted range failed: the mapping is not
    /// used again.
    broken: AtomicBool,
}

// SAFETY: the mapping is read (with volatile loads, through
// `copy_summing_sectors`), written by `write` into ranges the caller owns
// (see there), and remapped with MAP_FIXED, which the kernel serialises;
// the pointer is never handed out.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `file` (for writes too if `writable`: the file
    /// must be open for writing), or `None` where I/O through a mapping is
    /// not done (see the module notes) or the mapping fails.
    pub fn new(file: &Arc<File>, len: u64, writable: bool) -> Option<Mapping> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if len == 0 || page != PAGE as libc::c_long || !can_copy_summing() || !install_handler() {
            return None;
        }
        let len = usize::try_from(len).ok()?;
        // SAFETY: a fresh shared mapping of a descriptor we hold.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                protection(writable),
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            tracing::debug!(error = %std::io::Error::last_os_error(), "no mapping of the device file; reads use the engine only");
            return None;
        }
        Some(Mapping {
            base: base as *mut u8,
            len,
            file: file.clone(),
            writable,
            broken: AtomicBool::new(false),
        })
    }

    /// Whether writes go through the mapping too.
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// Copies `data` to `offset` of the file through the mapping, if the
    /// mapping is writable and the range is whole pages (at most
    /// [`WRITE_MAX`] bytes), all in the page cache. `false`: nothing is
    /// known to be written (not resident, misaligned, outside the mapping,
    /// or the file system refused a page: some of the range may hold new
    /// bytes); write it the usual way.
    ///
    /// The caller must be the only one writing `[offset, offset + len)`
    /// until this returns (the pool holds the block's stripe exclusively).
    pub fn write(&self, offset: u64, data: &[u8]) -> bool {
        let len = data.len();
        let Ok(start) = usize::try_from(offset) else {
            return false;
        };
        if !self.writable
            || len == 0
            || len > WRITE_MAX
            || start % PAGE != 0
            || !len.is_multiple_of(PAGE)
            || start.checked_add(len).is_none_or(|end| end > self.len)
            || self.broken.load(Ordering::Relaxed)
            || !self.resident(start, len)
        {
            return false;
        }
        self.write_guarded(start, data)
    }

    /// The copy of [`Mapping::write`], its range checked: `false` if a page
    /// faulted (the range is then mapped again).
    fn write_guarded(&self, start: usize, data: &[u8]) -> bool {
        // SAFETY: the range is mapped writable, page aligned, and ours to
        // write (see `write`); a page the file system refuses is replaced
        // by writable zeros by the SIGBUS handler and the store runs again.
        self.guarded(start, data.len(), |dst| unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len())
        })
    }

    /// Copies whole sectors at `offset` into `dst` and each sector's
    /// CRC-32C into `sums`, if every page of the range is in the page cache
    /// and could be read. `false`: nothing usable was copied (not resident,
    /// outside the mapping, or a page faulted); read the usual way.
    pub fn copy_summing(&self, offset: u64, dst: &mut [u8], sums: &mut [u32]) -> bool {
        let len = dst.len();
        let Ok(start) = usize::try_from(offset) else {
            return false;
        };
        if len == 0
            || start % SUM_SECTOR_BYTES != 0
            || !len.is_multiple_of(SUM_SECTOR_BYTES)
            || sums.len() != len / SUM_SECTOR_BYTES
            || start.checked_add(len).is_none_or(|end| end > self.len)
            || self.broken.load(Ordering::Relaxed)
            || !self.resident(start, len)
        {
            return false;
        }
        self.copy_guarded(start, dst, sums)
    }

    /// The copy of [`Mapping::copy_summing`], its range checked: `false` if
    /// a page faulted (the range is then mapped again).
    fn copy_guarded(&self, start: usize, dst: &mut [u8], sums: &mut [u32]) -> bool {
        // SAFETY: the range is mapped and page aligned; a page that cannot
        // be read is replaced by zeros by the SIGBUS handler.
        self.guarded(start, dst.len(), |src| unsafe { copy_summing_sectors(src, dst, sums) })
    }

    /// Runs `copy` on the mapping's address of `[start, start + len)` with
    /// the range guarded (a SIGBUS inside it maps zeros over the page and
    /// the access runs again); `false` if a page faulted, the range then
    /// mapped again. The caller checked that the range lies in the mapping.
    fn guarded(&self, start: usize, len: usize, copy: impl FnOnce(*mut u8)) -> bool {
        // SAFETY: the caller checked that `start + len` lies inside the mapping.
        let at = unsafe { self.base.add(start) };
        GUARDED.with(|g| g.set((at as usize, at as usize + len)));
        // The handler reads GUARDED: keep the copy between the two stores.
        compiler_fence(Ordering::SeqCst);
        copy(at);
        compiler_fence(Ordering::SeqCst);
        GUARDED.with(|g| g.set((0, 0)));
        if !FAULTED.with(|f| f.replace(false)) {
            return true;
        }
        self.restore(start, len);
        false
    }

    /// Whether the page cache holds every page that `[offset, offset +
    /// len)` touches (`false` for an empty range or one past the mapping).
    pub fn holds(&self, offset: u64, len: usize) -> bool {
        let Ok(start) = usize::try_from(offset) else {
            return false;
        };
        match start.checked_add(len) {
            Some(end) if len > 0 && end <= self.len && !self.broken.load(Ordering::Relaxed) => {
                let first = start - start % PAGE;
                self.resident(first, end - first)
            }
            _ => false,
        }
    }

    /// Whether the page cache holds every page of `[start, start + len)`
    /// (`start` page aligned).
    fn resident(&self, start: usize, len: usize) -> bool {
        let mut pages = [0u8; RESIDENCY_PAGES];
        let mut at = start;
        let end = start + len;
        while at < end {
            let take = (end - at).min(RESIDENCY_PAGES * PAGE);
            let count = take.div_ceil(PAGE);
            // SAFETY: the range lies in the mapping and `pages` has room for
            // one byte per page of it.
            let rc = unsafe { libc::mincore(self.base.add(at) as *mut libc::c_void, take, pages.as_mut_ptr()) };
            if rc != 0 || pages[..count].iter().any(|p| p & 1 == 0) {
                return false;
            }
            at += take;
        }
        true
    }

    /// Maps the file again over a range where the SIGBUS handler put zeros.
    fn restore(&self, start: usize, len: usize) {
        // SAFETY: replaces part of our own mapping with the same file range.
        let remapped = unsafe {
            libc::mmap(
                self.base.add(start) as *mut libc::c_void,
                len,
                protection(self.writable),
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.file.as_raw_fd(),
                start as libc::off_t,
            )
        };
        if remapped == libc::MAP_FAILED {
            tracing::warn!(error = %std::io::Error::last_os_error(), "could not map the device file again after a failed page; reads stop using the mapping");
            self.broken.store(true, Ordering::Relaxed);
        }
    }
}

fn protection(writable: bool) -> libc::c_int {
    if writable {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our mapping, no longer used by anyone (we are dropped).
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    fn file_with(data: &[u8]) -> (tempfile::TempDir, Arc<File>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev");
        std::fs::File::create(&path).unwrap().write_all(data).unwrap();
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        (dir, Arc::new(file))
    }

    fn pattern(len: usize, seed: u64) -> Vec<u8> {
        (0..len as u64)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 7) as u8)
            .collect()
    }

    #[test]
    fn a_resident_range_is_copied_with_its_sectors_checksums_and_sees_later_writes() {
        if !can_copy_summing() {
            eprintln!("no SSE4.2: no mapping is made on this CPU");
            return;
        }
        let data = pattern(1 << 20, 1);
        let (_dir, file) = file_with(&data);
        let mapping = Mapping::new(&file, data.len() as u64, false).expect("mapping");
        let mut dst = vec![0u8; 64 << 10];
        let mut sums = vec![0u32; 16];
        // Just written, so resident.
        assert!(mapping.copy_summing(128 << 10, &mut dst, &mut sums));
        assert_eq!(dst, data[128 << 10..192 << 10]);
        for (index, sum) in sums.iter().enumerate() {
            let at = (128 << 10) + index * SUM_SECTOR_BYTES;
            assert_eq!(*sum, crate::checksum::crc32c(&data[at..at + SUM_SECTOR_BYTES]));
        }
        // A pwrite to the file is what the mapping reads next.
        let new = pattern(4096, 9);
        file.write_all_at(&new, 128 << 10).unwrap();
        assert!(mapping.copy_summing(128 << 10, &mut dst[..4096], &mut sums[..1]));
        assert_eq!(&dst[..4096], &new[..]);
        assert_eq!(sums[0], crate::checksum::crc32c(&new));
        // The page cache holds any range of it, aligned or not; an empty
        // range and one past the end are not held.
        assert!(mapping.holds(0, 1 << 20));
        assert!(mapping.holds(100, 70_000));
        assert!(!mapping.holds(4096, 0));
        assert!(!mapping.holds((1 << 20) - 4096, 8192));
        // Refused: not whole sectors, sums of the wrong length, past the end.
        assert!(!mapping.copy_summing(100, &mut dst[..4096], &mut sums[..1]));
        assert!(!mapping.copy_summing(0, &mut dst[..4096], &mut sums[..2]));
        assert!(!mapping.copy_summing((1 << 20) - 4096, &mut dst[..8192], &mut sums[..2]));
    }

    #[test]
    fn pages_not_in_the_page_cache_are_refused() {
        if !can_copy_summing() {
            return;
        }
        let data = pattern(256 << 10, 2);
        let (_dir, file) = file_with(&data);
        file.sync_all().unwrap();
        let mapping = Mapping::new(&file, data.len() as u64, false).expect("mapping");
        // SAFETY: advice on a descriptor we own.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let mut dst = vec![0u8; 256 << 10];
        let mut sums = vec![0u32; 64];
        // Dropping clean pages is advice the kernel may not take for every
        // page; what must hold is that a range is copied only when mincore
        // finds all of it resident.
        let resident = mapping.resident(0, dst.len());
        assert_eq!(mapping.holds(0, dst.len()), resident);
        assert_eq!(mapping.copy_summing(0, &mut dst, &mut sums), resident);
        if resident {
            assert_eq!(dst, data);
        }
    }

    #[test]
    fn writes_of_whole_resident_pages_reach_the_file_and_others_are_refused() {
        if !can_copy_summing() {
            return;
        }
        let data = pattern(1 << 20, 4);
        let (_dir, file) = file_with(&data);
        let mapping = Mapping::new(&file, data.len() as u64, true).expect("mapping");
        let new = pattern(16 << 10, 5);
        // Just written, so resident: the bytes are the file's at once.
        assert!(mapping.write(64 << 10, &new));
        let mut back = vec![0u8; 16 << 10];
        file.read_exact_at(&mut back, 64 << 10).unwrap();
        assert_eq!(back, new);
        // What the mapping wrote, fdatasync makes durable like a pwrite's
        // (the page is dirty in the page cache either way).
        file.sync_data().unwrap();
        // Refused, nothing written: part of a page, past the end, empty.
        assert!(!mapping.write(4096 + 512, &new[..4096]));
        assert!(!mapping.write(0, &new[..100]));
        assert!(!mapping.write((1 << 20) - 4096, &new[..8192]));
        assert!(!mapping.write(0, &[]));
        assert!(!mapping.write(0, &data[..WRITE_MAX + PAGE]));
        file.read_exact_at(&mut back[..8192], 0).unwrap();
        assert_eq!(&back[..8192], &data[..8192]);
        // A read-only mapping never writes.
        let reader = Mapping::new(&file, data.len() as u64, false).expect("mapping");
        assert!(!reader.write(0, &new[..4096]));
        file.read_exact_at(&mut back[..4096], 0).unwrap();
        assert_eq!(&back[..4096], &data[..4096]);
    }

    #[test]
    fn a_page_the_file_system_refuses_is_refused_without_killing_the_process() {
        if !can_copy_summing() {
            return;
        }
        let data = pattern(256 << 10, 6);
        let (_dir, file) = file_with(&data);
        let mapping = Mapping::new(&file, data.len() as u64, true).expect("mapping");
        // The file cut short: its last pages no longer exist and a store
        // there raises SIGBUS (`write` would refuse the range on mincore's
        // word first; the guarded copy is what must survive the fault).
        file.set_len(160 << 10).unwrap();
        let new = pattern(64 << 10, 7);
        assert!(!mapping.write(128 << 10, &new));
        assert!(
            !mapping.write_guarded(128 << 10, &new),
            "a store past the end was taken"
        );
        assert!(!mapping.broken.load(Ordering::Relaxed));
        // The pages that exist took the copy (the caller writes the range
        // again with pwrite, which reports the error for the rest).
        let mut back = vec![0u8; 32 << 10];
        file.read_exact_at(&mut back, 128 << 10).unwrap();
        assert_eq!(back, new[..32 << 10]);
        assert_eq!(file.metadata().unwrap().len(), 160 << 10, "the file did not grow");
        // The file grows again: the restored mapping writes it.
        file.set_len(256 << 10).unwrap();
        file.write_all_at(&data[160 << 10..], 160 << 10).unwrap();
        assert!(mapping.write(128 << 10, &new));
        let mut back = vec![0u8; 64 << 10];
        file.read_exact_at(&mut back, 128 << 10).unwrap();
        assert_eq!(back, new);
    }

    #[test]
    fn a_page_that_cannot_be_read_is_refused_without_killing_the_process() {
        if !can_copy_summing() {
            return;
        }
        let data = pattern(256 << 10, 3);
        let (_dir, file) = file_with(&data);
        let mapping = Mapping::new(&file, data.len() as u64, false).expect("mapping");
        let mut dst = vec![0u8; 64 << 10];
        let mut sums = vec![0u32; 16];
        assert!(mapping.copy_summing(128 << 10, &mut dst, &mut sums));
        // Cut the file short behind the mapping's back: its last pages no
        // longer exist and touching them raises SIGBUS. (mincore no longer
        // counts them, so `copy_summing` would refuse the range before
        // touching it; the guarded copy is what must survive the fault.)
        file.set_len(160 << 10).unwrap();
        assert!(!mapping.copy_summing(128 << 10, &mut dst, &mut sums));
        assert!(
            !mapping.copy_guarded(128 << 10, &mut dst, &mut sums),
            "a range past the end of the file was copied"
        );
        assert_eq!(&dst[..32 << 10], &data[128 << 10..160 << 10]);
        assert!(
            dst[32 << 10..].iter().all(|&b| b == 0),
            "the missing pages read as the handler's zeros"
        );
        assert!(!mapping.broken.load(Ordering::Relaxed));
        // The part that still exists reads as before, through the restored mapping.
        dst.fill(0);
        assert!(mapping.copy_summing(128 << 10, &mut dst[..32 << 10], &mut sums[..8]));
        assert_eq!(&dst[..32 << 10], &data[128 << 10..160 << 10]);
        // The file grows again: the mapping serves it.
        file.write_all_at(&data[160 << 10..], 160 << 10).unwrap();
        assert!(mapping.copy_summing(128 << 10, &mut dst, &mut sums));
        assert_eq!(dst, data[128 << 10..192 << 10]);
    }
}
