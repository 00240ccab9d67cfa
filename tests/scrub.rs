//! The scrub after a crash repairs only what the crash can explain: a
//! sector's stored checksum is replaced from the data only where a write
//! was in flight in place when the daemon died. Bit rot in a slot the crash
//! never touched, even in the same chunk, stays a checksum error: the read
//! fails and the error is counted, never returned as data.

mod common;

use common::{cli_ok, pool_json, qemu_io, qemu_io_ok, small_default_pool, Server};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

const BLOCK: u64 = 16 << 10;
const BLOCKS: u64 = 64;

/// The byte that fills logical block `block` of the volume.
fn pattern(block: u64) -> u8 {
    0x10 + block as u8
}

/// Where, in the device file, the 16 KiB block filled with `byte` lies.
fn find_block(device: &Path, byte: u8) -> Option<u64> {
    let mut file = std::fs::File::open(device).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    loop {
        let read = file.read(&mut buf).unwrap();
        if read == 0 {
            return None;
        }
        for (index, block) in buf[..read].chunks_exact(BLOCK as usize).enumerate() {
            if block.iter().all(|&b| b == byte) {
                return Some(at + index as u64 * BLOCK);
            }
        }
        at += read as u64;
    }
}

#[test]
fn rot_in_a_slot_the_crash_never_touched_stays_an_error_after_the_scrub() {
    common::require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    small_default_pool(dir.path());
    let device = dir.path().join("pools/default/fast.dev");
    let mut server = Server::start(dir.path());
    server.create_volume("default/v", "1M");
    let uri = server.uri("default/v");
    // Every 16 KiB block its own byte, placed and checkpointed.
    let fill: Vec<String> = (0..BLOCKS)
        .map(|block| format!("write -P {} {} {BLOCK}", pattern(block), block * BLOCK))
        .collect();
    qemu_io_ok(&uri, &fill);
    cli_ok(&server, &["pool", "sync", "default"]);
    // The first 128 KiB overwritten in place with FUA (it goes around the
    // cache, so its `Dirty` marks are durable before it is written and its
    // checksums only in memory), then the daemon is killed.
    let rewritten = 128 << 10;
    let slots: Vec<u64> = (0..BLOCKS)
        .map(|block| find_block(&device, pattern(block)).unwrap_or_else(|| panic!("block {block} not on fast.dev")))
        .collect();
    qemu_io_ok(&uri, &[format!("write -f -P 0xaa 0 {rewritten}")]);
    server.kill9();
    assert_eq!(find_block(&device, 0xaa), Some(slots[0]), "the rewrite went in place");
    // A block the rewrite never touched, in a chunk it did: one flipped byte.
    let chunk = slots[0] >> 20;
    let untouched = (rewritten / BLOCK..BLOCKS)
        .find(|&block| slots[block as usize] >> 20 == chunk)
        .expect("a block in the rewritten chunk that the rewrite did not touch");
    {
        let mut file = std::fs::OpenOptions::new().write(true).open(&device).unwrap();
        file.seek(SeekFrom::Start(slots[untouched as usize] + 100)).unwrap();
        file.write_all(&[!pattern(untouched)]).unwrap();
        file.sync_all().unwrap();
    }
    let server = Server::start(dir.path());
    let uri = server.uri("default/v");
    // The scrub runs at open; wait until it has read back what it must.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while pool_json(&server, "default")["suspect_chunks"].as_u64() != Some(0) {
        assert!(std::time::Instant::now() < deadline, "the scrub did not finish");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // The rewritten blocks read back as rewritten (their checksums repaired).
    qemu_io_ok(&uri, &[format!("read -P 0xaa 0 {rewritten}")]);
    // The rotten block fails to read and is counted; it is not "repaired".
    let (ok, text) = qemu_io(
        &uri,
        &[format!("read -P {} {} {BLOCK}", pattern(untouched), untouched * BLOCK)],
    );
    assert!(
        !ok || text.contains("failed") || text.contains("error"),
        "block {untouched} with a flipped byte read without an error:\n{text}"
    );
    assert!(
        text.contains("Input/output error"),
        "block {untouched}: expected EIO, got:\n{text}"
    );
    let status = pool_json(&server, "default");
    assert!(
        status["checksum_errors"].as_u64().unwrap_or(0) >= 1,
        "the mismatch is not counted: {status}"
    );
    // Every other block reads back as written.
    for block in (rewritten / BLOCK..BLOCKS).filter(|&b| b != untouched) {
        qemu_io_ok(&uri, &[format!("read -P {} {} {BLOCK}", pattern(block), block * BLOCK)]);
    }
}
