//! Little-endian fields of on-disk structures. Every read says when the
//! bytes are not there (`None`) instead of inventing zeros: a decoder turns
//! that into an error naming the structure and the field.

/// The `N` bytes at `at`, if `bytes` holds them.
pub fn array_at<const N: usize>(bytes: &[u8], at: usize) -> Option<[u8; N]> {
    bytes.get(at..at.checked_add(N)?)?.try_into().ok()
}

/// The little-endian `u32` at `at`, if `bytes` holds it.
pub fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    array_at(bytes, at).map(u32::from_le_bytes)
}

/// The little-endian `u64` at `at`, if `bytes` holds it.
pub fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    array_at(bytes, at).map(u64::from_le_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_past_the_end_are_missing_not_zero() {
        let bytes = [1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(u32_at(&bytes, 0), Some(1));
        assert_eq!(u64_at(&bytes, 4), Some(2));
        assert_eq!(u64_at(&bytes, 5), None);
        assert_eq!(u32_at(&bytes, usize::MAX - 1), None);
        assert_eq!(array_at::<3>(&bytes, 9), Some([0, 0, 0]));
        assert_eq!(array_at::<3>(&bytes, 10), None);
    }
}
