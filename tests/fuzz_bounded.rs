//! Every fuzz target of `fuzz/`, run for a bounded time on stable Rust:
//! inputs mutated from the target's seeds in `fuzz/corpus-seeds/` (bit and
//! byte flips, boundary integers, insertions, deletions, splices of two
//! seeds), each fed to the same entry point libFuzzer drives. A panic (the
//! targets assert their own invariants too) fails the test, with the input
//! saved under `target/fuzz-failures/` and the seed that reproduces the run.
//!
//! This is not coverage-guided: `cargo +nightly fuzz run TARGET` is, for
//! long runs outside CI. `STRATA_FUZZ_SECONDS` sets the time per target
//! (default 3), `STRATA_FUZZ_SEED` the random seed (default: from the clock,
//! printed).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A small xorshift generator: reproducible from its seed, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const INTERESTING: [u64; 10] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    u64::MAX - 1,
    u64::MAX,
];

/// One mutation of `input` (seeds as splice partners).
fn mutate(input: &mut Vec<u8>, seeds: &[Vec<u8>], rng: &mut Rng) {
    match rng.below(8) {
        0 if !input.is_empty() => {
            let at = rng.below(input.len());
            input[at] ^= 1 << rng.below(8);
        }
        1 if !input.is_empty() => {
            let at = rng.below(input.len());
            input[at] = rng.next() as u8;
        }
        2 if !input.is_empty() => {
            // A boundary integer, 1 to 8 bytes wide, either byte order.
            let width = [1, 2, 4, 8][rng.below(4)];
            let value = INTERESTING[rng.below(INTERESTING.len())];
            let bytes = if rng.below(2) == 0 {
                value.to_be_bytes()
            } else {
                value.to_le_bytes()
            };
            let bytes = if rng.below(2) == 0 {
                &bytes[8 - width..]
            } else {
                &bytes[..width]
            };
            let at = rng.below(input.len());
            for (offset, byte) in bytes.iter().enumerate() {
                if let Some(slot) = input.get_mut(at + offset) {
                    *slot = *byte;
                }
            }
        }
        3 => {
            let at = rng.below(input.len() + 1);
            let count = 1 + rng.below(64);
            let fill = rng.next() as u8;
            let random = rng.below(2) == 0;
            let bytes: Vec<u8> = (0..count)
                .map(|_| if random { rng.next() as u8 } else { fill })
                .collect();
            input.splice(at..at, bytes);
        }
        4 if !input.is_empty() => {
            let at = rng.below(input.len());
            let count = 1 + rng.below(input.len() - at);
            input.drain(at..at + count);
        }
        5 if !input.is_empty() => {
            // A range repeated in place.
            let at = rng.below(input.len());
            let count = 1 + rng.below((input.len() - at).min(256));
            let copy = input[at..at + count].to_vec();
            let to = rng.below(input.len() + 1);
            input.splice(to..to, copy);
        }
        6 if !seeds.is_empty() => {
            // The head of this input with the tail of a seed.
            let other = &seeds[rng.below(seeds.len())];
            let keep = rng.below(input.len() + 1);
            let from = rng.below(other.len() + 1);
            input.truncate(keep);
            input.extend_from_slice(&other[from..]);
        }
        _ => {
            let keep = rng.below(input.len() + 1);
            input.truncate(keep);
        }
    }
}

fn seeds_of(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus-seeds")
        .join(target);
    let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| std::fs::read(entry.unwrap().path()).unwrap())
        .collect();
    seeds.sort();
    seeds
}

fn save_failure(target: &str, input: &[u8]) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-failures");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{target}-{:08x}", crc_of(input)));
    std::fs::write(&path, input).unwrap();
    path
}

/// FNV-1a: a name for a failing input's file.
fn crc_of(bytes: &[u8]) -> u32 {
    bytes
        .iter()
        .fold(0x811c_9dc5u32, |h, b| (h ^ *b as u32).wrapping_mul(0x0100_0193))
}

fn fuzz(target: &str, run: fn(&[u8])) {
    let seconds: u64 = std::env::var("STRATA_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let seed: u64 = std::env::var("STRATA_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
        | 1;
    let seeds = seeds_of(target);
    assert!(!seeds.is_empty(), "{target}: no seeds");
    let mut rng = Rng(seed ^ crc_of(target.as_bytes()) as u64);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut runs = 0u64;
    // Every seed as it is first, then mutants until the deadline.
    let mut queue: Vec<Vec<u8>> = seeds.clone();
    // (At least one mutant, however slow the seeds were.)
    while Instant::now() < deadline || !queue.is_empty() || runs == seeds.len() as u64 {
        let input = match queue.pop() {
            Some(input) => input,
            None => {
                let mut input = seeds[rng.below(seeds.len())].clone();
                for _ in 0..1 + rng.below(8) {
                    mutate(&mut input, &seeds, &mut rng);
                }
                input
            }
        };
        if catch_unwind(AssertUnwindSafe(|| run(&input))).is_err() {
            let path = save_failure(target, &input);
            panic!(
                "{target} panicked on an input of {} bytes, saved as {} (STRATA_FUZZ_SEED={seed} repeats the run)",
                input.len(),
                path.display()
            );
        }
        runs += 1;
    }
    eprintln!("{target}: {runs} inputs in {seconds} s, STRATA_FUZZ_SEED={seed}");
}

macro_rules! targets {
    ($($name:ident => $entry:path,)*) => {
        $(
            #[test]
            fn $name() {
                fuzz(stringify!($name), $entry);
            }
        )*
        const LISTED: &[&str] = &[$(stringify!($name)),*];
    };
}

targets! {
    iscsi_cdb => strata::frontend::iscsi::fuzzing::cdb_input,
    iscsi_login => strata::frontend::iscsi::fuzzing::login_input,
    iscsi_pdu => strata::frontend::iscsi::fuzzing::pdu_input,
    meta_crc_page_use => strata::pool::fuzzing::crc_page_use,
    meta_log_block => strata::pool::fuzzing::log_block_input,
    meta_map_page_use => strata::pool::fuzzing::map_page_use,
    meta_namespace_use => strata::pool::fuzzing::namespace_use,
    meta_page => strata::pool::fuzzing::page_input,
    meta_superblock => strata::pool::fuzzing::superblock_input,
    nbd_option => strata::frontend::nbd::fuzzing::option_input,
    nbd_request => strata::frontend::nbd::fuzzing::request_input,
    nfs_call => strata::frontend::nfs::fuzzing::call_sequence_input,
    nfs_rpc => strata::frontend::nfs::fuzzing::rpc_input,
    scsi_command => strata::frontend::iscsi::fuzzing::scsi_input,
    send_stream => strata::control::fuzzing::stream_input,
}

/// The list above names every target `fuzz/` has: a new target is run here
/// too, or this fails.
#[test]
fn every_fuzz_target_is_listed() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/fuzz_targets");
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path().file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    found.sort();
    assert_eq!(found, LISTED);
}
