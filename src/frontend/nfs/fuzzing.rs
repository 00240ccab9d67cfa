//! Fuzz entry point for the NFS server's decoders, shared by the `cargo
//! fuzz` target in `fuzz/` and by the regression test that replays
//! `fuzz/corpus-seeds/nfs_rpc/`. Nothing here needs a file system: the
//! decoders turn bytes into typed calls, which is where hostile input is
//! handled.

use super::mount::{self, MountCall};
use super::nfs3::{self, NfsCall, MAX_FH, MAX_IO};
use super::portmap;
use super::rpc::{self, Auth, MAX_AUTH_GIDS, MAX_RECORD};
use super::server;

/// Record marking, the call header and credentials, routing, and every
/// procedure's argument decoder over the call's arguments: none may panic,
/// and whatever decodes respects the bounds.
pub fn rpc_input(data: &[u8]) {
    // The bytes as a stream of marked fragments.
    if let Ok(Some((record, used))) = rpc::split_record(data) {
        assert!(record.len() <= MAX_RECORD);
        assert!(used <= data.len() && used >= record.len() + 4);
        call_input(&record);
    }
    // The bytes as one record, so the call decoders see them unmarked too.
    call_input(&data[..data.len().min(MAX_RECORD)]);
    let _ = rpc::AuthSys::decode(data);
}

fn call_input(record: &[u8]) {
    let call = match rpc::parse_call(record) {
        Ok(call) => call,
        Err(e) => {
            let _ = e.reply();
            return;
        }
    };
    if let Auth::Sys(sys) = &call.auth {
        assert!(sys.gids.len() <= MAX_AUTH_GIDS);
    }
    assert!(call.args.len() <= record.len());
    let _ = server::route(&call);
    for procedure in 0..=nfs3::procedure::COMMIT + 1 {
        if let Ok(decoded) = nfs3::decode(procedure, call.args) {
            check_nfs(&decoded);
        }
    }
    for procedure in 0..=mount::procedure::EXPORT + 1 {
        if let Ok(MountCall::Mnt { path } | MountCall::Umnt { path }) = mount::decode(procedure, call.args) {
            assert!(path.len() <= mount::MAX_PATH);
        }
    }
    for procedure in 0..=5 {
        let _ = portmap::decode(procedure, call.args);
    }
}

/// The bounds a decoded NFS call keeps.
fn check_nfs(call: &NfsCall<'_>) {
    let handle = |fh: &[u8]| assert!(fh.len() <= MAX_FH);
    match call {
        NfsCall::Write { fh, data, .. } => {
            handle(fh);
            assert!(data.len() <= MAX_IO as usize);
        }
        NfsCall::Rename { from, to } => {
            handle(from.dir);
            handle(to.dir);
        }
        NfsCall::Lookup(at) | NfsCall::Remove(at) | NfsCall::Rmdir(at) => handle(at.dir),
        NfsCall::Create { at, .. } | NfsCall::Mkdir { at, .. } | NfsCall::Mknod { at, .. } => handle(at.dir),
        NfsCall::Symlink { at, target, .. } => {
            handle(at.dir);
            assert!(target.len() <= rpc::MAX_RECORD);
        }
        NfsCall::Link { fh, at } => {
            handle(fh);
            handle(at.dir);
        }
        _ => {}
    }
    let _ = call.reply_capacity();
}

#[cfg(test)]
mod tests {
    fn seeds() -> Vec<Vec<u8>> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus-seeds/nfs_rpc");
        std::fs::read_dir(root)
            .unwrap()
            .map(|entry| std::fs::read(entry.unwrap().path()).unwrap())
            .collect()
    }

    /// Replays the regression seeds.
    #[test]
    fn corpus_seeds_do_not_panic() {
        let seeds = seeds();
        for seed in &seeds {
            super::rpc_input(seed);
        }
        assert!(seeds.len() >= 8, "only {} seeds found", seeds.len());
    }

    /// Every prefix of each seed, and each of its first bytes flipped: a
    /// cheap stand-in for a fuzzing run, in every test run.
    #[test]
    fn mutated_seeds_do_not_panic() {
        for seed in seeds() {
            for len in 0..=seed.len().min(512) {
                super::rpc_input(&seed[..len]);
            }
            for at in 0..seed.len().min(256) {
                for flip in [0x01, 0x80, 0xff] {
                    let mut mutated = seed.clone();
                    mutated[at] ^= flip;
                    super::rpc_input(&mutated);
                }
            }
        }
    }
}
