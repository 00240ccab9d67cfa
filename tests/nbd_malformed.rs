//! Bad input over NBD: malformed handshakes and requests get the protocol's
//! error or a closed connection, never a crash, a hang, or harm to others.

mod common;

use common::nbd::{name_payload, request_bytes, Raw, IHAVEOPT, REQUEST_MAGIC};
use common::{require_tool, run, Server};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

const ERR_UNSUP: u32 = (1 << 31) + 1;
const ERR_INVALID: u32 = (1 << 31) + 3;
const ERR_UNKNOWN: u32 = (1 << 31) + 6;
const ERR_TOO_BIG: u32 = (1 << 31) + 9;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;

#[test]
fn malformed_handshakes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let address = server.nbd.as_str();

    // Unknown client flags: the server hangs up.
    let mut raw = Raw::connect(address);
    raw.send(&0xffu32.to_be_bytes());
    assert!(raw.is_closed());

    // A 4 GiB option length is refused at once, without reading it.
    let mut raw = Raw::start(address);
    let started = Instant::now();
    let mut header = IHAVEOPT.to_be_bytes().to_vec();
    header.extend_from_slice(&7u32.to_be_bytes());
    header.extend_from_slice(&u32::MAX.to_be_bytes());
    raw.send(&header);
    assert_eq!(raw.option_reply().0, ERR_TOO_BIG);
    assert!(raw.is_closed());
    assert!(started.elapsed() < Duration::from_secs(5));

    // A 5000-byte export name gets ERR_TOO_BIG; the connection stays usable.
    let mut raw = Raw::start(address);
    let mut data = name_payload(&"x".repeat(5000));
    data.extend_from_slice(&0u16.to_be_bytes());
    raw.option(7, &data);
    assert_eq!(raw.option_reply().0, ERR_TOO_BIG);
    // Unknown option, unknown export, truncated GO, LIST with data.
    raw.option(99, b"whatever");
    assert_eq!(raw.option_reply().0, ERR_UNSUP);
    let mut data = name_payload("default/nope");
    data.extend_from_slice(&0u16.to_be_bytes());
    raw.option(7, &data);
    assert_eq!(raw.option_reply().0, ERR_UNKNOWN);
    raw.option(7, &[0, 0, 0, 200, b'a']);
    assert_eq!(raw.option_reply().0, ERR_INVALID);
    raw.option(3, b"junk");
    assert_eq!(raw.option_reply().0, ERR_INVALID);
    // SET_META_CONTEXT needs structured replies first.
    let mut data = name_payload("default/vol0");
    data.extend_from_slice(&0u32.to_be_bytes());
    raw.option(10, &data);
    assert_eq!(raw.option_reply().0, ERR_INVALID);
    // Invalid UTF-8 in a name.
    let mut data = vec![0, 0, 0, 2, 0xff, 0xfe];
    data.extend_from_slice(&0u16.to_be_bytes());
    raw.option(6, &data);
    assert_eq!(raw.option_reply().0, ERR_INVALID);
    // After all that, LIST still answers.
    raw.option(3, &[]);
    let (kind, data) = raw.option_reply();
    assert_eq!(kind, 2);
    assert_eq!(&data[4..], b"default/vol0");
    assert_eq!(raw.option_reply().0, 1);
    // ABORT is acknowledged, then the connection closes.
    raw.option(2, &[]);
    assert_eq!(raw.option_reply().0, 1);
    assert!(raw.is_closed());

    // A transmission request before the handshake ended closes the connection.
    let mut raw = Raw::start(address);
    raw.request(0, 0, 1, 0, 4096, &[]);
    assert!(raw.is_closed());

    // NBD_OPT_EXPORT_NAME of an unknown export: the only answer is a hang-up.
    let mut raw = Raw::start(address);
    raw.option(1, b"default/missing");
    assert!(raw.is_closed());
}

#[test]
fn malformed_requests_get_errors_and_the_stream_stays_in_step() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let size = 10u64 << 30;
    let mut raw = Raw::go(&server.nbd, "default/vol0", false);

    let cases: [(u16, u16, u64, u32, u32); 8] = [
        (0, 0, size, 4096, EINVAL),       // read past the end
        (0, 0, size - 512, 4096, EINVAL), // read straddling the end
        (0, 0, 1, 4096, EINVAL),          // misaligned offset
        (0, 0, 0, 100, EINVAL),           // misaligned length
        (0, 0, 0, 64 << 20, EINVAL),      // larger than the maximum: refused, not allocated
        (0, 42, 0, 4096, EINVAL),         // unknown command
        (1 << 1, 0, 0, 4096, EINVAL),     // NO_HOLE on a read
        (0, 7, 0, 4096, EINVAL),          // BLOCK_STATUS without a meta context
    ];
    for (cookie, &(flags, kind, offset, length, expected)) in cases.iter().enumerate() {
        raw.request(flags, kind, cookie as u64, offset, length, &[]);
        assert_eq!(raw.simple_reply(), (expected, cookie as u64), "case {cookie}");
    }
    raw.request(0, 3, 100, 0, 8, &[]);
    assert_eq!(raw.simple_reply(), (EINVAL, 100), "flush with a length");
    // A write past the end: ENOSPC, and its payload is consumed so the next
    // request is still understood.
    raw.request(0, 1, 101, size, 4096, &[0xaa; 4096]);
    assert_eq!(raw.simple_reply(), (ENOSPC, 101));
    raw.request(1, 1, 102, 8192, 4096, &[0xbb; 4096]);
    assert_eq!(raw.simple_reply(), (0, 102));
    raw.request(0, 0, 103, 8192, 4096, &[]);
    assert_eq!(raw.simple_reply(), (0, 103));
    assert_eq!(raw.read(4096), vec![0xbb; 4096]);
    // A bad magic means the stream is out of step: the server hangs up.
    raw.send(&[0u8; 28]);
    assert!(raw.is_closed());

    // A write payload beyond the 32 MiB maximum is treated as an attack.
    let mut raw = Raw::go(&server.nbd, "default/vol0", false);
    raw.request(0, 1, 1, 0, u32::MAX, &[]);
    assert!(raw.is_closed());
}

#[test]
fn structured_replies_holes_errors_and_block_status() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let mut raw = Raw::go(&server.nbd, "default/vol0", true);
    raw.request(0, 1, 1, 4096, 4096, &[0xcc; 4096]);
    assert_eq!(raw.simple_reply(), (0, 1));

    // Read 12 KiB: hole, data, hole -> three chunks, the last one DONE.
    raw.request(0, 0, 2, 0, 12288, &[]);
    let mut seen = Vec::new();
    loop {
        let (flags, kind, cookie, payload) = raw.chunk();
        assert_eq!(cookie, 2);
        let offset = u64::from_be_bytes(payload[0..8].try_into().unwrap());
        match kind {
            1 => {
                assert!(payload[8..].iter().all(|&b| b == 0xcc));
                seen.push(("data", offset, payload.len() as u64 - 8));
            }
            2 => seen.push((
                "hole",
                offset,
                u32::from_be_bytes(payload[8..12].try_into().unwrap()) as u64,
            )),
            other => panic!("unexpected chunk type {other}"),
        }
        if flags & 1 != 0 {
            break;
        }
    }
    assert_eq!(
        seen,
        vec![("hole", 0, 4096), ("data", 4096, 4096), ("hole", 8192, 4096)]
    );

    // With DF: exactly one data chunk.
    raw.request(1 << 2, 0, 3, 0, 8192, &[]);
    let (flags, kind, _, payload) = raw.chunk();
    assert_eq!((flags & 1, kind, payload.len()), (1, 1, 8 + 8192));

    // Errors come as error chunks with a message.
    raw.request(0, 0, 4, 11 << 30, 4096, &[]);
    let (flags, kind, cookie, payload) = raw.chunk();
    assert_eq!((flags & 1, kind, cookie), (1, (1 << 15) + 1, 4));
    assert_eq!(u32::from_be_bytes(payload[0..4].try_into().unwrap()), EINVAL);
    let message_length = u16::from_be_bytes(payload[4..6].try_into().unwrap()) as usize;
    assert!(String::from_utf8_lossy(&payload[6..6 + message_length]).contains("beyond the end"));

    // BLOCK_STATUS over 64 KiB: the 4K write allocated the whole first
    // 16 KiB block (volblocksize), the rest is a hole.
    raw.request(0, 7, 5, 0, 65536, &[]);
    let (flags, kind, _, payload) = raw.chunk();
    assert_eq!((flags & 1, kind), (1, 5));
    let words: Vec<u32> = payload
        .chunks(4)
        .map(|w| u32::from_be_bytes(w.try_into().unwrap()))
        .collect();
    assert_eq!(words, vec![1, 16384, 0, 49152, 3]);
    // REQ_ONE: a single descriptor.
    raw.request(1 << 3, 7, 6, 0, 65536, &[]);
    let (_, _, _, payload) = raw.chunk();
    assert_eq!(payload.len(), 12);
}

#[test]
fn bad_clients_do_not_block_others() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    // Clients that stall mid-handshake, mid-request, or never read replies.
    let mut stalled: Vec<TcpStream> = (0..50).map(|_| TcpStream::connect(&server.nbd).unwrap()).collect();
    let mut half = Raw::go(&server.nbd, "default/vol0", false);
    half.send(&REQUEST_MAGIC.to_be_bytes());
    let mut greedy = Raw::go(&server.nbd, "default/vol0", false);
    for cookie in 0..2000u64 {
        greedy.request(0, 0, cookie, 0, 64 << 10, &[]);
    }
    let started = Instant::now();
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x42 0 1M", "-c", "read -P 0x42 0 1M"])
        .arg(server.uri("default/vol0")));
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "a good client was slowed by bad ones"
    );
    stalled.clear();
    // Shutdown is prompt even with idle and stalled clients connected: the
    // greedy client's replies cannot all be sent, and the server gives up
    // on them after its drain time (5 s) rather than waiting for ever.
    let stopping = Instant::now();
    assert!(server.stop().success());
    assert!(stopping.elapsed() < Duration::from_secs(10));
    drop(half);
    drop(greedy);
}

#[test]
fn requests_sent_with_the_last_option_are_served_and_a_stop_ends_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    let mut raw = Raw::start(&server.nbd);
    // NBD_OPT_GO and two requests in one segment, before any reply is read:
    // the requests arrive while the server still reads options, and must be
    // served once transmission starts (on the connection's reader task).
    let mut data = name_payload("default/vol0");
    data.extend_from_slice(&0u16.to_be_bytes());
    let mut out = IHAVEOPT.to_be_bytes().to_vec();
    out.extend_from_slice(&7u32.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(&data);
    out.extend_from_slice(&request_bytes(0, 1, 1, 4096, 4096, &[0x5a; 4096]));
    out.extend_from_slice(&request_bytes(0, 0, 2, 4096, 4096, &[]));
    raw.send(&out);
    loop {
        match raw.option_reply().0 {
            3 => continue,
            1 => break,
            other => panic!("GO failed with {other:#x}"),
        }
    }
    assert_eq!(raw.simple_reply(), (0, 1));
    assert_eq!(raw.simple_reply(), (0, 2));
    assert_eq!(raw.read(4096), vec![0x5a; 4096]);

    // The client stays connected and idle; the server still stops cleanly
    // (its reader is in a blocking receive) and the client sees the end.
    let status = server.stop();
    assert!(status.success(), "strata exited with {status}");
    assert!(raw.is_closed());
}

#[test]
fn a_stop_answers_the_requests_in_flight_before_the_final_flush() {
    let dir = tempfile::tempdir().unwrap();
    // Create the pool first, then run it with every write and flush of its
    // fast device taking 150 ms (the `delay` wrapper), so that a FUA write
    // is still in flight when the stop comes.
    let mut server = Server::start(dir.path());
    assert!(server.stop().success());
    let fast = dir.path().join("pools/default/fast.dev");
    let wrap = format!("{}=delay:write=150ms,flush=150ms", fast.display());
    let mut server = Server::start_with_args(dir.path(), Some(dir.path()), &["--wrap", &wrap]);
    let mut raw = Raw::go(&server.nbd, "default/vol0", false);
    let data = common::pseudo_random(17, 65536);
    let started = Instant::now();
    raw.request(1, 1, 7, 1 << 20, data.len() as u32, &data); // NBD_CMD_WRITE with FUA
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: kill(2) on our own child's pid with a valid signal number.
    unsafe { libc::kill(server.pid() as i32, libc::SIGTERM) };
    // The write was taken before the stop: it completes and is answered
    // (not cut off by the exit), and so is covered by the final flush.
    assert_eq!(raw.simple_reply(), (0, 7));
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "the delay wrapper was not in place"
    );
    assert!(raw.is_closed(), "the stopping server kept the connection open");
    let status = server.stop();
    assert!(status.success(), "strata exited with {status}");

    let mut server = Server::start(dir.path());
    let mut raw = Raw::go(&server.nbd, "default/vol0", false);
    raw.request(0, 0, 8, 1 << 20, data.len() as u32, &[]);
    assert_eq!(raw.simple_reply(), (0, 8));
    assert_eq!(raw.read(data.len()), data);
    assert!(server.stop().success());
}

#[test]
fn a_wrap_for_a_device_no_pool_has_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("pools/default/typo.dev");
    let output = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "serve",
            "--nbd",
            "127.0.0.1:0",
            "--api",
            "127.0.0.1:0",
            "--iscsi",
            "127.0.0.1:0",
            "--nfs",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .env("STRATA_RAM_DIR", dir.path())
        .arg("--wrap")
        .arg(format!("{}=delay:1ms", missing.display()))
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("is not a device of any pool") && stderr.contains("fast.dev"),
        "unexpected error: {stderr}"
    );
    let output = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--data-dir"])
        .arg(dir.path())
        .env("STRATA_RAM_DIR", dir.path())
        .args(["--wrap", "no-equals-sign"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("expected PATH=STACK"));
}
