//! Device engine micro-benchmark: 4 KiB random reads and writes at a fixed
//! queue depth on one file, for each engine and each O_DIRECT mode.
//!
//! ```text
//! cargo run --release --example device_bench -- [--path /var/tmp/strata-bench.img]
//!     [--size 1G] [--seconds 5] [--qd 32] [--engines io_uring,io_uring-ring,threads,threads-pool]
//!     [--modes buffered,direct] [--ops randread,randwrite]
//! ```
//!
//! `io_uring-ring` sends page-cache hits through the ring too (the default
//! io_uring engine serves them inline with `preadv2(RWF_NOWAIT)`, see
//! `IoEngine`); `threads-nowait-writes` also tries buffered writes inline
//! with `pwritev2(RWF_NOWAIT)`. `threads-pool` is the threads engine with its inline RWF_NOWAIT fast
//! paths turned off (every I/O goes through the blocking pool), to measure
//! what the fast paths are worth. The file is created and filled with data
//! once (so O_DIRECT reads hit allocated blocks, not holes) and kept for
//! later runs. Results go to stdout as a Markdown table; docs/DEVICES.md
//! records a run.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata::device::threads::{ThreadsConfig, ThreadsEngine};
use strata::device::uring::UringEngine;
use strata::device::{Device, DeviceOptions, DirectIo, EngineChoice, FileDevice, IoBuf, IoEngine, SimRng};

struct Args {
    path: String,
    size: u64,
    seconds: u64,
    qd: usize,
    engines: Vec<String>,
    modes: Vec<String>,
    ops: Vec<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        path: "/var/tmp/strata-bench.img".into(),
        size: 1 << 30,
        seconds: 5,
        qd: 32,
        engines: vec![
            "io_uring".into(),
            "io_uring-ring".into(),
            "threads".into(),
            "threads-pool".into(),
        ],
        modes: vec!["buffered".into(), "direct".into()],
        ops: vec!["randread".into(), "randwrite".into()],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let list = |v: String| v.split(',').map(str::to_string).collect::<Vec<_>>();
        match flag.as_str() {
            "--path" => args.path = value()?,
            "--size" => args.size = strata::units::parse_size(&value()?)?,
            "--seconds" => args.seconds = value()?.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--qd" => args.qd = value()?.parse().map_err(|e| format!("--qd: {e}"))?,
            "--engines" => args.engines = list(value()?),
            "--modes" => args.modes = list(value()?),
            "--ops" => args.ops = list(value()?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

/// Creates and fills the file once (1 MiB writes of pseudo-random data).
fn prepare(path: &str, size: u64) -> std::io::Result<()> {
    use std::os::unix::fs::{FileExt, MetadataExt};
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.len() == size && meta.blocks() * 512 >= size {
            return Ok(());
        }
        std::fs::remove_file(path)?;
    }
    eprintln!("filling {path} ({size} bytes)...");
    let file = std::fs::File::create(path)?;
    let mut chunk = vec![0u8; 1 << 20];
    SimRng::new(1).fill(&mut chunk);
    let mut offset = 0;
    while offset < size {
        let n = chunk.len().min((size - offset) as usize);
        file.write_all_at(&chunk[..n], offset)?;
        offset += n as u64;
    }
    file.sync_all()
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the zeroed struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF covers every thread of the process.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

struct Outcome {
    iops: f64,
    p50_us: u32,
    p99_us: u32,
    cpu_us_per_op: f64,
}

async fn run(dev: Arc<dyn Device>, write: bool, qd: usize, seconds: u64) -> Outcome {
    let blocks = dev.info().size_bytes / 4096;
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    let cpu_start = cpu_seconds();
    let start = Instant::now();
    for task in 0..qd {
        let dev = dev.clone();
        let stop = stop.clone();
        tasks.spawn(async move {
            let mut rng = SimRng::new(task as u64 + 1);
            let mut latencies_us = Vec::with_capacity(1 << 16);
            let mut buf = IoBuf::new(4096);
            rng.fill(buf.payload_mut());
            while !stop.load(Ordering::Relaxed) {
                let offset = rng.below(blocks) * 4096;
                let t = Instant::now();
                let (back, res) = if write {
                    dev.write(offset, buf).await
                } else {
                    dev.read(offset, buf).await
                };
                if let Err(e) = res {
                    eprintln!("I/O error: {e}");
                    std::process::exit(1);
                }
                latencies_us.push(t.elapsed().as_micros().min(u32::MAX as u128) as u32);
                buf = back;
            }
            latencies_us
        });
    }
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    while let Some(done) = tasks.join_next().await {
        all.extend(done.expect("benchmark task"));
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_start;
    all.sort_unstable();
    let pct = |p: f64| {
        all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    Outcome {
        iops: all.len() as f64 / elapsed,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        cpu_us_per_op: cpu * 1e6 / all.len().max(1) as f64,
    }
}

fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("device_bench: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = prepare(&args.path, args.size) {
        eprintln!("device_bench: cannot prepare {}: {e}", args.path);
        std::process::exit(1);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!("| engine | mode | op | QD | IOPS | p50 µs | p99 µs | CPU µs/op |");
    println!("|---|---|---|---|---|---|---|---|");
    for engine_name in &args.engines {
        for mode in &args.modes {
            for op in &args.ops {
                let engine = match engine_name.as_str() {
                    "io_uring" => match IoEngine::select(EngineChoice::IoUring) {
                        Ok(engine) => engine,
                        Err(e) => {
                            eprintln!("skipping io_uring: {e}");
                            continue;
                        }
                    },
                    "io_uring-ring" => match UringEngine::shared() {
                        // Page-cache hits through the ring too (no inline
                        // RWF_NOWAIT read): what the hybrid is measured against.
                        Ok(ring) => IoEngine::IoUring(
                            ring,
                            ThreadsEngine::new(ThreadsConfig {
                                nowait_reads: false,
                                nowait_writes: false,
                            }),
                        ),
                        Err(e) => {
                            eprintln!("skipping io_uring-ring: {e}");
                            continue;
                        }
                    },
                    "threads-nowait-writes" => IoEngine::Threads(ThreadsEngine::new(ThreadsConfig {
                        nowait_reads: true,
                        nowait_writes: true,
                    })),
                    "threads" => IoEngine::Threads(ThreadsEngine::new(ThreadsConfig::default())),
                    "threads-pool" => IoEngine::Threads(ThreadsEngine::new(ThreadsConfig {
                        nowait_reads: false,
                        nowait_writes: false,
                    })),
                    other => {
                        eprintln!("unknown engine {other}");
                        std::process::exit(2);
                    }
                };
                let options = DeviceOptions {
                    direct_io: if mode == "direct" { DirectIo::On } else { DirectIo::Off },
                    ..DeviceOptions::default()
                };
                let dev = match FileDevice::open_with_engine(&args.path, &options, engine) {
                    Ok(dev) => dev,
                    Err(e) => {
                        eprintln!("device_bench: {e}");
                        std::process::exit(1);
                    }
                };
                let direct = dev.info().direct_io;
                let dev: Arc<dyn Device> = Arc::new(dev);
                let outcome = runtime.block_on(run(dev.clone(), op == "randwrite", args.qd, args.seconds));
                // Leave no dirty pages behind for the next row.
                runtime.block_on(dev.flush()).expect("flush");
                println!(
                    "| {engine_name} | {} | {op} | {} | {:.0} | {} | {} | {:.1} |",
                    if direct { "O_DIRECT" } else { "buffered" },
                    args.qd,
                    outcome.iops,
                    outcome.p50_us,
                    outcome.p99_us,
                    outcome.cpu_us_per_op
                );
            }
        }
    }
}
