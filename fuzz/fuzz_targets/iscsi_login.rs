//! Fuzzes the login text-key parser, key negotiation and the login state
//! machine (CHAP included) fed with sequences of login requests.
//! The body lives in `strata::frontend::iscsi::fuzzing`, where a unit test
//! replays `fuzz/corpus-seeds/iscsi_login/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    strata::frontend::iscsi::fuzzing::login_input(data);
});
