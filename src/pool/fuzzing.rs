//! Fuzz entry points for the pool's on-disk decoders (log blocks,
//! superblocks, map and checksum pages), shared by the `cargo fuzz` targets in `fuzz/`
//! and by the regression test that replays `fuzz/corpus-seeds/`. Each one
//! fixes up what a random input cannot get right by chance (magic numbers,
//! checksums) so the decoder's real work is reached, and checks that what
//! decodes encodes back to the same bytes.

use super::superblock::{Superblock, MAGIC, SUPERBLOCK_BYTES};
use crate::meta::pages::{CrcPage, MapPage, Page};

/// Bytes of a stored map page without its birth.
const MAP_PAGE_BYTES: usize = crate::meta::pages::MAP_ENTRIES_PER_PAGE as usize * 8;

/// The log block decoder: records, flags, payload counts.
pub fn log_block_input(data: &[u8]) {
    crate::meta::log::fuzz_block(data);
}

/// The superblock decoder, on `data` padded to a superblock with the magic
/// and checksum made valid.
pub fn superblock_input(data: &[u8]) {
    let _ = Superblock::decode(data);
    let mut bytes = vec![0u8; SUPERBLOCK_BYTES];
    let take = data.len().min(SUPERBLOCK_BYTES);
    bytes[..take].copy_from_slice(&data[..take]);
    bytes[..8].copy_from_slice(&MAGIC);
    let crc = crate::checksum::crc32c(&bytes[..SUPERBLOCK_BYTES - 4]);
    bytes[SUPERBLOCK_BYTES - 4..].copy_from_slice(&crc.to_le_bytes());
    if let Ok(superblock) = Superblock::decode(&bytes) {
        assert!(!superblock.members.is_empty());
        assert_eq!(Superblock::decode(&superblock.encode()), Ok(superblock));
    }
}

/// The key the page decoders are given (a seal covers its key too).
const PAGE_KEY: (u32, u64) = (1, 0);

/// The map and checksum page decoders, on `data` as it is and with its
/// last 4 bytes made the seal of the rest: a page decodes only at one of
/// its lengths (sealed, or unsealed as pools from before seals stored it)
/// and, sealed, only with a right seal; what decodes encodes sealed, with
/// the same entries (and to the same bytes, when it was sealed).
pub fn page_input(data: &[u8]) {
    pages_input(data);
    if let Some(body) = data.len().checked_sub(crate::meta::sealed::SEAL_BYTES) {
        let mut resealed = data[..body].to_vec();
        crate::meta::sealed::seal(&crate::meta::sealed::key2(PAGE_KEY), &mut resealed);
        pages_input(&resealed);
    }
}

fn pages_input(data: &[u8]) {
    use crate::meta::pages::{SEALED_CRC_PAGE_BYTES, SEALED_MAP_PAGE_BYTES};
    if let Ok(page) = MapPage::decode(PAGE_KEY, Some(data)) {
        let encoded = page.encode(PAGE_KEY);
        assert_eq!(encoded.len(), SEALED_MAP_PAGE_BYTES);
        if data.len() == SEALED_MAP_PAGE_BYTES {
            assert_eq!(encoded, data);
        } else {
            // Entries, then the birth (0 when the page had none).
            let mut body = data.to_vec();
            body.resize(MAP_PAGE_BYTES + 8, 0);
            assert_eq!(encoded[..body.len()], body[..]);
        }
    }
    if let Ok(page) = CrcPage::decode(PAGE_KEY, Some(data)) {
        let encoded = page.encode(PAGE_KEY);
        assert_eq!(encoded.len(), SEALED_CRC_PAGE_BYTES);
        assert_eq!(encoded[..SEALED_CRC_PAGE_BYTES - 4], data[..SEALED_CRC_PAGE_BYTES - 4]);
        if data.len() == SEALED_CRC_PAGE_BYTES {
            assert_eq!(encoded, data);
        }
    }
}

/// A small pool the "use" targets load what they decode into: one fast
/// device and one capacity device (simulated, in memory), volume 1 of
/// 4 MiB in 16 KiB blocks written on both tiers, and file dataset 2.
struct SmallPool {
    runtime: tokio::runtime::Runtime,
    pool: std::sync::Arc<super::Pool>,
    volume: std::sync::Arc<super::volume::EngineVolume>,
    /// Volume 3: 1 MiB of 0x5a, never damaged by the targets.
    #[cfg_attr(not(test), allow(dead_code))]
    other: std::sync::Arc<super::volume::EngineVolume>,
}

const SMALL_VOLUME: u32 = 1;
const SMALL_VOLUME_BYTES: u64 = 4 << 20;
const SMALL_DATASET: u32 = 2;
const OTHER_VOLUME: u32 = 3;

impl SmallPool {
    fn new() -> SmallPool {
        use crate::block::BlockDevice;
        use crate::device::SimDevice;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let (pool, volume, other) = runtime.block_on(async {
            let devices = vec![
                super::NewDevice {
                    device: SimDevice::new(104 << 20, 1).as_device(),
                    role: super::superblock::Role::Fast,
                },
                super::NewDevice {
                    device: SimDevice::new(8 << 20, 2).as_device(),
                    role: super::superblock::Role::Capacity,
                },
            ];
            let options = super::PoolOptions {
                background: false,
                read_cache_bytes: 0,
                ram: Some(super::ram::RamSource::Heap(super::ram::HeapImage::new(4 << 20))),
                ..Default::default()
            };
            let pool = super::Pool::create_with("fuzz", 1 << 20, devices, options)
                .await
                .expect("a small pool");
            let volume = pool
                .open_volume(SMALL_VOLUME, SMALL_VOLUME_BYTES, 16 << 10)
                .expect("a volume");
            let data: Vec<u8> = (0..SMALL_VOLUME_BYTES).map(|i| (i / 4096) as u8).collect();
            volume
                .write(0, crate::device::IoBuf::copy_from(&data), true)
                .await
                .expect("written");
            let other = pool.open_volume(OTHER_VOLUME, 1 << 20, 16 << 10).expect("a volume");
            other
                .write(0, crate::device::IoBuf::copy_from(&[0x5a; 1 << 20]), true)
                .await
                .expect("written");
            pool.destage_all().await.expect("destaged");
            pool.checkpoint().await.expect("checkpointed");
            (pool, volume, other)
        });
        SmallPool {
            runtime,
            pool,
            volume,
            other,
        }
    }

    /// Stores `bytes` under `key` of `table` and drops the cached copies
    /// of that table's owner, so the next use loads it.
    fn store(&self, table: redb::TableDefinition<(u32, u64), &[u8]>, key: (u32, u64), bytes: &[u8]) {
        let txn = self.pool.db.begin_write().expect("a write transaction");
        txn.open_table(table)
            .expect("the table")
            .insert(key, bytes)
            .expect("stored");
        txn.commit().expect("committed");
        self.pool.map_pages.forget_owner(key.0);
        self.pool.crc_pages.forget_owner(key.0);
    }

    /// Reads the whole volume a MiB at a time and asks for its extents:
    /// each is answered, with data or an error, and nothing panics.
    fn use_volume(&self) {
        use crate::block::BlockDevice;
        self.runtime.block_on(async {
            for at in (0..SMALL_VOLUME_BYTES).step_by(1 << 20) {
                let (_, _) = self.volume.read(at, crate::device::IoBuf::new(1 << 20)).await;
            }
            let _ = self.volume.block_status(0, SMALL_VOLUME_BYTES).await;
            let _ = self.pool.count_mapped_blocks(SMALL_VOLUME);
        });
    }
}

thread_local! {
    static SMALL_POOL: SmallPool = SmallPool::new();
}

/// A map page as stored, loaded by the small pool and used: `data` is
/// page 0 or 1 of its volume (first byte), the rest the page's bytes (a
/// stored page of the right length, sealed or not, with its entries aimed
/// at the pool's devices often enough to reach the checks past the device
/// index).
pub fn map_page_use(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let key = (SMALL_VOLUME, (which & 1) as u64);
    let mut bytes = rest.to_vec();
    if which & 0x10 != 0 {
        // Entries and a birth, sealed below.
        bytes.resize(MAP_PAGE_BYTES + 8, 0);
    } else if which & 0x80 != 0 {
        // An unsealed page's length, so the entries are decoded.
        bytes.resize(MAP_PAGE_BYTES + if which & 0x40 != 0 { 8 } else { 0 }, 0);
    }
    if which & 0x20 != 0 {
        // Entries on the pool's devices (0 or 1), mapped.
        for entry in bytes.chunks_exact_mut(8).take(256) {
            entry[7] |= 0x80;
            entry[6] &= 1;
            entry[5] &= 0x0f;
        }
    }
    if which & 0x10 != 0 {
        crate::meta::sealed::seal(&crate::meta::sealed::key2(key), &mut bytes);
    }
    SMALL_POOL.with(|small| {
        small.store(crate::meta::store::MAP_PAGES, key, &bytes);
        small.use_volume();
    });
}

/// A checksum page as stored, loaded by the small pool and used: the first
/// byte picks the key (device 0..3, page 0..15 of it) and whether the
/// page is given its stored length (0x80) and sealed (0x40), the rest is
/// the page.
pub fn crc_page_use(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let mut bytes = rest.to_vec();
    if which & 0xc0 != 0 {
        bytes.resize(crate::meta::pages::CRCS_PER_PAGE as usize * 4, 0);
    }
    let key = (((which >> 4) & 3) as u32, (which & 0x0f) as u64 + 24);
    if which & 0x40 != 0 {
        crate::meta::sealed::seal(&crate::meta::sealed::key2(key), &mut bytes);
    }
    SMALL_POOL.with(|small| {
        small.store(crate::meta::store::CRC_PAGES, key, &bytes);
        small.use_volume();
    });
}

/// Namespace records as the small pool meets them: `data` is replayed as
/// the operations of a `Namespace` log record (when it decodes) and stored
/// as an inode row, then the pool's namespaces are stored and loaded
/// back. Nothing panics, hangs or grows without bound.
pub fn namespace_use(data: &[u8]) {
    use crate::meta::fsrows::{decode_ops, InodeRow};
    SMALL_POOL.with(|small| {
        let pool = &small.pool;
        if let Some((_, ops, _)) = decode_ops(data) {
            let record = crate::meta::log::Record::Namespace {
                dataset: SMALL_DATASET,
                ops,
            };
            if pool.check_replayed(&record).is_ok() {
                let _ = pool.apply_replayed(record);
            }
        }
        if let Some((&ino, row)) = data.split_first() {
            let txn = pool.db.begin_write().expect("a write transaction");
            txn.open_table(super::files::FS_INODES)
                .expect("the table")
                .insert((SMALL_DATASET, ino as u64 * 0x0102_0304_0506), row)
                .expect("stored");
            txn.commit().expect("committed");
            if let Ok(namespaces) = super::files::load_namespaces(&pool.db) {
                assert!(namespaces.len() <= 2);
            }
            // Forget the row again: the next input starts from the pool's state.
            let txn = pool.db.begin_write().expect("a write transaction");
            txn.open_table(super::files::FS_INODES)
                .expect("the table")
                .remove((SMALL_DATASET, ino as u64 * 0x0102_0304_0506))
                .expect("removed");
            txn.commit().expect("committed");
        }
        let _ = InodeRow::decode(data);
        let _ = small.runtime.block_on(pool.checkpoint());
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays the regression seeds of the three targets.
    #[test]
    fn corpus_seeds_do_not_panic() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus-seeds");
        let mut replayed = 0;
        for (target, run) in [
            ("meta_log_block", log_block_input as fn(&[u8])),
            ("meta_superblock", superblock_input),
            ("meta_page", page_input),
            ("meta_map_page_use", map_page_use),
            ("meta_crc_page_use", crc_page_use),
            ("meta_namespace_use", namespace_use),
        ] {
            for entry in std::fs::read_dir(root.join(target)).unwrap() {
                run(&std::fs::read(entry.unwrap().path()).unwrap());
                replayed += 1;
            }
        }
        assert!(replayed >= 15, "only {replayed} seeds found");
    }

    /// The seed files are what today's encoders produce (so they keep
    /// reaching the decoders' real work); `STRATA_WRITE_SEEDS=1` rewrites
    /// them after a format change.
    #[test]
    fn seeds_match_the_encoders() {
        use crate::meta::log::Record;
        use crate::pool::superblock::{Member, Role};
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus-seeds");
        let rewrite = std::env::var_os("STRATA_WRITE_SEEDS").is_some();
        let write = |target: &str, name: &str, bytes: &[u8]| {
            let path = root.join(target).join(name);
            if rewrite {
                std::fs::create_dir_all(root.join(target)).unwrap();
                std::fs::write(&path, bytes).unwrap();
            }
            let stored = std::fs::read(&path).unwrap_or_default();
            assert!(
                stored == bytes,
                "{} differs from the encoders' output: run with STRATA_WRITE_SEEDS=1",
                path.display()
            );
        };
        // Log blocks: flags (4 bytes), then a body of encoded records.
        let records = [
            Record::Dirty { device: 1, chunk: 77 },
            Record::Map {
                volume: 3,
                block: 9,
                new: 1 << 63 | 5,
                old: 0,
                crcs: vec![0xdead_beef, 7, 8, 9],
            },
            Record::Destroy { volume: 4 },
            Record::Written {
                volume: 3,
                first_sector: 64,
                count: 4,
            },
        ];
        let mut body = 1u32.to_le_bytes().to_vec();
        for record in &records {
            crate::meta::log::encode_record_for_fuzzing(record, &mut body);
        }
        write("meta_log_block", "records", &body);
        write("meta_log_block", "truncated", &body[..body.len() - 3]);
        let mut bad_count = body.clone();
        bad_count[4 + 10 + 29] = 200;
        write("meta_log_block", "crc-count-too-large", &bad_count);
        // A shared block's move, and one naming too many owners.
        let relocate = Record::Relocate {
            block: 9,
            old: 1 << 63 | 5,
            new: 1 << 63 | 1 << 48 | 12,
            crcs: vec![0xdead_beef, 7],
            owners: vec![3, 0x8000_0001],
        };
        let mut body = 1u32.to_le_bytes().to_vec();
        crate::meta::log::encode_record_for_fuzzing(&relocate, &mut body);
        write("meta_log_block", "relocate", &body);
        // The owner count follows the type, three slots and two checksums.
        let mut too_many = body.clone();
        too_many[4 + 1 + 24 + 1 + 8..4 + 1 + 24 + 1 + 8 + 2].copy_from_slice(&u16::MAX.to_le_bytes());
        write("meta_log_block", "relocate-too-many-owners", &too_many);
        // A mirror repair's checksums.
        let sums = Record::Sums {
            device: 1,
            offset: 1 << 20,
            crcs: vec![0xdead_beef, 7],
        };
        let mut body = 1u32.to_le_bytes().to_vec();
        crate::meta::log::encode_record_for_fuzzing(&sums, &mut body);
        write("meta_log_block", "sums", &body);
        // Superblocks: a real one, one with too many members, a cut one.
        let superblock = Superblock {
            format: crate::pool::superblock::FORMAT_VERSION,
            pool_uuid: [7; 16],
            pool_name: "tank".into(),
            generation: 3,
            created_unix: 1_700_000_000,
            chunk_bytes: 1 << 20,
            device_index: 0,
            meta_device: 0,
            meta_offset: 1 << 20,
            meta_bytes: 64 << 20,
            log_device: 0,
            log_offset: 65 << 20,
            log_bytes: 64 << 20,
            members: vec![Member {
                uuid: [1; 16],
                role: Role::Fast,
                index: 0,
                size_bytes: 1 << 30,
                state: crate::pool::superblock::MemberState::Active,
            }],
            device_uuid: [1; 16],
            children: Vec::new(),
        };
        let bytes = superblock.encode();
        write("meta_superblock", "valid", &bytes);
        // A mirrored member: the device is its second child.
        let child = |uuid: u8| crate::pool::superblock::Child {
            uuid: [uuid; 16],
            member: 0,
            state: crate::pool::superblock::ChildState::Online,
            write_mostly: false,
            resilvered: 0,
            tracked: false,
            replaced: false,
            replacement: false,
        };
        let mirrored = Superblock {
            device_uuid: [9; 16],
            children: vec![child(8), child(9)],
            ..superblock.clone()
        };
        write("meta_superblock", "mirror", &mirrored.encode());
        let mut many = bytes.clone();
        many[53] = 200;
        write("meta_superblock", "too-many-members", &many);
        write("meta_superblock", "cut", &bytes[..300]);
        // Pages: a full map page, one entry short, a checksum page.
        let map: Vec<u8> = (0..256u64).flat_map(|i| (i | 1 << 63).to_le_bytes()).collect();
        write("meta_page", "map", &map);
        write("meta_page", "map-short", &map[..map.len() - 8]);
        let crcs: Vec<u8> = (0..1024u32).flat_map(|i| i.to_le_bytes()).collect();
        write("meta_page", "crc", &crcs);
        // The same pages as written now: sealed under the target's key.
        let sealed = |body: &[u8]| {
            let mut bytes = body.to_vec();
            crate::meta::sealed::seal(&crate::meta::sealed::key2(PAGE_KEY), &mut bytes);
            bytes
        };
        let mut born = map.clone();
        born.extend_from_slice(&5u64.to_le_bytes());
        let map_sealed = sealed(&born);
        write("meta_page", "map-sealed", &map_sealed);
        let mut flipped = map_sealed.clone();
        flipped[100] ^= 0x10;
        write("meta_page", "map-sealed-flipped", &flipped);
        write("meta_page", "crc-sealed", &sealed(&crcs));
        // Pages the small pool loads and uses (first byte: which page,
        // and how much of it the target fixes up).
        let page = |entry: fn(u64) -> u64| -> Vec<u8> {
            let mut bytes = vec![0x80u8];
            bytes.extend((0..256u64).flat_map(|i| entry(i).to_le_bytes()));
            bytes
        };
        // Device 7 of a pool of two: the read that met it used to panic.
        write(
            "meta_map_page_use",
            "device-out-of-range",
            &page(|i| (1 << 63) | (7 << 48) | ((97 << 8) + i * 4)),
        );
        write(
            "meta_map_page_use",
            "log-region",
            &page(|i| (1 << 63) | ((50 << 8) + i * 4)),
        );
        write(
            "meta_map_page_use",
            "past-the-end",
            &page(|i| (1 << 63) | (1 << 48) | ((200 << 8) + i)),
        );
        write("meta_map_page_use", "flags-unmapped", &page(|i| i));
        write("meta_map_page_use", "valid", &page(|i| (1 << 63) | ((97 << 8) + i * 4)));
        // Sealed by the target (0x10), with a birth.
        let mut sealed_page = page(|i| (1 << 63) | ((97 << 8) + i * 4));
        sealed_page[0] = 0x10;
        sealed_page.extend_from_slice(&3u64.to_le_bytes());
        write("meta_map_page_use", "sealed-valid", &sealed_page);
        sealed_page[0] = 0x11;
        write("meta_map_page_use", "sealed-page-1", &sealed_page);
        let mut crc = vec![0x80 | 0x30];
        crc.extend(&crcs);
        write("meta_crc_page_use", "device-3", &crc);
        crc[0] = 0x80;
        write("meta_crc_page_use", "stored", &crc);
        write("meta_crc_page_use", "short", &crc[..100]);
        crc[0] = 0x40;
        write("meta_crc_page_use", "sealed", &crc);
        // Namespace operations: the inode limit, and past it.
        use crate::meta::fsrows::{encode_ops, NsOp, MAX_INODES};
        let mut ops = Vec::new();
        encode_ops(
            2,
            &[NsOp::Free { ino: MAX_INODES - 1 }, NsOp::Reaped { ino: 7 }],
            &mut ops,
        );
        write("meta_namespace_use", "at-the-limit", &ops);
        let mut past = Vec::new();
        encode_ops(2, &[NsOp::Free { ino: 1 << 60 }], &mut past);
        write("meta_namespace_use", "past-the-limit", &past);
    }

    /// A map page naming a device the pool does not have (what rot of its
    /// device byte makes): the reads that need it fail with an error,
    /// counted (the page maps all 4 MiB of the volume's 16 KiB blocks); the
    /// other volume still reads back right, and nothing panics (the read used to panic in
    /// `DeviceList::index`, on the connection's task).
    #[test]
    fn a_map_entry_naming_a_missing_device_fails_its_reads_and_nothing_else() {
        use crate::block::BlockDevice;
        let small = SmallPool::new();
        let page: Vec<u8> = (0..256u64)
            .flat_map(|i| ((1u64 << 63) | (7 << 48) | ((97 << 8) + i * 4)).to_le_bytes())
            .collect();
        small.store(crate::meta::store::MAP_PAGES, (SMALL_VOLUME, 0), &page);
        let before = small.pool.metadata_errors();
        small.runtime.block_on(async {
            let (_, result) = small.volume.read(0, crate::device::IoBuf::new(4096)).await;
            let error = result.expect_err("a read through the damaged page");
            assert!(error.to_string().contains("map_pages key (1, 0): entry 0"), "{error}");
            let (_, again) = small.volume.read(8192, crate::device::IoBuf::new(4096)).await;
            assert!(again.is_err());
            assert!(
                small.pool.metadata_errors() >= before + 2,
                "each failed request is counted"
            );
            let (buf, result) = small.other.read(0, crate::device::IoBuf::new(1 << 20)).await;
            result.unwrap();
            assert!(buf.payload().iter().all(|b| *b == 0x5a), "the other volume reads right");
        });
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// Random inputs (the same checks as the fuzz targets, on stable).
        #[test]
        fn random_inputs_never_panic(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..5000)) {
            log_block_input(&data);
            superblock_input(&data);
            page_input(&data);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        /// Random pages and namespace records loaded into the small pool
        /// and used (the "use" fuzz targets, on stable).
        #[test]
        fn random_records_used_by_a_pool_never_panic(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2100)) {
            map_page_use(&data);
            crc_page_use(&data);
            namespace_use(&data);
        }
    }
}
