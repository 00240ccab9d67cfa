//! Fuzz entry points for the NBD parsers, shared by the `cargo fuzz` targets
//! in `fuzz/` and by the regression test that replays `fuzz/corpus-seeds/`.

use super::proto::{self, ClientOption, Negotiated};

/// Client flags, option headers, every option payload and the meta-context
/// matcher: none may panic, and a parsed option respects the string bounds.
pub fn option_input(data: &[u8]) {
    if data.len() < 4 {
        return;
    }
    let _ = proto::parse_client_flags([data[0], data[1], data[2], data[3]]);
    if data.len() >= proto::OPTION_HEADER_BYTES {
        let mut header = [0u8; proto::OPTION_HEADER_BYTES];
        header.copy_from_slice(&data[..proto::OPTION_HEADER_BYTES]);
        let _ = proto::parse_option_header(&header);
    }
    let option = u32::from(data[0] % 16);
    let payload = &data[1..data.len().min(1 + proto::MAX_OPTION_BYTES as usize)];
    if let Ok(parsed) = proto::parse_option(option, payload) {
        match parsed {
            ClientOption::ExportName(name) => assert!(name.len() <= proto::MAX_STRING_BYTES),
            ClientOption::Info { export, requests } | ClientOption::Go { export, requests } => {
                assert!(export.len() <= proto::MAX_STRING_BYTES);
                assert!(requests.len() <= proto::MAX_QUERIES);
            }
            ClientOption::ListMetaContext { export, queries } | ClientOption::SetMetaContext { export, queries } => {
                assert!(export.len() <= proto::MAX_STRING_BYTES);
                assert!(queries.len() <= proto::MAX_QUERIES);
                let _ = proto::match_meta_contexts(&queries, option == 9, &["a", "b"]);
            }
            _ => {}
        }
    }
}

/// The request parser and its validity check: anything accepted is a known
/// command with a non-zero length (except FLUSH and DISC).
pub fn request_input(data: &[u8]) {
    if data.len() < proto::REQUEST_BYTES + 1 {
        return;
    }
    let mut header = [0u8; proto::REQUEST_BYTES];
    header.copy_from_slice(&data[1..=proto::REQUEST_BYTES]);
    // Half the inputs get a valid magic so the checks behind it are reached.
    if data[0] & 1 == 1 {
        header[0..4].copy_from_slice(&proto::REQUEST_MAGIC.to_be_bytes());
    }
    if let Ok(request) = proto::parse_request(&header) {
        let negotiated = Negotiated {
            structured_replies: data[0] & 2 != 0,
            base_allocation: data[0] & 4 != 0,
            changed: None,
        };
        if proto::check_request(&request, &negotiated).is_ok() {
            // Anything accepted must be a known command with allowed flags.
            assert!(request.kind <= proto::cmd::BLOCK_STATUS);
            assert!(request.length > 0 || request.kind == proto::cmd::FLUSH || request.kind == proto::cmd::DISC);
        }
    }
}

#[cfg(test)]
mod tests {
    /// Replays the regression seeds (inputs that broke other NBD servers).
    #[test]
    fn corpus_seeds_do_not_panic() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus-seeds");
        let mut replayed = 0;
        for (target, run) in [
            ("nbd_option", super::option_input as fn(&[u8])),
            ("nbd_request", super::request_input),
        ] {
            for entry in std::fs::read_dir(root.join(target)).unwrap() {
                run(&std::fs::read(entry.unwrap().path()).unwrap());
                replayed += 1;
            }
        }
        assert!(replayed >= 10, "only {replayed} seeds found");
    }
}
