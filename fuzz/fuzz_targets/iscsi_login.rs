//! Fuzzes the login text-key parser, key negotiation and the login state
//! machine fed with arbitrary login request PDUs.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::frontend::iscsi::login::{Directory, Login};
use strata::frontend::iscsi::pdu::{Bhs, BHS_BYTES};
use strata::frontend::iscsi::text::{self, Params};

struct AnyTarget;

impl Directory for AnyTarget {
    fn target_exists(&self, name: &str) -> bool {
        name.starts_with("iqn.")
    }
    fn initiator_allowed(&self, _: &str, initiator: &str) -> bool {
        !initiator.ends_with("denied")
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(pairs) = text::parse(data) {
        let mut params = Params::default();
        for (key, value) in &pairs {
            let _ = text::negotiate(key, value, &mut params, false);
        }
        assert!(params.first_burst <= params.max_burst.max(512));
    }
    // Feed the state machine a sequence of (header, text) requests.
    let mut login = Login::new(128);
    let mut rest = data;
    let mut tsih = 0u16;
    while rest.len() >= BHS_BYTES + 2 {
        let mut header = [0u8; BHS_BYTES];
        header.copy_from_slice(&rest[..BHS_BYTES]);
        let len = (rest[BHS_BYTES] as usize) << 8 | rest[BHS_BYTES + 1] as usize;
        let body_start = BHS_BYTES + 2;
        let body_end = (body_start + len).min(rest.len());
        let (response, reply, _) = login.step(&Bhs(header), &rest[body_start..body_end], &AnyTarget, &mut || {
            tsih += 1;
            tsih
        });
        assert_eq!(response.opcode(), 0x23);
        assert!(reply.len() <= text::MAX_TEXT_BYTES);
        rest = &rest[body_end..];
    }
});
