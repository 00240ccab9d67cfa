//! Throughput of strata's CRC-32C on the sizes the engine checksums (a
//! 4 KiB sector, a 16 KiB block, 1 MiB), for each implementation and for
//! the one the process picked (`strata::checksum::backend`).
//!
//! `cargo run --release --example checksum_bench` (BENCHMARKS.md).

use std::time::Instant;

use strata::checksum::{backend, Backend};

fn main() {
    let data: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(7) ^ (i >> 3)) as u8)
        .collect();
    println!("chosen: {}", backend().name());
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
}
