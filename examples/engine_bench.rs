//! Metadata cost of the storage engine: bytes of metadata (log + checkpoint
//! store) written per 4 KiB random write, for first writes (which allocate a
//! block) and for overwrites (which must not touch the block map).
//!
//! Runs the engine directly on sparse files (the default pool's layout) with
//! a flush every `FLUSH_EVERY` writes, and includes a final checkpoint in
//! each phase's cost.
//!
//! `cargo run --release --example engine_bench [-- WRITES]`

use std::sync::Arc;

use strata::block::{BlockDevice, IoBuf};
use strata::device::{create_file, open_device, DeviceOptions, SimRng};
use strata::pool::superblock::Role;
use strata::pool::{NewDevice, Pool};

const FLUSH_EVERY: u64 = 256;
const VOLBLOCKSIZE: u32 = 16 << 10;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let writes: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(65536);
    let dir = tempfile_dir();
    let fast = dir.join("fast.dev");
    let capacity = dir.join("capacity.dev");
    create_file(&fast, 16 << 30).expect("create fast");
    create_file(&capacity, 64 << 30).expect("create capacity");
    let options = DeviceOptions::default();
    let devices = vec![
        NewDevice {
            device: open_device(&fast, &options).expect("open"),
            role: Role::Fast,
        },
        NewDevice {
            device: open_device(&capacity, &options).expect("open"),
            role: Role::Capacity,
        },
    ];
    let pool = Pool::create("bench", 1 << 20, devices).await.expect("create pool");
    // Blocks = 4 x writes, so first writes rarely land in an allocated block.
    let volume_bytes = writes * 4 * VOLBLOCKSIZE as u64;
    let volume = pool.open_volume(1, volume_bytes, VOLBLOCKSIZE).expect("volume");
    let blocks = volume_bytes / VOLBLOCKSIZE as u64;

    let mut rng = SimRng::new(42);
    let mut order: Vec<u64> = (0..blocks).collect();
    for i in (1..order.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    // Warm-up: the metadata store grows to its working size once (new
    // space is zero-filled); that one-time cost is not per-write cost.
    let warm: Vec<u64> = order[writes as usize..2 * writes as usize].to_vec();
    let first: Vec<u64> = order[..writes as usize].to_vec();

    println!(
        "engine metadata cost: {writes} random 4 KiB writes per phase, flush every {FLUSH_EVERY}, volblocksize 16K"
    );
    println!("| phase | metadata bytes per write | % of 4 KiB data | log (commits) | checkpoints | staged log (page cache) |");
    println!("|---|---|---|---|---|---|");
    phase(
        &pool,
        &volume,
        "warm-up first writes (store grows)",
        warm.iter().map(|b| b * VOLBLOCKSIZE as u64),
    )
    .await;
    // Every write allocates a new block.
    phase(
        &pool,
        &volume,
        "first write (allocates)",
        first.iter().map(|b| b * VOLBLOCKSIZE as u64),
    )
    .await;
    // Random 4 KiB overwrites inside allocated blocks, four passes' worth
    // between checkpoints (the daemon checkpoints overwrites rarely: they
    // add no log records).
    let mut overwrite = Vec::with_capacity(4 * writes as usize);
    for _ in 0..4 * writes {
        let block = first[rng.below(writes) as usize];
        overwrite.push(block * VOLBLOCKSIZE as u64 + rng.below(4) * 4096);
    }
    phase(&pool, &volume, "overwrite (allocated, unshared)", overwrite.into_iter()).await;
    redb_alone(&dir, &first);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The alternative the design rejected: every map change committed straight
/// to redb (one 8-byte entry per block, keyed by block number), committing
/// at the same flush cadence.
fn redb_alone(dir: &std::path::Path, blocks: &[u64]) {
    #[derive(Debug)]
    struct Counting {
        inner: redb::backends::FileBackend,
        written: std::sync::atomic::AtomicU64,
    }
    impl redb::StorageBackend for Counting {
        fn len(&self) -> std::io::Result<u64> {
            self.inner.len()
        }
        fn read(&self, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
            self.inner.read(offset, len)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.inner.set_len(len)
        }
        fn sync_data(&self, eventual: bool) -> std::io::Result<()> {
            self.inner.sync_data(eventual)
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.written
                .fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
            self.inner.write(offset, data)
        }
    }
    const MAP: redb::TableDefinition<u64, u64> = redb::TableDefinition::new("map");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join("alone.redb"))
        .expect("redb file");
    let backend = std::sync::Arc::new(Counting {
        inner: redb::backends::FileBackend::new(file).expect("backend"),
        written: std::sync::atomic::AtomicU64::new(0),
    });
    struct Shared(std::sync::Arc<Counting>);
    impl std::fmt::Debug for Shared {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            self.0.fmt(f)
        }
    }
    impl redb::StorageBackend for Shared {
        fn len(&self) -> std::io::Result<u64> {
            self.0.len()
        }
        fn read(&self, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
            self.0.read(offset, len)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.0.set_len(len)
        }
        fn sync_data(&self, eventual: bool) -> std::io::Result<()> {
            self.0.sync_data(eventual)
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.0.write(offset, data)
        }
    }
    let db = redb::Builder::new()
        .create_with_backend(Shared(backend.clone()))
        .expect("redb");
    let start = backend.written.load(std::sync::atomic::Ordering::Relaxed);
    for batch in blocks.chunks(FLUSH_EVERY as usize) {
        let txn = db.begin_write().expect("txn");
        {
            let mut table = txn.open_table(MAP).expect("table");
            for block in batch {
                table.insert(*block, block | 1 << 63).expect("insert");
            }
        }
        txn.commit().expect("commit");
    }
    let written = backend.written.load(std::sync::atomic::Ordering::Relaxed) - start;
    let per_write = written as f64 / blocks.len() as f64;
    println!(
        "| first write, map committed to redb directly (rejected design) | {per_write:.1} | {:.2}% | - | {written} B | - |",
        per_write / 4096.0 * 100.0
    );
}

async fn phase(
    pool: &Arc<Pool>,
    volume: &Arc<strata::pool::volume::EngineVolume>,
    name: &str,
    offsets: impl Iterator<Item = u64>,
) {
    pool.checkpoint().await.expect("checkpoint");
    let before = pool.meta_counters();
    let mut count = 0u64;
    for offset in offsets {
        volume
            .write(offset, IoBuf::copy_from(&[0x5a; 4096]), false)
            .await
            .expect("write");
        count += 1;
        if count.is_multiple_of(FLUSH_EVERY) {
            volume.flush().await.expect("flush");
        }
    }
    volume.flush().await.expect("flush");
    pool.checkpoint().await.expect("checkpoint");
    let after = pool.meta_counters();
    let log = after.log_bytes - before.log_bytes;
    let store = after.store_bytes - before.store_bytes;
    let staged = after.staged_log_bytes - before.staged_log_bytes;
    let per_write = (log + store) as f64 / count as f64;
    println!(
        "| {name} | {per_write:.1} | {:.2}% | {log} B | {store} B ({} checkpoints) | {:.0} B per write |",
        per_write / 4096.0 * 100.0,
        after.checkpoints - before.checkpoints,
        staged as f64 / count as f64
    );
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-engine-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}
