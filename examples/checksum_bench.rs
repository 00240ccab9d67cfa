//! Throughput of strata's CRC-32C on the sizes the engine checksums (a
//! 4 KiB sector, a 16 KiB block, 1 MiB), for each implementation and for
//! the one the process picked (`strata::checksum::backend`); then 1 MiB as
//! 256 sector checksums by each sector method (`extend_sector_sums`), and
//! copied while summed (`copy_summing_sectors`, the mapped read path).
//!
//! `cargo run --release --example checksum_bench` (BENCHMARKS.md).

use std::time::Instant;

use strata::checksum::{
    backend, can_copy_summing, copy_summing_sectors, extend_sector_sums_with, sector_method, Backend, SectorMethod,
};

fn main() {
    let data: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(7) ^ (i >> 3)) as u8)
        .collect();
    println!("chosen: {}; sectors: {}", backend().name(), sector_method().name());
    for candidate in Backend::ALL {
        for size in [4096usize, 16384, 1 << 20] {
            let iterations = (1usize << 30) / size;
            let mut sink = 0u32;
            let started = Instant::now();
            for i in 0..iterations {
                let at = (i * size) % data.len();
                sink = sink.wrapping_add(candidate.checksum(&data[at..at + size]));
            }
            let seconds = started.elapsed().as_secs_f64();
            println!(
                "{:>8} {size:>8} bytes: {:6.1} GB/s ({:.2} µs per MiB)  [{sink:08x}]",
                candidate.name(),
                (iterations * size) as f64 / seconds / 1e9,
                seconds * 1e6 / ((iterations * size) as f64 / (1 << 20) as f64)
            );
        }
    }
    let rounds = 2000;
    let mut sums = Vec::with_capacity(256);
    for method in SectorMethod::available() {
        let started = Instant::now();
        for _ in 0..rounds {
            sums.clear();
            extend_sector_sums_with(method, std::hint::black_box(&data), &mut sums);
        }
        let seconds = started.elapsed().as_secs_f64();
        println!(
            "sectors of 1 MiB, {}: {:.2} µs per MiB  [{:08x}]",
            method.name(),
            seconds * 1e6 / rounds as f64,
            sums[255]
        );
    }
    if can_copy_summing() {
        let mut copy = vec![0u8; data.len()];
        let mut sums = vec![0u32; 256];
        let started = Instant::now();
        for _ in 0..rounds {
            // SAFETY: `data` is a live, aligned 1 MiB allocation.
            unsafe { copy_summing_sectors(data.as_ptr(), &mut copy, &mut sums) };
        }
        let seconds = started.elapsed().as_secs_f64();
        println!(
            "copied and summed, 1 MiB (cached): {:.2} µs per MiB  [{:08x}]",
            seconds * 1e6 / rounds as f64,
            sums[255]
        );
    }
}
