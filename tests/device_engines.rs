//! One contract test suite (the `Device` trait's promises) run over every
//! device: files with the io_uring and the threads engine, buffered and
//! O_DIRECT, buffered with and without a mapping (`MappedIo` on, reads,
//! off), the simulator, and the wrappers stacked on a file.

use std::sync::Arc;
use std::time::Duration;

use strata::device::sim::SimFaults;
use strata::device::wrappers::{DelayConfig, IoOp, ThrottleConfig};
use strata::device::{
    create_file, DelayDevice, Device, DeviceError, DeviceOptions, DirectIo, EngineChoice, ErrorDevice, ErrorRule,
    FileDevice, IoBuf, IoEngine, MappedIo, SimDevice, SimRng, ThrottleDevice, WrapperSpec,
};

const DEVICE_BYTES: u64 = 64 << 20;

/// A pattern that names its offset and a generation, so a block read from
/// the wrong place or from an older write is told apart.
fn pattern(offset: u64, generation: u64, len: usize) -> Vec<u8> {
    let mut rng = SimRng::new(offset.wrapping_mul(0x9E37_79B9) ^ generation);
    let mut bytes = vec![0; len];
    rng.fill(&mut bytes);
    bytes
}

/// Compares byte vectors without printing megabytes on failure.
#[track_caller]
fn same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: first difference at byte {at} ({} != {})", got[at], want[at]);
    }
}

async fn write(dev: &dyn Device, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
    let (buf, res) = dev.write(offset, IoBuf::copy_from(data)).await;
    same(buf.payload(), data, "the buffer comes back unchanged");
    res
}

async fn read(dev: &dyn Device, offset: u64, len: usize) -> Result<Vec<u8>, DeviceError> {
    let (buf, res) = dev.read(offset, IoBuf::new(len)).await;
    assert_eq!(buf.len(), len, "the buffer comes back");
    res.map(|()| buf.into_vec())
}

/// The contract every device must keep.
async fn contract(dev: Arc<dyn Device>) {
    let info = dev.info().clone();
    let name = info.name.clone();
    let block = u64::from(info.block_bytes);
    assert!(
        info.block_bytes.is_power_of_two() && info.block_bytes >= 512,
        "{name}: block {block}"
    );
    assert!(
        info.size_bytes >= DEVICE_BYTES / 2 && info.size_bytes.is_multiple_of(block),
        "{name}"
    );

    // Never-written bytes read as zeros.
    for offset in [0, 4096, info.size_bytes - 8192] {
        same(
            &read(&*dev, offset, 8192).await.unwrap(),
            &[0; 8192],
            &format!("{name}: zeros at {offset}"),
        );
    }

    // Read after write, several sizes, including the last block.
    let cases = [
        (0, 4096usize),
        (8192 + block, block as usize),
        (1 << 20, 128 << 10),
        (info.size_bytes - block, block as usize),
    ];
    for &(offset, len) in &cases {
        write(&*dev, offset, &pattern(offset, 1, len)).await.unwrap();
    }
    for &(offset, len) in &cases {
        same(
            &read(&*dev, offset, len).await.unwrap(),
            &pattern(offset, 1, len),
            &format!("{name}: at {offset}"),
        );
    }
    // A partial read inside an earlier write.
    let inner = read(&*dev, (1 << 20) + 8192, 4096).await.unwrap();
    same(&inner, &pattern(1 << 20, 1, 128 << 10)[8192..12288], &name);
    // Zero-length requests are no-ops.
    assert!(read(&*dev, 0, 0).await.unwrap().is_empty());
    write(&*dev, 0, &[]).await.unwrap();

    // Entry checks: errors, never panics, buffer returned.
    let err = write(&*dev, block / 2, &vec![1; block as usize]).await.unwrap_err();
    assert!(matches!(err, DeviceError::Misaligned { .. }), "{name}: {err}");
    let err = read(&*dev, 0, block as usize / 2).await.unwrap_err();
    assert!(matches!(err, DeviceError::Misaligned { .. }), "{name}: {err}");
    let err = read(&*dev, info.size_bytes, block as usize).await.unwrap_err();
    assert!(matches!(err, DeviceError::OutOfRange { .. }), "{name}: {err}");
    let err = write(&*dev, info.size_bytes - block, &vec![1; 2 * block as usize])
        .await
        .unwrap_err();
    assert!(matches!(err, DeviceError::OutOfRange { .. }), "{name}: {err}");
    let far = u64::MAX - u64::MAX % block;
    let err = read(&*dev, far, block as usize).await.unwrap_err();
    assert!(matches!(err, DeviceError::OutOfRange { .. }), "{name}: {err}");
    let err = dev.discard(block / 2, block).await.unwrap_err();
    assert!(matches!(err, DeviceError::Misaligned { .. }), "{name}: {err}");
    // The out-of-range write did not touch the last block.
    same(
        &read(&*dev, info.size_bytes - block, block as usize).await.unwrap(),
        &pattern(info.size_bytes - block, 1, block as usize),
        &name,
    );

    // QD32: 32 tasks write random 4 KiB blocks (each task owns the blocks
    // congruent to its number, so the final contents are known), then every
    // block is verified, also with 32 concurrent readers.
    const QD: u64 = 32;
    const BLOCKS: u64 = 2048; // 8 MiB region starting at 16 MiB
    let base = 16 << 20;
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..QD {
        let dev = dev.clone();
        tasks.spawn(async move {
            let mut rng = SimRng::new(task);
            let mut last = vec![0u64; (BLOCKS / QD) as usize];
            for _ in 0..64 {
                let slot = rng.below(BLOCKS / QD);
                let block_no = slot * QD + task;
                let generation = rng.next_u64() | 1;
                let offset = base + block_no * 4096;
                write(&*dev, offset, &pattern(offset, generation, 4096)).await.unwrap();
                last[slot as usize] = generation;
            }
            (task, last)
        });
    }
    let mut expected = vec![0u64; BLOCKS as usize];
    while let Some(done) = tasks.join_next().await {
        let (task, last) = done.unwrap();
        for (slot, generation) in last.into_iter().enumerate() {
            expected[slot * QD as usize + task as usize] = generation;
        }
    }
    dev.flush().await.unwrap();
    let expected = Arc::new(expected);
    let mut readers = tokio::task::JoinSet::new();
    for task in 0..QD {
        let dev = dev.clone();
        let expected = expected.clone();
        readers.spawn(async move {
            for block_no in (task..BLOCKS).step_by(QD as usize) {
                let offset = base + block_no * 4096;
                let got = read(&*dev, offset, 4096).await.unwrap();
                let want = match expected[block_no as usize] {
                    0 => vec![0; 4096],
                    generation => pattern(offset, generation, 4096),
                };
                assert!(got == want, "block {block_no} differs");
            }
        });
    }
    while let Some(done) = readers.join_next().await {
        done.unwrap_or_else(|e| panic!("{name}: {e}"));
    }

    // Flush, then discard: the range reads as zeros or its old contents,
    // sector by sector, and the neighbours are untouched.
    dev.flush().await.unwrap();
    let old = read(&*dev, 1 << 20, 128 << 10).await.unwrap();
    dev.discard((1 << 20) + 4096, 64 << 10).await.unwrap();
    let after = read(&*dev, 1 << 20, 128 << 10).await.unwrap();
    same(&after[..4096], &old[..4096], &name);
    same(&after[4096 + (64 << 10)..], &old[4096 + (64 << 10)..], &name);
    for (a, o) in after[4096..4096 + (64 << 10)].chunks(512).zip(old[4096..].chunks(512)) {
        assert!(
            a == o || a.iter().all(|&b| b == 0),
            "{name}: discarded sector neither old nor zero"
        );
    }
    dev.discard(0, 0).await.unwrap();
    dev.flush().await.unwrap();

    // A write failure makes the device sticky (here through the error
    // wrapper, so it works on every device): later writes and flushes fail,
    // reads still work.
    let faulty = ErrorDevice::new(
        dev.clone(),
        vec![ErrorRule {
            every: Some(2),
            ..ErrorRule::always(&[IoOp::Write])
        }],
        0,
    );
    write(&faulty, 0, &pattern(0, 2, 4096)).await.unwrap();
    let err = write(&faulty, 4096, &pattern(4096, 2, 4096)).await.unwrap_err();
    assert!(
        matches!(err, DeviceError::Injected { offset: 4096, .. }),
        "{name}: {err}"
    );
    let err = write(&faulty, 8192, &[0; 4096]).await.unwrap_err();
    assert!(matches!(err, DeviceError::Failed { .. }), "{name}: {err}");
    assert!(
        matches!(faulty.flush().await, Err(DeviceError::Failed { .. })),
        "{name}"
    );
    same(
        &read(&faulty, 0, 4096).await.unwrap(),
        &pattern(0, 2, 4096),
        &format!("{name}: reads still work"),
    );
}

fn image(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let path = dir.path().join("device.img");
    create_file(&path, DEVICE_BYTES).unwrap();
    path
}

fn test_dir() -> tempfile::TempDir {
    // The target directory is on a disk file system (a tmpfs /tmp may not
    // do O_DIRECT on older kernels).
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// Whether this file system accepts O_DIRECT I/O, found independently of
/// FileDevice: open with O_DIRECT, write and read one aligned block.
fn o_direct_works(dir: &std::path::Path) -> bool {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let path = dir.join("probe");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path);
    let ok = match file {
        Ok(file) => {
            let buf = IoBuf::copy_from(&[5; 4096]);
            file.write_all_at(buf.payload(), 0).is_ok()
        }
        Err(_) => false,
    };
    let _ = std::fs::remove_file(path);
    ok
}

fn open(path: &std::path::Path, engine: EngineChoice, direct_io: DirectIo, mapped_io: MappedIo) -> FileDevice {
    FileDevice::open(
        path,
        &DeviceOptions {
            engine,
            direct_io,
            mapped_io,
            ..DeviceOptions::default()
        },
    )
    .unwrap()
}

/// The paths a mapping adds, on a buffered file, and the same calls where
/// there is none: a read of cached pages copied and checksummed at once
/// (`read_now_summed`), and inline writes from several threads at once
/// (`write_now`; one that meets another thread's `pwrite` of the file is
/// copied into the mapping where writes are mapped).
async fn mapped_paths(dev: &FileDevice, mapped_io: MappedIo) {
    let name = format!("{} ({mapped_io:?})", dev.info().name);
    let base: u64 = 32 << 20;
    let len = 256 << 10;
    let data = pattern(base, 3, len);
    let mut dst = vec![0u8; len];
    let mut sums = vec![0u32; len / 4096];
    // Never written: the file has no pages there, so nothing is mapped in.
    let summed = dev.read_now_summed(base, &mut dst, &mut sums);
    assert!(!summed || dst.iter().all(|&b| b == 0), "{name}: a hole reads as zeros");
    // Written through the page cache, then read at once where mapped.
    write(dev, base, &data).await.unwrap();
    let summed = dev.read_now_summed(base, &mut dst, &mut sums);
    assert_eq!(
        summed,
        mapped_io != MappedIo::Off,
        "{name}: cached pages are read through the mapping exactly when there is one"
    );
    if summed {
        same(&dst, &data, &format!("{name}: mapped read"));
        for (index, sector) in data.chunks(4096).enumerate() {
            assert_eq!(sums[index], strata::checksum::crc32c(sector), "{name}: sector {index}");
        }
    }
    // Four threads rewrite the 4 KiB blocks of that range at once, each
    // its own blocks, 16 rounds: the last round's bytes are what is there.
    const THREADS: u64 = 4;
    const ROUNDS: u64 = 16;
    let blocks = len as u64 / 4096;
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            scope.spawn(move || {
                for round in 0..ROUNDS {
                    for block in (thread..blocks).step_by(THREADS as usize) {
                        let offset = base + block * 4096;
                        let result = dev.write_now(offset, &pattern(offset, 10 + round, 4096));
                        result.expect("a buffered 4 KiB write is done inline").unwrap();
                    }
                }
            });
        }
    });
    dev.flush().await.unwrap();
    for block in 0..blocks {
        let offset = base + block * 4096;
        same(
            &read(dev, offset, 4096).await.unwrap(),
            &pattern(offset, 10 + ROUNDS - 1, 4096),
            &format!("{name}: block {block}"),
        );
    }
}

async fn file_suite(engine: EngineChoice, direct_io: DirectIo) {
    file_suite_mapped(engine, direct_io, MappedIo::On).await;
}

async fn file_suite_mapped(engine: EngineChoice, direct_io: DirectIo, mapped_io: MappedIo) {
    if engine == EngineChoice::IoUring && !IoEngine::io_uring_available() {
        eprintln!("io_uring is unavailable on this machine: the io_uring file suite is skipped");
        return;
    }
    let dir = test_dir();
    let path = image(&dir);
    let dev = open(&path, engine, direct_io, mapped_io);
    let info = dev.info().clone();
    assert_eq!(
        info.engine,
        if engine == EngineChoice::IoUring {
            "io_uring"
        } else {
            "threads"
        }
    );
    assert_eq!(info.size_bytes, DEVICE_BYTES);
    match direct_io {
        DirectIo::On => {
            let supported = o_direct_works(dir.path());
            assert_eq!(
                info.direct_io, supported,
                "O_DIRECT must be used exactly when the file system supports it"
            );
            if !supported {
                eprintln!(
                    "O_DIRECT unsupported in {}: checked the buffered fallback",
                    dir.path().display()
                );
                assert_eq!(info.block_bytes, 512);
            }
        }
        DirectIo::Off | DirectIo::Auto => {
            assert!(!info.direct_io, "regular files are buffered by default");
            assert_eq!(info.block_bytes, 512);
        }
    }
    let mapped = dev.mapped_io();
    if info.direct_io {
        assert_eq!(mapped, MappedIo::Off, "O_DIRECT files are never mapped");
    } else {
        assert_eq!(mapped, mapped_io, "a buffered file is mapped as asked");
        mapped_paths(&dev, mapped_io).await;
    }
    let dev: Arc<dyn Device> = Arc::new(dev);
    contract(dev.clone()).await;
    // Discard on a file punches a hole: zeros exactly.
    let zeros = read(&*dev, (1 << 20) + 4096, 64 << 10).await.unwrap();
    assert!(zeros.iter().all(|&b| b == 0), "punched range reads zeros");
    drop(dev);
    // Everything flushed is in the file after reopening.
    let again = open(&path, engine, direct_io, mapped_io);
    let offset = DEVICE_BYTES - u64::from(again.info().block_bytes);
    let len = again.info().block_bytes as usize;
    same(
        &read(&again, offset, len).await.unwrap(),
        &pattern(offset, 1, len),
        "after reopening",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_io_uring_buffered() {
    file_suite(EngineChoice::IoUring, DirectIo::Off).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_io_uring_direct() {
    file_suite(EngineChoice::IoUring, DirectIo::On).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_threads_buffered() {
    file_suite(EngineChoice::Threads, DirectIo::Off).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_threads_direct() {
    file_suite(EngineChoice::Threads, DirectIo::On).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_io_uring_buffered_mapped_reads_only() {
    file_suite_mapped(EngineChoice::IoUring, DirectIo::Off, MappedIo::Reads).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_io_uring_buffered_unmapped() {
    file_suite_mapped(EngineChoice::IoUring, DirectIo::Off, MappedIo::Off).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_threads_buffered_mapped_reads_only() {
    file_suite_mapped(EngineChoice::Threads, DirectIo::Off, MappedIo::Reads).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_threads_buffered_unmapped() {
    file_suite_mapped(EngineChoice::Threads, DirectIo::Off, MappedIo::Off).await;
}

#[test]
fn mapped_io_names_each_choice_and_nothing_else() {
    for choice in MappedIo::ALL {
        assert_eq!(MappedIo::parse(choice.name()), Ok(choice));
    }
    assert!(MappedIo::parse("yes").is_err());
    assert_eq!(
        DeviceOptions::default().mapped_io,
        MappedIo::On,
        "on unless the process says otherwise"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn file_threads_on_a_current_thread_runtime() {
    file_suite(EngineChoice::Threads, DirectIo::Auto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_auto_engine_prefers_io_uring() {
    let dir = test_dir();
    let dev = open(&image(&dir), EngineChoice::Auto, DirectIo::Auto, MappedIo::On);
    let forced = std::env::var(EngineChoice::ENV_VAR).ok();
    let expected = match forced.as_deref() {
        Some("threads") => "threads",
        Some("io_uring") => "io_uring",
        _ if IoEngine::io_uring_available() => "io_uring",
        _ => "threads",
    };
    assert_eq!(dev.info().engine, expected);
}

#[tokio::test]
async fn sim_device() {
    let sim = SimDevice::new(DEVICE_BYTES, 1);
    contract(sim.as_device()).await;
    let stats = sim.stats();
    assert!(stats.writes >= 32 * 64 && stats.flushes >= 3, "{stats:?}");
    // Only the one write through the error wrapper came after the last
    // successful flush (the wrapper then refused to flush).
    assert_eq!(sim.pending_writes(), 1);
}

#[tokio::test]
async fn sim_device_with_4k_blocks() {
    let mut config = strata::device::SimConfig::new(DEVICE_BYTES, 2);
    config.block_bytes = 4096;
    contract(SimDevice::with_config(config).as_device()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrappers_over_a_file() {
    let dir = test_dir();
    let file: Arc<dyn Device> = Arc::new(open(&image(&dir), EngineChoice::Auto, DirectIo::Auto, MappedIo::On));
    let delayed: Arc<dyn Device> = Arc::new(DelayDevice::new(
        file,
        DelayConfig {
            read: Duration::from_micros(50),
            write: Duration::from_micros(50),
            flush: Duration::from_micros(50),
        },
    ));
    let throttled: Arc<dyn Device> = Arc::new(ThrottleDevice::new(
        delayed,
        ThrottleConfig {
            iops: Some(200_000),
            bytes_per_sec: Some(4 << 30),
        },
    ));
    // An error layer with a rule that never fires passes everything through.
    let never: Arc<dyn Device> = Arc::new(ErrorDevice::new(
        throttled,
        vec![ErrorRule {
            range: Some((DEVICE_BYTES * 2, DEVICE_BYTES * 3)),
            ..ErrorRule::always(&IoOp::ALL[..2])
        }],
        0,
    ));
    assert!(
        never.info().name.starts_with("error(throttle(delay("),
        "{}",
        never.info().name
    );
    contract(never).await;
}

#[tokio::test]
async fn wrappers_from_specs_over_the_simulator() {
    let specs =
        WrapperSpec::parse_stack("delay:read=20us,write=20us+throttle:iops=500000,bw=8G+error:flush,every=1000000")
            .unwrap();
    let dev = WrapperSpec::wrap_all(&specs, SimDevice::new(DEVICE_BYTES, 3).as_device());
    assert_eq!(dev.info().name, "error(throttle(delay(sim)))");
    contract(dev).await;
}

#[tokio::test]
async fn sim_read_faults_surface_as_injected_errors() {
    let sim = SimDevice::new(DEVICE_BYTES, 4);
    sim.set_faults(SimFaults {
        read_error: 0.5,
        ..SimFaults::default()
    });
    let dev = sim.as_device();
    let mut failures = 0;
    for i in 0..200u64 {
        match read(&*dev, i * 4096, 4096).await {
            Ok(bytes) => assert!(bytes.iter().all(|&b| b == 0)),
            Err(DeviceError::Injected { offset, .. }) => {
                assert_eq!(offset, i * 4096);
                failures += 1;
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!((60..140).contains(&failures), "{failures}");
    assert!(!sim.has_failed());
}
