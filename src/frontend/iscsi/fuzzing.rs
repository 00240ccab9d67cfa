//! Fuzz entry points for the iSCSI parsers, shared by the `cargo fuzz`
//! targets in `fuzz/fuzz_targets/iscsi_*.rs` and by the regression test that
//! replays `fuzz/corpus-seeds/iscsi_*` (inputs modelled on known CVEs of
//! other targets: oversized CHAP_R/CHAP_C, very long keys, huge data segment
//! lengths, login PDU variants, malformed CDBs).

use std::sync::Arc;

use super::login::{Directory, Login, Next, SessionType};
use super::pdu::{self, Bhs, Framing, BHS_BYTES};
use super::text::{self, Params};
use crate::device::sim::SimDevice;
use crate::pool::superblock::Role;
use crate::pool::{NewDevice, Pool};
use crate::scsi::cdb::{self, Command, Transfer};
use crate::scsi::lu::{LogicalUnit, Nexus, Outcome};
use crate::scsi::opcodes;
use crate::scsi::pages::BLOCK_BYTES;
use crate::scsi::sense::status;
use crate::volume::props::{IscsiAccess, IscsiAuthMode, LogBias, SyncMode, VolumeProps};
use crate::volume::ServedVolume;

/// The byte every "random" challenge byte is, so seeds can carry a valid
/// CHAP answer and reach the stages behind authentication.
pub const FUZZ_RANDOM_BYTE: u8 = 0x5a;
/// The CHAP user, secret and mutual credentials of the fuzz targets.
pub const FUZZ_CHAP_USER: &str = "fuzzer";
pub const FUZZ_CHAP_SECRET: &str = "fuzz-secret-12";
pub const FUZZ_MUTUAL_USER: &str = "target";
pub const FUZZ_MUTUAL_SECRET: &str = "fuzz-target-secret";

/// Every `iqn.*` name is a target; `…:chap` needs CHAP, `…:mutual` mutual
/// CHAP, `…:acl` admits only `iqn.fuzz:allowed`; anything else needs nothing.
pub struct FuzzDirectory;

impl Directory for FuzzDirectory {
    fn target(&self, name: &str) -> Result<Option<IscsiAccess>, String> {
        if !name.starts_with("iqn.") {
            return Ok(None);
        }
        let auth = if name.ends_with(":chap") {
            IscsiAuthMode::Chap
        } else if name.ends_with(":mutual") {
            IscsiAuthMode::Mutual
        } else {
            IscsiAuthMode::None
        };
        Ok(Some(IscsiAccess {
            auth,
            chap_user: Some(FUZZ_CHAP_USER.into()),
            chap_secret: Some(FUZZ_CHAP_SECRET.into()),
            mutual_user: Some(FUZZ_MUTUAL_USER.into()),
            mutual_secret: Some(FUZZ_MUTUAL_SECRET.into()),
            initiators: name.ends_with(":acl").then(|| vec!["iqn.fuzz:allowed".to_string()]),
        }))
    }

    fn random(&self, buf: &mut [u8]) -> std::io::Result<()> {
        buf.fill(FUZZ_RANDOM_BYTE);
        Ok(())
    }
}

/// PDU framing with and without digests: whatever decodes respects the data
/// segment bound and survives a re-encode.
pub fn pdu_input(data: &[u8]) {
    for framing in [
        Framing::LOGIN,
        Framing {
            header_digest: true,
            data_digest: true,
            max_data_segment: 256 * 1024,
        },
    ] {
        let mut rest = data;
        while let Ok((decoded, used)) = pdu::decode(rest, &framing) {
            assert!(decoded.data.len() <= framing.max_data_segment as usize);
            assert!(used >= BHS_BYTES && used <= rest.len());
            if decoded.ahs.is_empty() {
                let bytes = pdu::encode(&decoded.bhs, &decoded.data, framing.header_digest, framing.data_digest);
                let (again, _) = pdu::decode(&bytes, &framing).expect("round trip");
                assert_eq!(again.data, decoded.data);
            }
            rest = &rest[used..];
        }
    }
}

/// The text-key parser, negotiation, and the login state machine fed a
/// sequence of requests, each `[48-byte header][u16 big-endian length][text]`.
/// A failed step ends the login with an empty reply; a normal session to a
/// target that needs CHAP never completes without a CHAP_R having been sent.
pub fn login_input(data: &[u8]) {
    if let Ok(pairs) = text::parse(data) {
        let mut params = Params::default();
        for (key, value) in &pairs {
            let _ = text::negotiate(key, value, &mut params, false);
        }
        assert!(params.first_burst <= params.max_burst.max(512));
    }
    let mut login = Login::new(128);
    let mut rest = data;
    let mut tsih = 0u16;
    let mut sent_chap_response = false;
    while rest.len() >= BHS_BYTES + 2 {
        let mut header = [0u8; BHS_BYTES];
        header.copy_from_slice(&rest[..BHS_BYTES]);
        let len = (rest[BHS_BYTES] as usize) << 8 | rest[BHS_BYTES + 1] as usize;
        let body_start = BHS_BYTES + 2;
        let body_end = (body_start + len).min(rest.len());
        let body = &rest[body_start..body_end];
        sent_chap_response |= body.windows(7).any(|w| w == b"CHAP_R=");
        let (response, reply, next) = login.step(&Bhs(header), body, &FuzzDirectory, &mut || {
            tsih = tsih.wrapping_add(1);
            tsih
        });
        assert_eq!(response.opcode(), pdu::op::LOGIN_RESPONSE);
        assert!(reply.len() <= text::MAX_TEXT_BYTES);
        match next {
            Next::Fail => {
                assert_ne!(response.0[36], 0, "a failed login carries a failure status");
                assert!(reply.is_empty(), "a failed login echoes nothing");
                return;
            }
            Next::Complete(negotiated) => {
                let needs_chap = negotiated
                    .target_name
                    .as_deref()
                    .is_some_and(|t| t.ends_with(":chap") || t.ends_with(":mutual"));
                if negotiated.session_type == SessionType::Normal && needs_chap {
                    assert!(sent_chap_response, "a CHAP target admitted a login without CHAP");
                }
                return;
            }
            Next::Continue => {}
        }
        rest = &rest[body_end..];
    }
}

/// The CDB decoder and the REPORT SUPPORTED OPERATION CODES builder it drives.
pub fn cdb_input(data: &[u8]) {
    if let Ok(command) = cdb::decode(data) {
        match command.transfer(512) {
            Transfer::Out(bytes) | Transfer::In(bytes) => assert!(bytes <= 2 * u32::MAX as u64 * 512),
            Transfer::None => {}
        }
        if let Command::ReportSupportedOpcodes {
            rctd,
            options,
            opcode,
            service_action,
            ..
        } = command
        {
            let _ = opcodes::report(rctd, options, opcode, service_action);
        }
    }
}

/// Bytes of the volume behind [`scsi_input`]'s logical unit.
pub const FUZZ_VOLUME_BYTES: u64 = 8 << 20;
/// Commands one [`scsi_input`] runs at most.
const FUZZ_COMMANDS: usize = 64;

/// A logical unit on a volume of a fresh pool on a simulated (in-memory)
/// device, and the nexus that uses it.
async fn fuzz_unit() -> (Arc<Pool>, LogicalUnit, Nexus) {
    let sim = SimDevice::new(256 << 20, 1);
    let devices = vec![NewDevice {
        device: sim.as_device(),
        role: Role::Fast,
    }];
    let pool = Pool::create("fuzz", 1 << 20, devices).await.expect("a pool");
    let engine = pool.open_volume(1, FUZZ_VOLUME_BYTES, 4096).expect("a volume");
    let props = VolumeProps {
        volsize: FUZZ_VOLUME_BYTES,
        volblocksize: 4096,
        sync: SyncMode::Standard,
        logbias: LogBias::Latency,
        wce: true,
    };
    let volume = Arc::new(ServedVolume::new("fuzz", "lu", engine, &props));
    let unit = LogicalUnit::new(volume, None, "iqn.fuzz:lu");
    let nexus: Nexus = "iqn.fuzz:initiator,i,0x1".into();
    unit.attach(&nexus);
    (pool, unit, nexus)
}

/// Whole SCSI commands against a logical unit on an in-memory volume, as
/// the connection runs them once their data is in: a sequence of
/// `[CDB length - 1 (low 4 bits)][data-out length: u16 big-endian][CDB][data-out]`.
/// Each decoded command is counted as analytics count it, its data-out
/// fitted as the connection fits it (refused where the connection
/// refuses), then executed. Nothing may panic; every answer is a SCSI
/// status with sense exactly when it is CHECK CONDITION, and a read that
/// succeeds returns what its CDB asked for.
pub fn scsi_input(data: &[u8]) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let (_pool, unit, nexus) = fuzz_unit().await;
        let (unit, nexus) = (&unit, &nexus);
        let mut rest = data;
        for _ in 0..FUZZ_COMMANDS {
            if rest.len() < 3 {
                break;
            }
            let cdb_len = (rest[0] & 0x0f) as usize + 1;
            let out_len = u16::from_be_bytes([rest[1], rest[2]]) as usize;
            rest = &rest[3..];
            let mut cdb_bytes = [0u8; 16];
            let take = cdb_len.min(rest.len());
            cdb_bytes[..take].copy_from_slice(&rest[..take]);
            rest = &rest[take..];
            let take = out_len.min(rest.len());
            let data_out = rest[..take].to_vec();
            rest = &rest[take..];
            let Ok(command) = cdb::decode(&cdb_bytes) else {
                continue;
            };
            if let (Some((_, offset, _)), Some(lba)) = (super::connection::analytics_op(&command), lba_of(&command)) {
                // The LBA's byte offset when it fits, else none: never a wrap.
                let expected = lba
                    .checked_mul(BLOCK_BYTES as u64)
                    .unwrap_or(crate::analytics::record::NO_OFFSET);
                assert_eq!(offset, expected, "{command:?}");
            }
            let outcome = match command.transfer(BLOCK_BYTES) {
                Transfer::Out(spdtl) if spdtl > 0 || !data_out.is_empty() => {
                    let edtl = data_out.len() as u64;
                    let partial_allowed = matches!(command, Command::Write { .. } | Command::WriteAndVerify { .. });
                    if spdtl > super::connection::MAX_DATA_OUT_BYTES || (spdtl != edtl && !partial_allowed) {
                        continue;
                    }
                    if spdtl == edtl {
                        unit.execute(nexus, &command, data_out).await
                    } else {
                        match unit.fit_write_data(&command, data_out, spdtl as usize).await {
                            Ok(data_out) => unit.execute(nexus, &command, data_out).await,
                            Err(sense) => Outcome::check(sense),
                        }
                    }
                }
                _ => unit.execute(nexus, &command, Vec::new()).await,
            };
            check_outcome(&command, &outcome);
        }
    });
}

/// The first block a command addresses, for those that address one.
fn lba_of(command: &Command) -> Option<u64> {
    match *command {
        Command::Read { lba, .. }
        | Command::Write { lba, .. }
        | Command::WriteAndVerify { lba, .. }
        | Command::CompareAndWrite { lba, .. }
        | Command::WriteSame { lba, .. }
        | Command::SynchronizeCache { lba, .. }
        | Command::Prefetch { lba, .. }
        | Command::GetLbaStatus { lba, .. } => Some(lba),
        _ => None,
    }
}

/// What every answer of the logical unit keeps.
fn check_outcome(command: &Command, outcome: &Outcome) {
    assert_eq!(
        outcome.sense.is_some(),
        outcome.status == status::CHECK_CONDITION,
        "{command:?}: {outcome:?}"
    );
    if outcome.status == status::GOOD {
        if let Command::Read { blocks, .. } = *command {
            assert_eq!(
                outcome.data.len(),
                blocks as usize * BLOCK_BYTES as usize,
                "{command:?}"
            );
        }
        match *command {
            Command::Read { lba, blocks, .. }
            | Command::Write { lba, blocks, .. }
            | Command::WriteSame { lba, blocks, .. }
            | Command::Prefetch { lba, blocks } => {
                assert!(
                    lba.checked_add(blocks as u64)
                        .is_some_and(|end| end <= FUZZ_VOLUME_BYTES / BLOCK_BYTES as u64),
                    "{command:?} succeeded beyond the end of the volume"
                );
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::iscsi::chap;

    fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus-seeds")
            .join(target);
        let mut all: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| {
                let path = entry.unwrap().path();
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&path).unwrap())
            })
            .collect();
        all.sort();
        all
    }

    /// Replays the regression seeds through the fuzz entry points.
    #[test]
    fn corpus_seeds_do_not_panic() {
        let mut replayed = 0;
        for (target, run, at_least) in [
            ("iscsi_pdu", pdu_input as fn(&[u8]), 4),
            ("iscsi_login", login_input, 8),
            ("iscsi_cdb", cdb_input, 6),
            ("scsi_command", scsi_input, 6),
        ] {
            let found = seeds(target);
            assert!(found.len() >= at_least, "{target}: only {} seeds", found.len());
            for (_, bytes) in &found {
                run(bytes);
                replayed += 1;
            }
        }
        assert!(replayed >= 24, "only {replayed} seeds replayed");
    }

    fn login_steps(seed: &[u8]) -> Vec<(u16, Next)> {
        let mut login = Login::new(128);
        let mut rest = seed;
        let mut out = Vec::new();
        while rest.len() >= BHS_BYTES + 2 {
            let mut header = [0u8; BHS_BYTES];
            header.copy_from_slice(&rest[..BHS_BYTES]);
            let len = (rest[BHS_BYTES] as usize) << 8 | rest[BHS_BYTES + 1] as usize;
            let end = (BHS_BYTES + 2 + len).min(rest.len());
            let (response, _, next) = login.step(&Bhs(header), &rest[BHS_BYTES + 2..end], &FuzzDirectory, &mut || 1);
            let failed = next == Next::Fail;
            out.push((u16::from_be_bytes([response.0[36], response.0[37]]), next));
            if failed {
                break;
            }
            rest = &rest[end..];
        }
        out
    }

    /// The login seeds end the way their names say: `ok-…` completes the
    /// login, `fail-XXXX-…` ends it with status 0xXXXX.
    #[test]
    fn login_seeds_end_as_named() {
        let mut checked = 0;
        for (name, bytes) in seeds("iscsi_login") {
            let steps = login_steps(&bytes);
            let (status, next) = steps.last().unwrap_or_else(|| panic!("{name}: no step"));
            if name.starts_with("ok-") {
                assert!(matches!(next, Next::Complete(_)), "{name}: {steps:?}");
            } else {
                let expected = name
                    .strip_prefix("fail-")
                    .and_then(|rest| u16::from_str_radix(rest.get(..4)?, 16).ok())
                    .unwrap_or_else(|| panic!("seed {name} names no outcome (ok-… or fail-XXXX-…)"));
                assert_eq!((*status, next), (expected, &Next::Fail), "{name}: {steps:?}");
            }
            checked += 1;
        }
        assert!(checked >= 8);
    }

    /// The fixed challenge the seeds were built against is what the login
    /// machine sends with [`FuzzDirectory`].
    #[test]
    fn fuzz_directory_challenge_is_fixed() {
        let answer = chap::response(FUZZ_RANDOM_BYTE, FUZZ_CHAP_SECRET.as_bytes(), &[FUZZ_RANDOM_BYTE; 16]);
        assert_eq!(answer.len(), 16);
        let mut buf = [0u8; 17];
        FuzzDirectory.random(&mut buf).unwrap();
        assert_eq!(buf, [FUZZ_RANDOM_BYTE; 17]);
    }
}
