//! Fuzz entry points for the pool's on-disk decoders (log blocks,
//! superblocks, map and checksum pages), shared by the `cargo fuzz` targets in `fuzz/`
//! and by the regression test that replays `fuzz/corpus-seeds/`. Each one
//! fixes up what a random input cannot get right by chance (magic numbers,
//! checksums) so the decoder's real work is reached, and checks that what
//! decodes encodes back to the same bytes.

use super::superblock::{Superblock, MAGIC, SUPERBLOCK_BYTES};
use crate::meta::pages::{CrcPage, MapPage, Page};

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

/// The map and checksum page decoders: a page decodes only at its exact
/// length, and then encodes back to the same bytes.
pub fn page_input(data: &[u8]) {
    if let Ok(page) = MapPage::decode(Some(data)) {
        assert_eq!(page.encode(), data);
    }
    if let Ok(page) = CrcPage::decode(Some(data)) {
        assert_eq!(page.encode(), data);
    }
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
        ] {
            for entry in std::fs::read_dir(root.join(target)).unwrap() {
                run(&std::fs::read(entry.unwrap().path()).unwrap());
                replayed += 1;
            }
        }
        assert!(replayed >= 9, "only {replayed} seeds found");
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
            Record::Dirty {
                device: 1,
                chunk: 77,
                parts: crate::meta::log::ALL_PARTS,
            },
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
        // Superblocks: a real one, one with too many members, a cut one.
        let superblock = Superblock {
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
            }],
        };
        let bytes = superblock.encode();
        write("meta_superblock", "valid", &bytes);
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
}
