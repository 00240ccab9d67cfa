//! The fast paths `strata serve` can turn off, each run on both sides with
//! real clients: mapped I/O of file devices (`--mapped-io on|reads|off`),
//! the NBD idle poll (`--nbd-poll-us`, 0 and not), the NBD send buffer
//! (`--nbd-send-buffer`, 0 and not) and the CRC-32C backend (`--crc`).
//! One data directory is served by each setting in turn: what one wrote,
//! the next reads back, so a checksum stored by one backend is verified by
//! the other and data written past a mapping is read through one.

mod common;

use common::{pseudo_random, qemu_io_ok, require_tool, run, small_default_pool, Server};
use std::path::Path;
use std::process::Command;

/// Bytes each setting copies onto a volume of that size with nbdcopy
/// (several connections, many requests in flight), after reading back what
/// the setting before it copied there.
const COPY_BYTES: usize = 24 << 20;

/// One run of the daemon: its flags and what its log must say of them.
struct Setting {
    flags: &'static [&'static str],
    says: &'static [&'static str],
}

const SETTINGS: [Setting; 3] = [
    Setting {
        flags: &[
            "--mapped-io",
            "off",
            "--nbd-poll-us",
            "0",
            "--nbd-send-buffer",
            "0",
            "--crc",
            "crc32c",
        ],
        says: &["crc32c: crc32c; sectors: crc32c", "mapped I/O off"],
    },
    Setting {
        flags: &[
            "--mapped-io",
            "on",
            "--nbd-poll-us",
            "30",
            "--nbd-send-buffer",
            "512K",
            "--crc",
            "crc-fast",
        ],
        says: &["crc32c: crc-fast; sectors: crc-fast", "mapped I/O on"],
    },
    // The defaults, but for writes past the mapping.
    Setting {
        flags: &["--mapped-io", "reads"],
        says: &["mapped I/O reads"],
    },
];

/// The qemu-io commands that write setting `index`'s patterns (a 4 KiB
/// block, a 64 KiB and a 1 MiB request) or, with `verb` "read", check them.
fn patterns(index: usize, verb: &str) -> Vec<String> {
    let base = (index as u64) << 24;
    [(0u64, "4k"), (1 << 20, "64k"), (2 << 20, "1M")]
        .iter()
        .enumerate()
        .map(|(n, (offset, len))| format!("{verb} -P {} {} {len}", 0x31 + index * 8 + n, base + offset))
        .collect()
}

/// What setting `index` copies onto the volume.
fn copied(index: usize) -> Vec<u8> {
    pseudo_random(index as u64 + 7, COPY_BYTES)
}

/// Reads the volume `default/copy` with nbdcopy.
fn copy_out(server: &Server, dir: &Path) -> Vec<u8> {
    let out = dir.join("out.img");
    let _ = std::fs::remove_file(&out);
    run(Command::new("nbdcopy").arg(server.uri("default/copy")).arg(&out));
    std::fs::read(&out).unwrap()
}

#[test]
fn each_fast_path_reads_back_what_the_other_side_wrote() {
    require_tool("qemu-io");
    require_tool("nbdcopy");
    let dir = tempfile::tempdir().unwrap();
    small_default_pool(dir.path());
    for (index, setting) in SETTINGS.iter().enumerate() {
        let log = dir.path().join(format!("daemon-{index}.log"));
        let mut server = Server::start_logged(dir.path(), Some(dir.path()), setting.flags, Some(&log));
        let said = std::fs::read_to_string(&log).unwrap();
        for words in setting.says {
            assert!(
                said.contains(words),
                "setting {index} ({:?}): no {words:?} in\n{said}",
                setting.flags
            );
        }
        if index == 0 {
            server.create_volume("default/copy", &format!("{}M", COPY_BYTES >> 20));
        } else {
            assert!(
                copy_out(&server, dir.path()) == copied(index - 1),
                "setting {index}: the bytes setting {} copied differ",
                index - 1
            );
        }
        let source = dir.path().join("in.img");
        std::fs::write(&source, copied(index)).unwrap();
        run(Command::new("nbdcopy")
            .arg("--flush")
            .arg(&source)
            .arg(server.uri("default/copy")));
        assert!(
            copy_out(&server, dir.path()) == copied(index),
            "setting {index}: its own copy differs"
        );
        // What every earlier setting wrote reads back, and its own writes do.
        let uri = server.uri("default/vol0");
        qemu_io_ok(&uri, &patterns(index, "write"));
        for earlier in 0..=index {
            qemu_io_ok(&uri, &patterns(earlier, "read"));
        }
        // One request at a time, many: the idle poll's case (or its absence).
        let one_by_one: Vec<String> = (0..200).map(|_| patterns(index, "read")[0].clone()).collect();
        qemu_io_ok(&uri, &one_by_one);
        assert!(server.stop().success(), "setting {index}: stopped cleanly");
    }
}

#[test]
fn bad_values_are_refused_before_anything_listens() {
    let dir = tempfile::tempdir().unwrap();
    for (flag, value, says) in [
        ("--mapped-io", "sometimes", "not on, reads or off"),
        ("--crc", "crc32", "not auto, crc-fast or crc32c"),
        ("--nbd-poll-us", "lots", "--nbd-poll-us"),
        ("--nbd-send-buffer", "4G", "at most"),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["serve", "--data-dir"])
            .arg(dir.path().join("never"))
            .args([flag, value])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{flag} {value} was taken");
        assert!(stderr.contains(says), "{flag} {value}: {stderr}");
        assert!(
            !dir.path().join("never").exists(),
            "{flag} {value}: made the data directory"
        );
    }
}
