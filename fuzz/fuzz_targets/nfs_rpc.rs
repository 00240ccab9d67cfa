//! Fuzzes the NFS server's record marking, RPC call header, credentials and
//! every NFS, MOUNT and portmapper argument decoder.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| strata::frontend::nfs::fuzzing::rpc_input(data));
