//! Fuzz entry point for the send stream parser (`control::stream`), shared
//! by the `cargo fuzz` target `send_stream` in `fuzz/` and by the
//! regression test that replays `fuzz/corpus-seeds/send_stream`. A stream
//! is parsed as it comes, then once more with what a random input cannot
//! get right by chance (the header's, each record's and the stream's
//! CRC-32C, END's counts, the announced length) made right, so the checks
//! behind the checksums are reached; what is accepted must be a stream a
//! receive can apply.

use super::stream::{self, Header, Parsed, Position, RecordKind, RECORD_HEADER_BYTES};

/// The parser on `data` as it is, and on `data` with its checksums and
/// counts fixed up: no input may panic, and an accepted stream must hold.
pub fn stream_input(data: &[u8]) {
    parse_and_check(data);
    if let Some(fixed) = fix_up(data) {
        parse_and_check(&fixed);
    }
}

/// [`stream::parse`] (for a continuation, from the position it names, as
/// a pending receive would be), and the invariants of what it accepts.
fn parse_and_check(data: &[u8]) {
    let resume = Header::decode(data)
        .ok()
        .and_then(|h| h.resume_offset)
        .map(|offset| Position {
            offset,
            ..Position::default()
        });
    let _ = stream::parse(data, None);
    if let Ok(parsed) = stream::parse(data, resume) {
        check(data, &parsed);
    }
}

fn check(data: &[u8], parsed: &Parsed) {
    let header = &parsed.header;
    let header_bytes = header.encode();
    assert_eq!(
        &data[..header_bytes.len()],
        &header_bytes[..],
        "a header that does not encode back"
    );
    assert!(parsed.consumed <= data.len());
    assert_eq!(
        parsed.end.offset, header.stream_bytes,
        "END not at the announced length"
    );
    let block = header.volblocksize as u64;
    let mut volume_end = 0;
    let mut data_bytes = 0;
    for &(kind, offset, length) in &parsed.records {
        assert!(offset >= volume_end, "records out of order");
        assert!(length > 0 && offset.is_multiple_of(block));
        assert!(offset + length <= header.volsize);
        assert!((offset + length).is_multiple_of(block) || offset + length == header.volsize);
        assert_ne!(kind, RecordKind::End);
        if kind == RecordKind::Write {
            assert!(length <= stream::MAX_WRITE_BYTES);
            data_bytes += length;
        }
        volume_end = offset + length;
    }
    if header.resume_offset.is_none() {
        assert_eq!(parsed.end.records, parsed.records.len() as u64);
        assert_eq!(parsed.end.data_bytes, data_bytes);
        assert_eq!(parsed.consumed as u64, header.stream_bytes);
    }
}

/// `data` with the header's CRC, each record's CRC, END's counts and
/// stream CRC, and the header's stream length made right (`None` when no
/// header length can be read).
pub fn fix_up(data: &[u8]) -> Option<Vec<u8>> {
    let mut bytes = data.to_vec();
    let length = Header::length(bytes.get(..16)?).ok()?;
    if bytes.len() < length {
        return None;
    }
    let continuation = bytes[11] & stream::FLAG_CONTINUATION != 0;
    // The records' extent first: the header announces the stream's length.
    let mut at = length;
    let mut stream_end = None;
    while at + RECORD_HEADER_BYTES <= bytes.len() {
        let payload = (crate::bytes::u32_at(&bytes, at + 4)? as usize).min(bytes.len() - at - RECORD_HEADER_BYTES);
        bytes[at + 4..at + 8].copy_from_slice(&(payload as u32).to_le_bytes());
        at += RECORD_HEADER_BYTES + payload;
        if bytes[at - RECORD_HEADER_BYTES - payload] == RecordKind::End as u8 {
            stream_end = Some(at);
            break;
        }
    }
    if let (Some(end), false) = (stream_end, continuation) {
        bytes[56..64].copy_from_slice(&(end as u64).to_le_bytes());
    }
    let header_crc = crc32c::crc32c(&bytes[..length - 4]);
    bytes[length - 4..length].copy_from_slice(&header_crc.to_le_bytes());
    let mut crc = crc32c::crc32c(&bytes[..length]);
    let (mut records, mut data_bytes) = (0u64, 0u64);
    let mut at = length;
    while at + RECORD_HEADER_BYTES <= bytes.len() {
        let payload = crate::bytes::u32_at(&bytes, at + 4)? as usize;
        let payload_at = at + RECORD_HEADER_BYTES;
        let is_end = bytes[at] == RecordKind::End as u8;
        if is_end {
            bytes[at + 8..at + 16].copy_from_slice(&records.to_le_bytes());
            bytes[at + 16..at + 24].copy_from_slice(&data_bytes.to_le_bytes());
            if payload >= 4 {
                bytes[payload_at..payload_at + 4].copy_from_slice(&crc.to_le_bytes());
            }
        }
        let payload_crc = crc32c::crc32c(&bytes[payload_at..payload_at + payload]);
        let record_crc = crate::checksum::crc32c_combine(crc32c::crc32c(&bytes[at..at + 24]), payload_crc, payload);
        bytes[at + 24..at + 28].copy_from_slice(&record_crc.to_le_bytes());
        if is_end {
            break;
        }
        crc = crate::checksum::crc32c_combine(crc32c::crc32c_append(crc, &bytes[at..payload_at]), payload_crc, payload);
        records += 1;
        if bytes[at] == RecordKind::Write as u8 {
            data_bytes = data_bytes.wrapping_add(crate::bytes::u64_at(&bytes, at + 16)?);
        }
        at = payload_at + payload;
    }
    Some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::stream::{end_payload, RecordHeader, StreamKind};

    /// A whole stream of `header` (its length filled in) and `records`:
    /// (kind, volume offset, length, the WRITE payload's byte).
    pub(crate) fn stream_of(mut header: Header, records: &[(RecordKind, u64, u64, u8)]) -> Vec<u8> {
        let planned: Vec<_> = records.iter().map(|r| (r.0, r.1, r.2)).collect();
        header.stream_bytes = stream::stream_bytes(header.encode().len(), &planned);
        let mut out = header.encode();
        let mut data = 0;
        for &(kind, offset, length, byte) in records {
            let payload = if kind == RecordKind::Write {
                vec![byte; length as usize]
            } else {
                Vec::new()
            };
            data += payload.len() as u64;
            out.extend_from_slice(&RecordHeader::encode(kind, offset, length, &payload));
            out.extend_from_slice(&payload);
        }
        let end = end_payload(crc32c::crc32c(&out));
        out.extend_from_slice(&RecordHeader::encode(RecordKind::End, records.len() as u64, data, &end));
        out.extend_from_slice(&end);
        out
    }

    fn header(kind: StreamKind) -> Header {
        Header {
            kind,
            resume_offset: None,
            volsize: 64 << 10,
            volblocksize: 4 << 10,
            guid: 0x5eed,
            base_guid: if kind == StreamKind::Full { 0 } else { 0xba5e },
            created_unix: 1_795_597_200,
            stream_bytes: 0,
            pool_uuid: "0a1b2c3d-0000-4000-8000-00000000f00d".into(),
            volume: "default/db".into(),
            snapshot: if kind == StreamKind::Full { "mon" } else { "tue" }.into(),
            base: if kind == StreamKind::Full { "" } else { "mon" }.into(),
        }
    }

    /// The seeds: valid full and incremental streams, a continuation, and
    /// each way a stream is refused (cut, a flipped bit, records out of
    /// order or out of the volume, END that does not add up).
    fn seeds() -> Vec<(&'static str, Vec<u8>)> {
        use RecordKind::{Hole, Write};
        let full = stream_of(
            header(StreamKind::Full),
            &[(Write, 0, 8 << 10, 0xa1), (Write, 16 << 10, 4 << 10, 0xa2)],
        );
        let incremental = stream_of(
            header(StreamKind::Incremental),
            &[
                (Write, 4 << 10, 4 << 10, 0xb1),
                (Hole, 16 << 10, 8 << 10, 0),
                (Write, 60 << 10, 4 << 10, 0xb2),
            ],
        );
        let header_bytes = Header::length(&incremental).unwrap();
        // The rest of `incremental` from its second record, as `send -t` makes it.
        let second = header_bytes + RECORD_HEADER_BYTES + (4 << 10);
        let mut continued = Header::decode(&incremental).unwrap();
        continued.resume_offset = Some(second as u64);
        let mut continuation = continued.encode();
        continuation.extend_from_slice(&incremental[second..]);
        let mut flipped = full.clone();
        flipped[header_bytes + RECORD_HEADER_BYTES + 100] ^= 0x10;
        let out_of_order = stream_of(
            header(StreamKind::Incremental),
            &[(Write, 16 << 10, 4 << 10, 1), (Write, 0, 4 << 10, 2)],
        );
        let outside = stream_of(header(StreamKind::Full), &[(Write, 60 << 10, 8 << 10, 3)]);
        let unaligned = stream_of(header(StreamKind::Full), &[(Write, 1 << 10, 4 << 10, 4)]);
        // END counting three records where two came (its own CRC right).
        let mut bad_end = full[..full.len() - RECORD_HEADER_BYTES - 8].to_vec();
        let end = end_payload(crc32c::crc32c(&bad_end));
        bad_end.extend_from_slice(&RecordHeader::encode(RecordKind::End, 3, 12 << 10, &end));
        bad_end.extend_from_slice(&end);
        vec![
            ("full", full.clone()),
            ("incremental", incremental.clone()),
            ("continuation", continuation),
            ("truncated-in-data", full[..full.len() / 2].to_vec()),
            ("truncated-before-end", full[..full.len() - 40].to_vec()),
            ("truncated-header", incremental[..header_bytes - 3].to_vec()),
            ("flipped-data-bit", flipped),
            ("records-out-of-order", out_of_order),
            ("record-outside-the-volume", outside),
            ("record-not-block-aligned", unaligned),
            ("end-counts-wrong", bad_end),
            ("empty", Vec::new()),
        ]
    }

    /// Replays the regression seeds of the target.
    #[test]
    fn corpus_seeds_do_not_panic() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus-seeds/send_stream");
        let mut replayed = 0;
        for entry in std::fs::read_dir(root).unwrap() {
            stream_input(&std::fs::read(entry.unwrap().path()).unwrap());
            replayed += 1;
        }
        assert!(replayed >= 12, "only {replayed} seeds found");
    }

    /// The seed files are what today's encoders produce (so they keep
    /// reaching the parser's real work); `STRATA_WRITE_SEEDS=1` rewrites
    /// them after a format change.
    #[test]
    fn seeds_match_the_encoders() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus-seeds/send_stream");
        let rewrite = std::env::var_os("STRATA_WRITE_SEEDS").is_some();
        for (name, bytes) in seeds() {
            let path = root.join(name);
            if rewrite {
                std::fs::create_dir_all(&root).unwrap();
                std::fs::write(&path, &bytes).unwrap();
            }
            let stored = std::fs::read(&path).unwrap_or_default();
            assert!(
                stored == bytes,
                "{} differs from the encoders' output: run with STRATA_WRITE_SEEDS=1",
                path.display()
            );
        }
    }

    /// Each seed is accepted or refused as its name says, for the reason
    /// it says: the seeds keep the parser's every check covered.
    #[test]
    fn seeds_are_accepted_or_refused_as_named() {
        use crate::control::stream::StreamError;
        for (name, bytes) in seeds() {
            let parsed = stream::parse(&bytes, None);
            let reason = match &parsed {
                Ok(_) => String::new(),
                Err(StreamError::Truncated(why)) => format!("truncated: {why}"),
                Err(e) => e.to_string(),
            };
            let expected = match name {
                "full" | "incremental" => "",
                "continuation" => "a continuation from byte",
                "truncated-in-data" | "truncated-before-end" => "truncated: it ended",
                "truncated-header" => "truncated:",
                "flipped-data-bit" => "record checksum mismatch",
                "records-out-of-order" => "out of order",
                "record-outside-the-volume" | "record-not-block-aligned" => "does not fit",
                "end-counts-wrong" => "END says",
                "empty" => "truncated:",
                other => panic!("a seed without an expectation: {other}"),
            };
            assert!(
                if expected.is_empty() {
                    parsed.is_ok()
                } else {
                    reason.contains(expected)
                },
                "{name}: {reason}"
            );
        }
        // Valid streams parse to what was encoded, and the continuation
        // goes on from the position its receive stopped at.
        let seeds = seeds();
        let incremental = &seeds[1].1;
        let whole = stream::parse(incremental, None).unwrap();
        assert_eq!(whole.records.len(), 3);
        assert_eq!(whole.end.data_bytes, 8 << 10);
        assert_eq!(whole.consumed, incremental.len());
        let header_bytes = Header::length(incremental).unwrap();
        let mut stopped = Position::after_header(&incremental[..header_bytes]);
        let first = crate::bytes::array_at::<RECORD_HEADER_BYTES>(incremental, header_bytes).unwrap();
        let payload = &incremental[header_bytes + RECORD_HEADER_BYTES..header_bytes + RECORD_HEADER_BYTES + (4 << 10)];
        stopped
            .accept(
                &whole.header,
                &first,
                &RecordHeader::decode(&first).unwrap(),
                payload,
                crc32c::crc32c(payload),
            )
            .unwrap();
        let rest = stream::parse(&seeds[2].1, Some(stopped)).unwrap();
        assert_eq!(rest.end, whole.end);
        assert_eq!(rest.records, whole.records[1..]);
    }

    /// A fixed-up corrupted seed is a valid stream again: the fix-up
    /// reaches past the checksums as the fuzzer relies on.
    #[test]
    fn fix_up_makes_checksums_and_counts_right() {
        for (name, bytes) in seeds() {
            if ["full", "incremental", "flipped-data-bit", "end-counts-wrong"].contains(&name) {
                let fixed = fix_up(&bytes).unwrap();
                assert!(stream::parse(&fixed, None).is_ok(), "{name}");
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// Random inputs, and random damage to a valid stream (the same
        /// checks as the fuzz target, on stable).
        #[test]
        fn random_inputs_never_panic(
            data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..3000),
            at in 0usize..1 << 16,
            byte in proptest::prelude::any::<u8>(),
            cut in 0usize..1 << 16,
        ) {
            stream_input(&data);
            let mut damaged = seeds()[1].1.clone();
            let len = damaged.len();
            damaged[at % len] = byte;
            damaged.truncate(len - cut % 64);
            stream_input(&damaged);
        }
    }
}
