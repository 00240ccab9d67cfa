//! CHAP for the iSCSI login (RFC 7143 12.1.3, RFC 1994) with MD5 (CHAP_A=5):
//! binary values in the text keys' hex (`0x…`) and base64 (`0b…`) forms,
//! decoded with a bound checked before anything is allocated; the response
//! `MD5(identifier || secret || challenge)`; challenges from /dev/urandom.
//! Pure functions apart from [`random_bytes`].

use md5::{Digest, Md5};

/// The only algorithm we offer: MD5 (RFC 7143 12.1.3, IANA PPP auth algorithm 5).
pub const ALGORITHM_MD5: &str = "5";
/// Bytes of an MD5 CHAP response.
pub const RESPONSE_BYTES: usize = 16;
/// Bytes of the challenges we send (RFC 7143: at least the hash length).
pub const CHALLENGE_BYTES: usize = 16;
/// Longest challenge we accept from an initiator (RFC 7143 12.1.3 limits
/// CHAP_C to 1024 bytes).
pub const MAX_CHALLENGE_BYTES: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("binary value without a 0x or 0b prefix")]
    NoPrefix,
    #[error("binary value longer than {0} bytes")]
    TooLong(usize),
    #[error("empty binary value")]
    Empty,
    #[error("invalid digit in a binary value")]
    BadDigit,
}

fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn base64_digit(b: u8) -> Option<u8> {
    match b {
        b'A'..=b'Z' => Some(b - b'A'),
        b'a'..=b'z' => Some(b - b'a' + 26),
        b'0'..=b'9' => Some(b - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    }
}

/// Decodes a binary value (RFC 7143 6.1: `0x` hex, `0b` base64) of at most
/// `max_bytes` bytes. The encoded length is checked against the bound before
/// any allocation, so an oversized value costs nothing.
pub fn decode_binary(value: &str, max_bytes: usize) -> Result<Vec<u8>, DecodeError> {
    let bytes = value.as_bytes();
    if bytes.len() < 2 || bytes[0] != b'0' {
        return Err(DecodeError::NoPrefix);
    }
    let body = &bytes[2..];
    match bytes[1] {
        b'x' | b'X' => {
            // An odd number of digits has an implied leading zero.
            let decoded_len = body.len().div_ceil(2);
            if decoded_len > max_bytes {
                return Err(DecodeError::TooLong(max_bytes));
            }
            if body.is_empty() {
                return Err(DecodeError::Empty);
            }
            let mut out = Vec::with_capacity(decoded_len);
            let (head, rest) = body.split_at(body.len() % 2);
            if let Some(&digit) = head.first() {
                out.push(hex_digit(digit).ok_or(DecodeError::BadDigit)?);
            }
            for pair in rest.chunks_exact(2) {
                let high = hex_digit(pair[0]).ok_or(DecodeError::BadDigit)?;
                let low = hex_digit(pair[1]).ok_or(DecodeError::BadDigit)?;
                out.push(high << 4 | low);
            }
            Ok(out)
        }
        b'b' | b'B' => {
            let unpadded = body.iter().rposition(|&b| b != b'=').map_or(0, |p| p + 1);
            let padding = body.len() - unpadded;
            if padding > 2 || (padding > 0 && !body.len().is_multiple_of(4)) {
                return Err(DecodeError::BadDigit);
            }
            let digits = &body[..unpadded];
            if digits.len() % 4 == 1 {
                return Err(DecodeError::BadDigit);
            }
            let decoded_len = digits.len() / 4 * 3 + (digits.len() % 4).saturating_sub(1);
            if decoded_len > max_bytes {
                return Err(DecodeError::TooLong(max_bytes));
            }
            if decoded_len == 0 {
                return Err(DecodeError::Empty);
            }
            let mut out = Vec::with_capacity(decoded_len);
            for group in digits.chunks(4) {
                let mut bits: u32 = 0;
                for &digit in group {
                    bits = bits << 6 | u32::from(base64_digit(digit).ok_or(DecodeError::BadDigit)?);
                }
                bits <<= 6 * (4 - group.len() as u32);
                let produced = group.len() - 1;
                out.extend_from_slice(&bits.to_be_bytes()[1..1 + produced]);
            }
            Ok(out)
        }
        _ => Err(DecodeError::NoPrefix),
    }
}

/// `0x` followed by lowercase hex digits.
pub fn encode_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 + 2 * bytes.len());
    out.push_str("0x");
    for &b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
    out
}

/// The CHAP response: MD5 over the identifier, the secret and the challenge.
pub fn response(identifier: u8, secret: &[u8], challenge: &[u8]) -> [u8; RESPONSE_BYTES] {
    let mut md5 = Md5::new();
    md5.update([identifier]);
    md5.update(secret);
    md5.update(challenge);
    md5.finalize().into()
}

/// Compares without stopping at the first difference, so the time taken does
/// not tell how much of a guess was right.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Fills `buf` from the kernel's random source.
pub fn random_bytes(buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

/// Parses CHAP_I: a number from 0 to 255, decimal or `0x` hex.
pub fn parse_identifier(value: &str) -> Option<u8> {
    if value.is_empty() || value.len() > 8 {
        return None;
    }
    if let Some(hex) = value.strip_prefix("0x").or_else(|| value.strip_prefix("0X")) {
        return u8::from_str_radix(hex, 16).ok();
    }
    if !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    value.parse().ok()
}

/// Whether a CHAP_A list (comma-separated algorithm numbers) offers MD5.
pub fn offers_md5(list: &str) -> bool {
    list.split(',').any(|a| a.trim() == ALGORITHM_MD5)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(text: &str) -> Vec<u8> {
        decode_binary(&format!("0x{text}"), 1 << 20).unwrap()
    }

    #[test]
    fn md5_response_matches_rfc_1321_vectors() {
        // MD5("abc") with the identifier byte 'a' and the challenge "c".
        assert_eq!(
            response(b'a', b"b", b"c").to_vec(),
            hex("900150983cd24fb0d6963f7d28e17f72")
        );
        // MD5("message digest"): identifier 'm', secret "essage ", challenge "digest".
        assert_eq!(
            response(b'm', b"essage ", b"digest").to_vec(),
            hex("f96b697d7cb7938d525a2f31aaf161d0")
        );
    }

    #[test]
    fn hex_and_base64_decode_within_bounds() {
        assert_eq!(decode_binary("0x0102ff", 16).unwrap(), vec![1, 2, 255]);
        assert_eq!(decode_binary("0XABC", 16).unwrap(), vec![0x0a, 0xbc]);
        assert_eq!(decode_binary("0bAQL/", 16).unwrap(), vec![1, 2, 255]);
        assert_eq!(decode_binary("0bAQI=", 16).unwrap(), vec![1, 2]);
        assert_eq!(decode_binary("0bAQ==", 16).unwrap(), vec![1]);
        assert_eq!(decode_binary("0bAQ", 16).unwrap(), vec![1]);
        assert_eq!(
            decode_binary(&encode_hex(&[0xde, 0xad, 0x00]), 3).unwrap(),
            vec![0xde, 0xad, 0]
        );
        assert_eq!(decode_binary("0x", 16), Err(DecodeError::Empty));
        assert_eq!(decode_binary("0b", 16), Err(DecodeError::Empty));
        assert_eq!(decode_binary("abcd", 16), Err(DecodeError::NoPrefix));
        assert_eq!(decode_binary("0xzz", 16), Err(DecodeError::BadDigit));
        assert_eq!(decode_binary("0bA", 16), Err(DecodeError::BadDigit));
        assert_eq!(decode_binary("0bA===", 16), Err(DecodeError::BadDigit));
        // 17 bytes where 16 are allowed, in both encodings.
        assert_eq!(
            decode_binary(&format!("0x{}", "ab".repeat(17)), 16),
            Err(DecodeError::TooLong(16))
        );
        assert_eq!(
            decode_binary(&format!("0b{}", "A".repeat(24)), 16),
            Err(DecodeError::TooLong(16))
        );
        // A huge value is refused by its length alone.
        let huge = format!("0x{}", "f".repeat(1 << 20));
        assert_eq!(
            decode_binary(&huge, MAX_CHALLENGE_BYTES),
            Err(DecodeError::TooLong(1024))
        );
    }

    #[test]
    fn identifiers_and_algorithms() {
        assert_eq!(parse_identifier("0"), Some(0));
        assert_eq!(parse_identifier("255"), Some(255));
        assert_eq!(parse_identifier("0x7f"), Some(127));
        assert_eq!(parse_identifier("256"), None);
        assert_eq!(parse_identifier("-1"), None);
        assert_eq!(parse_identifier(""), None);
        assert!(offers_md5("7, 5"));
        assert!(!offers_md5("6,7,50"));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

    #[test]
    fn random_challenges_differ() {
        let (mut a, mut b) = ([0u8; CHALLENGE_BYTES], [0u8; CHALLENGE_BYTES]);
        random_bytes(&mut a).unwrap();
        random_bytes(&mut b).unwrap();
        assert_ne!(a, b);
    }
}
