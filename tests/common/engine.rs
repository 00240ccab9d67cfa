//! Helpers of the tests that drive a `Pool` directly, without the daemon.

use strata::pool::PoolOptions;

/// A runtime for one test's pool.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// No background tasks (a test runs destage, resilver and scrub itself)
/// and no read cache, so every read reaches the devices.
pub fn options() -> PoolOptions {
    PoolOptions {
        background: false,
        read_cache_bytes: 0,
        ..PoolOptions::default()
    }
}

/// The `bytes` of block `block` in round `round` of a test's writes: each
/// block and round differs, so a stale or misplaced block shows.
pub fn block_data(bytes: u64, block: u64, round: u8) -> Vec<u8> {
    (0..bytes)
        .map(|i| (i as u8).wrapping_mul(31) ^ (block as u8).wrapping_mul(7) ^ round)
        .collect()
}

/// Writes blocks `blocks` (of `bytes` each) of `volume` with round
/// `round`'s pattern, flushes them and destages them to their places.
pub async fn write_placed(
    pool: &strata::pool::Pool,
    volume: &strata::pool::volume::EngineVolume,
    bytes: u64,
    blocks: impl IntoIterator<Item = u64>,
    round: u8,
) {
    use strata::block::{BlockDevice, IoBuf};
    for block in blocks {
        volume
            .write(block * bytes, IoBuf::copy_from(&block_data(bytes, block, round)), false)
            .await
            .unwrap();
    }
    volume.flush().await.unwrap();
    pool.destage_all().await.unwrap();
}
