//! XDR (RFC 4506) by hand: a bounds-checked decoder over a received record
//! and an encoder that appends to a reply buffer.
//!
//! The decoder never copies: opaque data and strings come back as slices of
//! the record, so a length field, however large, allocates nothing; it is
//! checked against the bytes that remain before anything is taken. Every
//! failure is an [`XdrError`], which the caller answers with GARBAGE_ARGS
//! (or by closing the connection when even the call header is garbled).

/// Why bytes did not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum XdrError {
    #[error("{needed} bytes needed at offset {at}, {left} left")]
    Truncated { at: usize, needed: usize, left: usize },
    #[error("length {len} exceeds the maximum {max}")]
    TooLong { len: u32, max: usize },
    #[error("{0} is not a boolean")]
    BadBool(u32),
    #[error("{0} is not a valid discriminant")]
    BadDiscriminant(u32),
}

/// Bytes of padding after `len` bytes of opaque data (XDR aligns to 4).
pub fn padding(len: usize) -> usize {
    (4 - len % 4) % 4
}

/// Reads XDR items from the front of a byte slice.
#[derive(Debug, Clone)]
pub struct Decoder<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Decoder<'a> {
    pub fn new(data: &'a [u8]) -> Decoder<'a> {
        Decoder { data, pos: 0 }
    }

    /// Bytes not yet decoded.
    pub fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    /// Offset of the next item from the start.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The bytes not yet decoded, without consuming them.
    pub fn rest(&self) -> &'a [u8] {
        &self.data[self.pos..]
    }

    /// The next `count` bytes (no padding skipped).
    fn take(&mut self, count: usize) -> Result<&'a [u8], XdrError> {
        if count > self.remaining() {
            return Err(XdrError::Truncated {
                at: self.pos,
                needed: count,
                left: self.remaining(),
            });
        }
        let bytes = &self.data[self.pos..self.pos + count];
        self.pos += count;
        Ok(bytes)
    }

    pub fn u32(&mut self) -> Result<u32, XdrError> {
        let bytes = self.take(4)?;
        Ok(u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    pub fn u64(&mut self) -> Result<u64, XdrError> {
        let high = self.u32()? as u64;
        let low = self.u32()? as u64;
        Ok(high << 32 | low)
    }

    /// Only 0 and 1 are booleans; anything else is garbage, not `true`.
    pub fn bool(&mut self) -> Result<bool, XdrError> {
        match self.u32()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(XdrError::BadBool(other)),
        }
    }

    /// Fixed-length opaque data of `len` bytes, and its padding.
    pub fn opaque_fixed(&mut self, len: usize) -> Result<&'a [u8], XdrError> {
        let bytes = self.take(len)?;
        self.take(padding(len))?;
        Ok(bytes)
    }

    /// `N` bytes of fixed-length opaque data (verifiers, cookie verifiers).
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], XdrError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.opaque_fixed(N)?);
        Ok(out)
    }

    /// Variable-length opaque data of at most `max` bytes. The length is
    /// checked against `max` and against what is left before anything is
    /// taken.
    pub fn opaque(&mut self, max: usize) -> Result<&'a [u8], XdrError> {
        let len = self.u32()?;
        if len as usize > max {
            return Err(XdrError::TooLong { len, max });
        }
        self.opaque_fixed(len as usize)
    }

    /// A string of at most `max` bytes. NFS names are bytes, not
    /// necessarily UTF-8, so this is [`Decoder::opaque`] by another name.
    pub fn string(&mut self, max: usize) -> Result<&'a [u8], XdrError> {
        self.opaque(max)
    }

    /// XDR's optional-data (`*T`): a boolean, then the item if it is true.
    pub fn optional<T>(&mut self, item: impl FnOnce(&mut Self) -> Result<T, XdrError>) -> Result<Option<T>, XdrError> {
        if self.bool()? {
            Ok(Some(item(self)?))
        } else {
            Ok(None)
        }
    }
}

/// Appends XDR items to a buffer.
pub trait Encode {
    fn put_u32(&mut self, value: u32);
    fn put_u64(&mut self, value: u64);
    fn put_bool(&mut self, value: bool);
    /// Fixed-length opaque data and its padding.
    fn put_fixed(&mut self, bytes: &[u8]);
    /// Variable-length opaque data: length, bytes, padding.
    fn put_opaque(&mut self, bytes: &[u8]);
    fn put_string(&mut self, text: &[u8]) {
        self.put_opaque(text)
    }
}

impl Encode for Vec<u8> {
    fn put_u32(&mut self, value: u32) {
        self.extend_from_slice(&value.to_be_bytes());
    }

    fn put_u64(&mut self, value: u64) {
        self.extend_from_slice(&value.to_be_bytes());
    }

    fn put_bool(&mut self, value: bool) {
        self.put_u32(value as u32);
    }

    fn put_fixed(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
        self.extend_from_slice(&[0u8; 3][..padding(bytes.len())]);
    }

    fn put_opaque(&mut self, bytes: &[u8]) {
        // Callers pass replies' data, far below 4 GiB (a record is at most
        // rpc::MAX_RECORD).
        self.put_u32(bytes.len() as u32);
        self.put_fixed(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_round_trip() {
        let mut out = Vec::new();
        out.put_u32(7);
        out.put_u64(0x0102_0304_0506_0708);
        out.put_bool(true);
        out.put_opaque(b"abcde");
        out.put_fixed(&[9, 9]);
        out.put_string(b"");
        out.put_bool(false);
        out.put_bool(true);
        out.put_u32(42);
        assert_eq!(out.len() % 4, 0);
        assert_eq!(&out[16..28], &[0, 0, 0, 5, b'a', b'b', b'c', b'd', b'e', 0, 0, 0]);

        let mut d = Decoder::new(&out);
        assert_eq!(d.u32(), Ok(7));
        assert_eq!(d.u64(), Ok(0x0102_0304_0506_0708));
        assert_eq!(d.bool(), Ok(true));
        assert_eq!(d.opaque(5), Ok(&b"abcde"[..]));
        assert_eq!(d.opaque_fixed(2), Ok(&[9u8, 9][..]));
        assert_eq!(d.string(10), Ok(&b""[..]));
        assert_eq!(d.optional(|d| d.u32()), Ok(None));
        assert_eq!(d.optional(|d| d.u32()), Ok(Some(42)));
        assert_eq!(d.remaining(), 0);
        assert!(matches!(d.u32(), Err(XdrError::Truncated { .. })));
    }

    #[test]
    fn bounds_are_checked_before_anything_is_taken() {
        // A length claiming 4 GiB, with nothing behind it.
        let mut d = Decoder::new(&[0xff, 0xff, 0xff, 0xff]);
        assert_eq!(
            d.opaque(usize::MAX),
            Err(XdrError::Truncated {
                at: 4,
                needed: u32::MAX as usize,
                left: 0
            })
        );
        let mut d = Decoder::new(&[0, 0, 0, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0]);
        assert_eq!(d.clone().opaque(8), Err(XdrError::TooLong { len: 9, max: 8 }));
        assert!(d.opaque(9).is_ok());
        // Missing padding is truncation.
        let mut d = Decoder::new(&[0, 0, 0, 1, 7]);
        assert!(matches!(d.opaque(4), Err(XdrError::Truncated { .. })));
        assert_eq!(Decoder::new(&[0, 0, 0, 2]).bool(), Err(XdrError::BadBool(2)));
        assert!(Decoder::new(&[0, 0, 0]).u32().is_err());
        assert!(Decoder::new(&[0; 7]).u64().is_err());
        assert_eq!(Decoder::new(&[1, 2, 3, 4, 0, 0, 0, 0]).array::<4>(), Ok([1, 2, 3, 4]));
    }
}
