//! The file system under a pool fills, over iSCSI: the counterpart of
//! `nbd_enospc.rs`'s tmpfs test. Sparse device files on a 160 MiB tmpfs
//! under a 400 MiB pool; the write that needs space fails with DATA
//! PROTECT / SPACE ALLOCATION FAILED WRITE PROTECT, which qemu reports as
//! ENOSPC (never EIO); overwrites keep working; TRIM makes room with no
//! restart; kill -9 loses nothing acknowledged. Before any of that, the low
//! backing space is announced as the thin provisioning soft threshold: a
//! unit attention (ASC 0x38, ASCQ 0x07) for every logged-in initiator, once.

mod common;

use std::net::{SocketAddr, TcpStream};
use std::path::Path;

use common::{cli, cli_ok, fill_pattern as pattern, iscsi, qemu_io, qemu_io_ok, require_tool, Server};

const MIB: u64 = 1 << 20;
const TARGET: &str = "iqn.2026-11.io.strata:tank.big";
/// THIN PROVISIONING SOFT THRESHOLD REACHED, INFORMATION = the offset of
/// the threshold descriptor in the Logical Block Provisioning mode page.
const SOFT_THRESHOLD: (u8, u8, Option<u32>) = (0x38, 0x07, Some(16));

/// Starts the daemon logging to `log` and waits until the destager has
/// seen the file system under `tank` run short (its warning).
fn start(data: &Path, ram: &Path, log: &Path) -> Server {
    let server = Server::start_logged(data, Some(ram), &[], Some(log));
    common::wait_for_log(log, "will fail with ENOSPC");
    server
}

/// The soft threshold's unit attention reaches every initiator logged in
/// when it is established (`first` and `second`), once: a later login gets
/// none. Waits for the daemon's check (every 200 ms) to see it.
fn assert_soft_threshold_announced(address: SocketAddr, mut first: TcpStream, mut second: TcpStream) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    // Each connection's task queues its own: the second may see it a
    // moment after the first.
    for stream in [&mut first, &mut second] {
        loop {
            match iscsi::clear_attentions(stream).as_slice() {
                [] if std::time::Instant::now() < deadline => std::thread::sleep(std::time::Duration::from_millis(100)),
                seen => {
                    assert_eq!(seen, [SOFT_THRESHOLD]);
                    break;
                }
            }
        }
    }
    let mut later = iscsi::login_as(address, TARGET, "iqn.test:later");
    assert_eq!(iscsi::clear_attentions(&mut later), vec![], "once per crossing");
    assert_eq!(iscsi::clear_attentions(&mut first), vec![]);
}

#[test]
fn a_full_file_system_under_the_pool_fails_only_the_writes_that_need_space() {
    require_tool("qemu-io");
    require_tool("iscsi-inq");
    let small = common::SmallFs::mount();
    let (data, ram, log, fast) = (&small.data, &small.ram, &small.log, &small.fast);
    let mut server = Server::start_logged(data, Some(ram), &[], Some(log));
    assert!(cli(&server, &["pool", "create", "tank", "--fast", fast])
        .status
        .success());
    cli_ok(&server, &["volume", "create", "tank/big", "--size", "1G"]);
    common::wait_for_log(log, "will fail with ENOSPC");
    let address: SocketAddr = server.iscsi.parse().unwrap();
    let url = format!("iscsi://{}/{TARGET}/0", server.iscsi);

    // The sparse device may grow by more than its file system holds (the
    // log and `pool status` say so), but the file system has room: the soft
    // threshold (under 10 % free) is not reached yet.
    let mut first = iscsi::login_as(address, TARGET, "iqn.test:first");
    let mut second = iscsi::login_as(address, TARGET, "iqn.test:second");
    assert_eq!(iscsi::clear_attentions(&mut first), vec![]);
    assert_eq!(iscsi::clear_attentions(&mut second), vec![]);
    let mut raw = iscsi::login(address, TARGET);
    // Logical Block Provisioning VPD page: THRESHOLD EXPONENT 11 (1 MiB
    // threshold sets), thin provisioned.
    let vpd = iscsi::command(&mut raw, 1, &[0x12, 0x01, 0xb2, 0, 64, 0], 64);
    assert_eq!((vpd.status, vpd.data[1]), (0, 0xb2), "{vpd:?}");
    assert_eq!(vpd.data[4], 11, "threshold exponent: {vpd:?}");
    assert_eq!(vpd.data[6] & 0x07, 0x02, "thin provisioned: {vpd:?}");
    // iscsi-inq reads the page code with atoi: 178 is 0xb2.
    let out = common::stdout_of(std::process::Command::new("iscsi-inq").args(["-e", "1", "-c", "178", &url]));
    assert!(out.contains("Threshold Exponent:11"), "{out}");
    // The Logical Block Provisioning mode page (MODE SENSE(10), DBD): SITUA
    // zero, one enabled soft threshold on available LBA mapping resources
    // at 10 % of the 1 GiB in 1 MiB sets.
    let mode = iscsi::command(&mut raw, 2, &[0x5a, 0x08, 0x1c, 0x02, 0, 0, 0, 0, 255, 0], 255);
    assert_eq!(mode.status, 0, "{mode:?}");
    let page = &mode.data[8..];
    assert_eq!(&page[..5], &[0x5c, 0x02, 0, 20, 0], "{mode:?}");
    assert_eq!(&page[16..24], &[0x80, 0x01, 0, 0, 0, 0, 0, 102], "{mode:?}");
    drop(raw);

    let acknowledged = common::fill_full_fs(&server, &url);
    // Full: the initiators logged in hear of it.
    assert_soft_threshold_announced(address, first, second);

    // Still full: the same answer again, never EIO. Overwrites of written
    // blocks need no new space: they work, and the device is not read-only.
    let (_, text) = qemu_io(&url, &[format!("write -P 0x99 {} 1M", 900 * MIB)]);
    assert!(
        text.contains("No space left on device") && !text.contains("Input/output error"),
        "{text}"
    );
    qemu_io_ok(
        &url,
        &[
            "write -P 0x77 0 1M".into(),
            "flush".into(),
            "read -P 0x77 0 1M".into(),
            format!("read -P 0 {} 1M", 900 * MIB),
        ],
    );
    // Every other acknowledged MiB reads back.
    let reads: Vec<String> = (1..acknowledged)
        .map(|i| format!("read -P {:#x} {} {MIB}", pattern(i), i * MIB))
        .collect();
    qemu_io_ok(&url, &reads);

    // TRIM frees places; new writes take them, with no restart.
    qemu_io_ok(&url, &[format!("discard {} {}", 2 * MIB, 8 * MIB), "flush".into()]);
    qemu_io_ok(
        &url,
        &[
            format!("write -P 0x5a {} {}", 950 * MIB, 4 * MIB),
            "flush".into(),
            format!("read -P 0x5a {} {}", 950 * MIB, 4 * MIB),
            format!("read -P 0 {} {}", 2 * MIB, 8 * MIB),
        ],
    );

    // kill -9, restart: everything acknowledged is there, and the restarted
    // target announces the soft threshold again.
    server.kill9();
    let server = start(data, ram, &small.dir.path().join("daemon2.log"));
    let address: SocketAddr = server.iscsi.parse().unwrap();
    let first = iscsi::login_as(address, TARGET, "iqn.test:first");
    let second = iscsi::login_as(address, TARGET, "iqn.test:second");
    assert_soft_threshold_announced(address, first, second);
    let url = format!("iscsi://{}/{TARGET}/0", server.iscsi);
    let mut reads: Vec<String> = (10..acknowledged)
        .map(|i| format!("read -P {:#x} {} {MIB}", pattern(i), i * MIB))
        .collect();
    reads.push("read -P 0x77 0 1M".into());
    reads.push(format!("read -P {:#x} {MIB} {MIB}", pattern(1)));
    reads.push(format!("read -P 0x5a {} {}", 950 * MIB, 4 * MIB));
    qemu_io_ok(&url, &reads);
}
