//! Fuzzes iSCSI PDU framing: header/data-segment layout, digests, padding.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::frontend::iscsi::pdu::{self, Framing};

fuzz_target!(|data: &[u8]| {
    for framing in [
        Framing::LOGIN,
        Framing {
            header_digest: true,
            data_digest: true,
            max_data_segment: 256 * 1024,
        },
    ] {
        let mut rest = data;
        while let Ok((pdu, used)) = pdu::decode(rest, &framing) {
            assert!(pdu.data.len() <= framing.max_data_segment as usize);
            assert!(used >= pdu::BHS_BYTES && used <= rest.len());
            // Re-encoding what we decoded must decode to the same PDU.
            if pdu.ahs.is_empty() {
                let bytes = pdu::encode(&pdu.bhs, &pdu.data, framing.header_digest, framing.data_digest);
                let (again, _) = pdu::decode(&bytes, &framing).expect("round trip");
                assert_eq!(again.data, pdu.data);
            }
            rest = &rest[used..];
        }
    }
});
