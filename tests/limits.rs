//! Bounded resources: connections beyond the per-client and per-listener
//! caps are refused (NBD: closed before the greeting; iSCSI: login status
//! "out of resources") while admitted clients keep working, places come
//! back when connections close, and a client trickling its handshake or
//! login one byte per second is cut at the handshake timeout while others
//! are served. Clients come from several loopback addresses (127.0.0.x) to
//! be several "client addresses"; the daemon listens on 127.0.0.1 only.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{require_tool, Server};
use strata::frontend::iscsi::pdu::{self, op, Bhs};

/// Connects to `server` from the loopback address `from` (e.g. 127.0.0.2).
fn connect_from(from: &str, server: &str) -> TcpStream {
    let server: SocketAddr = server.parse().unwrap();
    // SAFETY: plain socket calls on a descriptor this function owns; the
    // sockaddr structs live across the calls that read them.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let address = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(ip).to_be(),
            },
            sin_zero: [0; 8],
        };
        let local = address(from.parse().unwrap(), 0);
        let size = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        assert_eq!(
            libc::bind(fd, &local as *const _ as *const libc::sockaddr, size),
            0,
            "bind {from}"
        );
        let SocketAddr::V4(v4) = server else {
            panic!("IPv4 only")
        };
        let remote = address(*v4.ip(), v4.port());
        assert_eq!(
            libc::connect(fd, &remote as *const _ as *const libc::sockaddr, size),
            0,
            "connect"
        );
        std::os::fd::FromRawFd::from_raw_fd(fd)
    }
}

/// Reads what the server sends within `wait`: the bytes, and whether it
/// closed the connection.
fn read_for(stream: &mut TcpStream, wait: Duration) -> (Vec<u8>, bool) {
    stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let deadline = Instant::now() + wait;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return (got, true),
        }
    }
    (got, false)
}

/// An NBD connection that got its greeting (admitted and held open).
#[track_caller]
fn nbd_admitted(from: &str, server: &str) -> TcpStream {
    let mut stream = connect_from(from, server);
    let mut greeting = [0u8; 18];
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream
        .read_exact(&mut greeting)
        .expect("an admitted client gets the greeting");
    assert_eq!(&greeting[..8], b"NBDMAGIC");
    stream
}

#[track_caller]
fn nbd_refused(from: &str, server: &str) {
    let mut stream = connect_from(from, server);
    let (got, closed) = read_for(&mut stream, Duration::from_secs(5));
    assert!(
        got.is_empty() && closed,
        "a refused client got {got:?} (closed: {closed})"
    );
}

fn nbdinfo_works(server: &Server) -> bool {
    Command::new("nbdinfo")
        .arg(server.uri("default/vol0"))
        .output()
        .expect("run nbdinfo")
        .status
        .success()
}

#[test]
fn nbd_connections_are_capped_per_client_and_per_listener() {
    require_tool("nbdinfo");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with_args(
        dir.path(),
        Some(dir.path()),
        &["--max-connections", "8", "--max-connections-per-client", "3"],
    );
    let held: Vec<TcpStream> = (0..3).map(|_| nbd_admitted("127.0.0.1", &server.nbd)).collect();
    // A fourth from the same address is refused; so is nbdinfo from there.
    nbd_refused("127.0.0.1", &server.nbd);
    assert!(!nbdinfo_works(&server), "nbdinfo got past the per-client cap");
    // Other addresses are still served.
    let mut others: Vec<TcpStream> = (0..3).map(|_| nbd_admitted("127.0.0.2", &server.nbd)).collect();
    others.extend((0..2).map(|_| nbd_admitted("127.0.0.3", &server.nbd)));
    // 8 open: the listener is full, for a new address too.
    nbd_refused("127.0.0.4", &server.nbd);
    // A place freed is a place taken again.
    drop(others.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    let fourth = loop {
        let mut stream = connect_from("127.0.0.4", &server.nbd);
        let (got, _) = read_for(&mut stream, Duration::from_millis(500));
        if got.starts_with(b"NBDMAGIC") {
            break stream;
        }
        assert!(Instant::now() < deadline, "the freed place never came back");
    };
    drop(held);
    drop(others);
    drop(fourth);
    // All closed: a real client works again.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !nbdinfo_works(&server) {
        assert!(
            Instant::now() < deadline,
            "nbdinfo never worked again after the connections closed"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_trickling_nbd_handshake_is_cut_at_the_timeout_while_others_are_served() {
    require_tool("nbdinfo");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with_args(dir.path(), Some(dir.path()), &["--handshake-timeout", "2"]);
    let mut slow = nbd_admitted("127.0.0.2", &server.nbd);
    slow.set_write_timeout(Some(Duration::from_secs(1))).unwrap();
    let started = Instant::now();
    // NBD_OPT magic, one byte per second.
    let option = b"IHAVEOPT\x00\x00\x00\x01\x00\x00\x00\x00";
    let mut cut = false;
    for byte in option.iter().cycle().take(20) {
        if slow.write_all(&[*byte]).is_err() {
            cut = true;
            break;
        }
        // Meanwhile, a real client is served at once.
        if started.elapsed() < Duration::from_secs(1) {
            assert!(nbdinfo_works(&server));
        }
        let (_, closed) = read_for(&mut slow, Duration::from_secs(1));
        if closed {
            cut = true;
            break;
        }
    }
    let elapsed = started.elapsed();
    assert!(cut, "the trickling client was never cut");
    assert!(
        elapsed >= Duration::from_millis(1500) && elapsed < Duration::from_secs(10),
        "cut after {elapsed:?}, expected about 2 s"
    );
}

/// A Login request for a discovery session (RFC 7143 11.12): CSG 1, NSG 3, transit.
fn login_request() -> Vec<u8> {
    let text = b"InitiatorName=iqn.2026-11.test:limits\0SessionType=Discovery\0";
    let mut pdu = vec![0u8; 48];
    pdu[0] = 0x43;
    pdu[1] = 0x87;
    pdu[5..8].copy_from_slice(&(text.len() as u32).to_be_bytes()[1..]);
    pdu[8..14].copy_from_slice(&[0x40, 0, 0, 0, 0, 1]);
    pdu.extend_from_slice(text);
    while !pdu.len().is_multiple_of(4) {
        pdu.push(0);
    }
    pdu
}

/// The login status (class << 8 | detail) the target answers, or None if it
/// closed without an answer.
fn login_status(from: &str, server: &str) -> Option<u16> {
    let mut stream = connect_from(from, server);
    stream.write_all(&login_request()).unwrap();
    let (got, _) = read_for(&mut stream, Duration::from_secs(5));
    (got.len() >= 48).then(|| u16::from_be_bytes([got[36], got[37]]))
}

#[test]
fn iscsi_connections_beyond_the_cap_are_told_out_of_resources() {
    require_tool("iscsi-ls");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with_args(
        dir.path(),
        Some(dir.path()),
        &["--max-connections", "8", "--max-connections-per-client", "2"],
    );
    // A login works (from an address of its own: its session may take a
    // moment to be counted out after it closes).
    assert_eq!(login_status("127.0.0.3", &server.iscsi), Some(0x0000));
    let held: Vec<TcpStream> = (0..2).map(|_| connect_from("127.0.0.1", &server.iscsi)).collect();
    // Give the daemon a moment to count them.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(login_status("127.0.0.1", &server.iscsi), Some(0x0302));
    let portal = format!("iscsi://{}", server.iscsi);
    let (listed, text) = {
        let output = Command::new("iscsi-ls").arg(&portal).output().unwrap();
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    };
    assert!(!listed, "iscsi-ls got past the cap: {text}");
    // Another address is served.
    assert_eq!(login_status("127.0.0.2", &server.iscsi), Some(0x0000));
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    while login_status("127.0.0.1", &server.iscsi) != Some(0x0000) {
        assert!(Instant::now() < deadline, "places never came back");
        std::thread::sleep(Duration::from_millis(200));
    }
    let output = Command::new("iscsi-ls").arg(&portal).output().unwrap();
    assert!(output.status.success(), "{output:?}");
}

#[test]
fn a_trickling_iscsi_login_is_cut_at_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with_args(dir.path(), Some(dir.path()), &["--handshake-timeout", "2"]);
    let mut slow = connect_from("127.0.0.2", &server.iscsi);
    slow.set_write_timeout(Some(Duration::from_secs(1))).unwrap();
    let started = Instant::now();
    let mut cut = false;
    for byte in login_request().into_iter().take(20) {
        if slow.write_all(&[byte]).is_err() {
            cut = true;
            break;
        }
        if started.elapsed() < Duration::from_secs(1) {
            assert_eq!(login_status("127.0.0.1", &server.iscsi), Some(0x0000));
        }
        let (_, closed) = read_for(&mut slow, Duration::from_secs(1));
        if closed {
            cut = true;
            break;
        }
    }
    let elapsed = started.elapsed();
    assert!(cut, "the trickling initiator was never cut");
    assert!(
        elapsed >= Duration::from_millis(1500) && elapsed < Duration::from_secs(10),
        "cut after {elapsed:?}, expected about 2 s"
    );
}

/// Logs in to `default/vol0` straight to the full feature phase.
fn iscsi_login_normal(address: &str) -> TcpStream {
    let mut stream = TcpStream::connect(address).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let pdu_of = |text: &str, flags: u8| {
        let mut bhs = Bhs::new(op::LOGIN | 0x40);
        bhs.0[1] = flags;
        bhs.0[8..14].copy_from_slice(&[0x80, 0, 0, 0, 0, 8]);
        bhs.set_u32(16, 1);
        pdu::encode(&bhs, text.as_bytes(), false, false)
    };
    let text =
        "InitiatorName=iqn.2026-11.test:limits\0TargetName=iqn.2026-11.io.strata:default.vol0\0AuthMethod=None\0";
    for (text, flags) in [(text, 0x81), ("MaxRecvDataSegmentLength=8192\0", 0x87)] {
        stream.write_all(&pdu_of(text, flags)).unwrap();
        let mut header = [0u8; 48];
        stream.read_exact(&mut header).expect("login response");
        let bhs = Bhs(header);
        let len = bhs.data_segment_len() as usize;
        let mut data = vec![0u8; len + pdu::padding_for(len)];
        stream.read_exact(&mut data).unwrap();
        assert_eq!(header[36], 0, "login status class");
    }
    stream
}

#[test]
fn iscsi_write_data_gathered_per_connection_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let mut stream = iscsi_login_normal(&server.iscsi);
    // WRITE(10)s of 65535 blocks (32 MiB - 512 bytes) whose data is never
    // sent: four fit in the 128 MiB a connection may gather, the fifth is
    // answered TASK SET FULL at once.
    let blocks: u16 = 65535;
    for cmdsn in 0..5u32 {
        let mut write = Bhs::new(op::SCSI_COMMAND);
        write.0[1] = 0x80 | 0x20;
        write.set_u32(16, 0x100 + cmdsn);
        write.set_u32(20, blocks as u32 * 512);
        write.set_u32(24, cmdsn);
        write.0[32] = 0x2a;
        write.0[32 + 2..32 + 6].copy_from_slice(&(cmdsn * 65536).to_be_bytes());
        write.0[32 + 7..32 + 9].copy_from_slice(&blocks.to_be_bytes());
        stream.write_all(&pdu::encode(&write, &[], false, false)).unwrap();
    }
    let mut r2t_tags = Vec::new();
    loop {
        let mut header = [0u8; 48];
        stream.read_exact(&mut header).expect("a response to the fifth write");
        let bhs = Bhs(header);
        let len = bhs.data_segment_len() as usize;
        let mut data = vec![0u8; len + pdu::padding_for(len)];
        stream.read_exact(&mut data).unwrap();
        match bhs.opcode() {
            op::R2T => r2t_tags.push(bhs.itt()),
            op::SCSI_RESPONSE => {
                assert_eq!(bhs.itt(), 0x104, "only the fifth write is answered");
                assert_eq!(header[3], 0x28, "SCSI status TASK SET FULL");
                break;
            }
            other => panic!("unexpected PDU opcode {other:#x}"),
        }
    }
    assert!(!r2t_tags.contains(&0x104), "{r2t_tags:x?}");
}
