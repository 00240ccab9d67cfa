//! Text keys (RFC 7143 section 6 and 13): parsing `key=value` pairs,
//! encoding them, and negotiating the operational parameters of a session.

/// Longest key name (RFC 7143 6.1: up to 63 bytes).
pub const MAX_KEY_BYTES: usize = 63;
/// Longest value we accept. Most values are at most 255 bytes; CHAP
/// challenges and responses in hex may be longer, so allow some room, but
/// never unbounded.
pub const MAX_VALUE_BYTES: usize = 2048;
/// Most keys accepted in one login or text exchange.
pub const MAX_KEYS: usize = 256;
/// Most bytes of text accumulated across continued (C bit) PDUs.
pub const MAX_TEXT_BYTES: usize = 64 * 1024;

/// Our MaxRecvDataSegmentLength: the largest data segment we accept.
pub const TARGET_MAX_RECV_DATA_SEGMENT: u32 = 256 * 1024;
/// Upper bounds we offer for the burst lengths.
pub const TARGET_MAX_BURST: u32 = 1024 * 1024;
pub const TARGET_FIRST_BURST: u32 = 256 * 1024;
/// Most R2Ts we keep outstanding per command.
pub const TARGET_MAX_OUTSTANDING_R2T: u32 = 16;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    #[error("text pair without '='")]
    MissingEquals,
    #[error("key of {0} bytes is longer than 63 bytes")]
    KeyTooLong(usize),
    #[error("key contains invalid characters")]
    BadKey,
    #[error("value of {0} bytes is too long")]
    ValueTooLong(usize),
    #[error("text is not valid UTF-8")]
    NotUtf8,
    #[error("more than {MAX_KEYS} keys")]
    TooManyKeys,
    #[error("key {0} given twice")]
    Duplicate(String),
}

fn valid_key(key: &str) -> bool {
    !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || b".-+@_".contains(&b))
}

/// Parses NUL-separated `key=value` pairs. Empty pairs (padding, a trailing
/// NUL) are skipped. Keys may not repeat.
pub fn parse(data: &[u8]) -> Result<Vec<(String, String)>, TextError> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for raw in data.split(|&b| b == 0) {
        if raw.is_empty() {
            continue;
        }
        if pairs.len() == MAX_KEYS {
            return Err(TextError::TooManyKeys);
        }
        let eq = raw.iter().position(|&b| b == b'=').ok_or(TextError::MissingEquals)?;
        let (key, value) = (&raw[..eq], &raw[eq + 1..]);
        if key.len() > MAX_KEY_BYTES {
            return Err(TextError::KeyTooLong(key.len()));
        }
        if value.len() > MAX_VALUE_BYTES {
            return Err(TextError::ValueTooLong(value.len()));
        }
        let key = std::str::from_utf8(key).map_err(|_| TextError::NotUtf8)?;
        let value = std::str::from_utf8(value).map_err(|_| TextError::NotUtf8)?;
        if !valid_key(key) {
            return Err(TextError::BadKey);
        }
        if pairs.iter().any(|(k, _)| k == key) {
            return Err(TextError::Duplicate(key.to_string()));
        }
        pairs.push((key.to_string(), value.to_string()));
    }
    Ok(pairs)
}

/// Encodes pairs as `key=value\0...`.
pub fn encode(pairs: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (key, value) in pairs {
        out.extend_from_slice(key.as_bytes());
        out.push(b'=');
        out.extend_from_slice(value.as_bytes());
        out.push(0);
    }
    out
}

/// The negotiated operational parameters of a session (RFC 7143 13).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    pub header_digest: bool,
    pub data_digest: bool,
    /// The initiator's MaxRecvDataSegmentLength: the most we may send per PDU.
    pub initiator_max_recv_data_segment: u32,
    pub max_burst: u32,
    pub first_burst: u32,
    pub immediate_data: bool,
    pub initial_r2t: bool,
    pub max_outstanding_r2t: u32,
    pub default_time2wait: u32,
    pub default_time2retain: u32,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            header_digest: false,
            data_digest: false,
            initiator_max_recv_data_segment: 8192,
            max_burst: 262144,
            first_burst: 65536,
            immediate_data: true,
            initial_r2t: true,
            max_outstanding_r2t: 1,
            default_time2wait: 2,
            default_time2retain: 20,
        }
    }
}

/// What to answer for one offered key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Reply `key=value`.
    Reply(String),
    /// Declarative or informational key: nothing to reply.
    Silent,
    /// Not a key we know: reply `key=NotUnderstood`.
    NotUnderstood,
    /// Invalid value: reply `key=Reject` (RFC 7143 6.2).
    Reject,
}

fn parse_number(value: &str, min: u32, max: u32) -> Option<u32> {
    let n: u64 = if let Some(hex) = value.strip_prefix("0x").or_else(|| value.strip_prefix("0X")) {
        u64::from_str_radix(hex, 16).ok()?
    } else {
        if value.is_empty() || value.len() > 20 || !value.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        value.parse().ok()?
    };
    if n < min as u64 || n > max as u64 {
        return None;
    }
    Some(n as u32)
}

fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

fn yes_no(value: bool) -> String {
    if value { "Yes" } else { "No" }.to_string()
}

/// Picks a digest from the initiator's list: the first one we support.
fn choose_digest(value: &str) -> Option<bool> {
    value.split(',').find_map(|option| match option {
        "None" => Some(false),
        "CRC32C" => Some(true),
        _ => None,
    })
}

/// Negotiates one operational key, updating `params`. `discovery` sessions
/// find session-wide data movement keys irrelevant.
pub fn negotiate(key: &str, value: &str, params: &mut Params, discovery: bool) -> Answer {
    const MAX_LEN: u32 = (1 << 24) - 1;
    let irrelevant_in_discovery = matches!(
        key,
        "MaxBurstLength"
            | "FirstBurstLength"
            | "ImmediateData"
            | "InitialR2T"
            | "MaxOutstandingR2T"
            | "DataPDUInOrder"
            | "DataSequenceInOrder"
            | "DefaultTime2Wait"
            | "DefaultTime2Retain"
            | "MaxConnections"
    );
    if discovery && irrelevant_in_discovery {
        return Answer::Reply("Irrelevant".into());
    }
    match key {
        "HeaderDigest" | "DataDigest" => match choose_digest(value) {
            Some(crc) => {
                if key == "HeaderDigest" {
                    params.header_digest = crc;
                } else {
                    params.data_digest = crc;
                }
                Answer::Reply(if crc { "CRC32C" } else { "None" }.into())
            }
            None => Answer::Reject,
        },
        "MaxRecvDataSegmentLength" => match parse_number(value, 512, MAX_LEN) {
            Some(n) => {
                params.initiator_max_recv_data_segment = n;
                Answer::Silent
            }
            None => Answer::Reject,
        },
        "MaxBurstLength" => match parse_number(value, 512, MAX_LEN) {
            Some(n) => {
                params.max_burst = n.min(TARGET_MAX_BURST);
                params.first_burst = params.first_burst.min(params.max_burst);
                Answer::Reply(params.max_burst.to_string())
            }
            None => Answer::Reject,
        },
        "FirstBurstLength" => match parse_number(value, 512, MAX_LEN) {
            Some(n) => {
                params.first_burst = n.min(TARGET_FIRST_BURST).min(params.max_burst.max(512));
                Answer::Reply(params.first_burst.to_string())
            }
            None => Answer::Reject,
        },
        // Boolean AND: the result is Yes only if both say Yes.
        "ImmediateData" => match parse_bool(value) {
            Some(b) => {
                params.immediate_data = b;
                Answer::Reply(yes_no(b))
            }
            None => Answer::Reject,
        },
        // Boolean OR: we are happy without an initial R2T.
        "InitialR2T" => match parse_bool(value) {
            Some(b) => {
                params.initial_r2t = b;
                Answer::Reply(yes_no(b))
            }
            None => Answer::Reject,
        },
        // OR with our Yes: always Yes; we only support in-order data.
        "DataPDUInOrder" | "DataSequenceInOrder" => match parse_bool(value) {
            Some(_) => Answer::Reply("Yes".into()),
            None => Answer::Reject,
        },
        "MaxOutstandingR2T" => match parse_number(value, 1, 65535) {
            Some(n) => {
                params.max_outstanding_r2t = n.min(TARGET_MAX_OUTSTANDING_R2T);
                Answer::Reply(params.max_outstanding_r2t.to_string())
            }
            None => Answer::Reject,
        },
        "DefaultTime2Wait" => match parse_number(value, 0, 3600) {
            Some(n) => {
                params.default_time2wait = n.max(2);
                Answer::Reply(params.default_time2wait.to_string())
            }
            None => Answer::Reject,
        },
        "DefaultTime2Retain" => match parse_number(value, 0, 3600) {
            Some(n) => {
                params.default_time2retain = n.min(20);
                Answer::Reply(params.default_time2retain.to_string())
            }
            None => Answer::Reject,
        },
        "ErrorRecoveryLevel" => match parse_number(value, 0, 2) {
            Some(_) => Answer::Reply("0".into()),
            None => Answer::Reject,
        },
        "MaxConnections" => match parse_number(value, 1, 65535) {
            Some(_) => Answer::Reply("1".into()),
            None => Answer::Reject,
        },
        // Markers (RFC 3720) are not supported: AND with our No.
        "IFMarker" | "OFMarker" => match parse_bool(value) {
            Some(_) => Answer::Reply("No".into()),
            None => Answer::Reject,
        },
        "IFMarkInt" | "OFMarkInt" => Answer::Reply("Irrelevant".into()),
        "InitiatorAlias" | "TargetAlias" => Answer::Silent,
        _ => Answer::NotUnderstood,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pairs_and_skips_padding() {
        let pairs = parse(b"InitiatorName=iqn.x\0SessionType=Normal\0\0\0").unwrap();
        assert_eq!(pairs.len(), 2);
        assert_eq!(pairs[1], ("SessionType".into(), "Normal".into()));
    }

    #[test]
    fn very_long_keys_are_refused_not_echoed() {
        let mut text = vec![b'K'; 5000];
        text.extend_from_slice(b"=1\0");
        assert!(matches!(parse(&text), Err(TextError::KeyTooLong(5000))));
    }

    #[test]
    fn oversized_values_are_refused() {
        let mut text = b"CHAP_R=0x".to_vec();
        text.extend(std::iter::repeat_n(b'a', 100_000));
        assert!(matches!(parse(&text), Err(TextError::ValueTooLong(_))));
    }

    #[test]
    fn duplicate_and_malformed_keys_are_errors() {
        assert!(parse(b"A=1\0A=2\0").is_err());
        assert!(parse(b"novalue\0").is_err());
        assert!(parse(b"bad key=1\0").is_err());
    }

    #[test]
    fn negotiation_follows_the_rfc_functions() {
        let mut params = Params::default();
        assert_eq!(
            negotiate("MaxBurstLength", "16776192", &mut params, false),
            Answer::Reply(TARGET_MAX_BURST.to_string())
        );
        assert_eq!(
            negotiate("FirstBurstLength", "4096", &mut params, false),
            Answer::Reply("4096".into())
        );
        assert_eq!(
            negotiate("HeaderDigest", "CRC32C,None", &mut params, false),
            Answer::Reply("CRC32C".into())
        );
        assert!(params.header_digest);
        assert_eq!(negotiate("MaxBurstLength", "12", &mut params, false), Answer::Reject);
        assert_eq!(
            negotiate("MaxBurstLength", "99999999999999999999999", &mut params, false),
            Answer::Reject
        );
        assert_eq!(
            negotiate("X-Vendor-Thing", "1", &mut params, false),
            Answer::NotUnderstood
        );
        assert_eq!(
            negotiate("ImmediateData", "Yes", &mut params, true),
            Answer::Reply("Irrelevant".into())
        );
    }
}
