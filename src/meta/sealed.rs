//! Checksums over the metadata store's values ("seals").
//!
//! redb checksums its B-tree pages, but verifies them only when it repairs
//! a database after an unclean shutdown, or when asked to
//! (`check_integrity`); an ordinary read trusts the bytes it gets. A bit
//! that flips in a stored map page then decodes as a plausible entry (a
//! slot of another block) unless something checks it. So every value of
//! the tables whose layout allows it carries a CRC-32C of its key and its
//! bytes (docs/FORMAT.md, "Checksums of stored values"), checked as it is
//! decoded. The key is covered so that a value found under another key (a
//! flipped bit in a key, a misdirected write inside the store) fails too.
//!
//! Values written by pools from before the seal stay readable: each table
//! tells a sealed value from an older one by its length or by marker bits
//! chosen so that no single flipped bit turns one form into the other
//! (see each table's decoder).

/// Bytes a seal adds at the end of a value.
pub const SEAL_BYTES: usize = 4;

/// The key `(owner, index)` of a page or chunk table as the seal covers
/// it: both integers little endian.
pub fn key2(key: (u32, u64)) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[..4].copy_from_slice(&key.0.to_le_bytes());
    out[4..].copy_from_slice(&key.1.to_le_bytes());
    out
}

/// The key `(dataset, directory, cookie)` of `fs_entries` as the seal
/// covers it.
pub fn key3(key: (u32, u64, u64)) -> [u8; 20] {
    let mut out = [0u8; 20];
    out[..4].copy_from_slice(&key.0.to_le_bytes());
    out[4..12].copy_from_slice(&key.1.to_le_bytes());
    out[12..].copy_from_slice(&key.2.to_le_bytes());
    out
}

/// The checksum a value stored under `key` carries.
fn seal_of(key: &[u8], body: &[u8]) -> u32 {
    crate::checksum::crc32c_of_parts(&[key, body])
}

/// Appends the seal of `value` (stored under `key`) to it.
pub fn seal(key: &[u8], value: &mut Vec<u8>) {
    let crc = seal_of(key, value);
    value.extend_from_slice(&crc.to_le_bytes());
}

/// The value under a seal: `stored` without its last [`SEAL_BYTES`], if
/// they are the checksum of `key` and the rest. The error names the
/// field, `checksum`, for the caller to prefix with the table and key.
pub fn unseal<'a>(key: &[u8], stored: &'a [u8]) -> Result<&'a [u8], String> {
    let Some(split) = stored.len().checked_sub(SEAL_BYTES) else {
        return Err(format!(
            "checksum: a value of {} bytes has no room for one",
            stored.len()
        ));
    };
    let (body, tail) = stored.split_at(split);
    let recorded = u32::from_le_bytes(tail.try_into().expect("split leaves SEAL_BYTES"));
    let computed = seal_of(key, body);
    if recorded != computed {
        return Err(format!(
            "checksum: stored {recorded:#010x}, computed {computed:#010x} over the key and {} bytes",
            body.len()
        ));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_value_opens_under_its_key_only_and_any_flipped_bit_fails() {
        let key = key2((3, 77));
        let mut value = b"entries".to_vec();
        seal(&key, &mut value);
        assert_eq!(value.len(), 7 + SEAL_BYTES);
        assert_eq!(unseal(&key, &value).unwrap(), b"entries");
        let error = unseal(&key2((3, 78)), &value).unwrap_err();
        assert!(error.starts_with("checksum: stored"), "{error}");
        for bit in 0..value.len() * 8 {
            let mut flipped = value.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(unseal(&key, &flipped).is_err(), "bit {bit}");
        }
        assert!(unseal(&key, &[1, 2]).unwrap_err().contains("no room"));
        // The seal is the CRC-32C of the key's bytes, then the value's.
        let mut whole = key.to_vec();
        whole.extend_from_slice(b"entries");
        assert_eq!(value[7..], crate::checksum::crc32c(&whole).to_le_bytes());
        assert_eq!(key3((1, 2, 3))[12], 3);
    }
}
