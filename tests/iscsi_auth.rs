//! iSCSI CHAP, mutual CHAP and initiator allow-lists, configured with the CLI
//! as volume properties and exercised with libiscsi's tools (CHAP credentials
//! in the URL, `?target_user=…&target_password=…` for mutual CHAP, `-i` for the
//! initiator name) and with raw sockets for the attacks no well-behaved
//! initiator sends (a reflected challenge, an oversized CHAP_R). The daemon
//! runs on ephemeral loopback ports and is stopped by PID. A missing tool
//! fails its test.

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpStream;
use std::process::{Command, Output};
use std::time::Duration;

use strata::frontend::iscsi::chap;
use strata::frontend::iscsi::pdu::{self, op, Bhs};
use strata::frontend::iscsi::text;

mod common;

use common::iscsi::read_response;

const TARGET: &str = "iqn.2026-11.io.strata:default.vol0";
const OPEN_TARGET: &str = "iqn.2026-11.io.strata:default.open";
const USER: &str = "alice";
const SECRET: &str = "alice-secret-1";
const TARGET_USER: &str = "strata-target";
const TARGET_SECRET: &str = "target-secret-2";
const ALLOWED: &str = "iqn.2026-11.test:allowed";

struct AuthServer {
    dir: tempfile::TempDir,
    daemon: common::Server,
}

/// The daemon with `default/vol0` (configured by each test) and
/// `default/open` (no authentication, any initiator).
fn start_server() -> AuthServer {
    let dir = tempfile::tempdir().expect("temp dir");
    let daemon = common::Server::start(dir.path());
    daemon.create_volume("default/open", "16M");
    AuthServer { dir, daemon }
}

impl AuthServer {
    fn cli(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(args)
            .arg("--data-dir")
            .arg(&self.daemon.data_dir)
            .output()
            .expect("run the strata CLI")
    }

    /// `strata volume set default/vol0 PROPERTY=VALUE...`, which must succeed.
    fn set(&self, assignments: &[&str]) {
        let mut args = vec!["volume", "set", "default/vol0"];
        args.extend_from_slice(assignments);
        let output = self.cli(&args);
        assert!(
            output.status.success(),
            "volume set failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    fn url(&self, credentials: &str, target: &str, query: &str) -> String {
        format!("iscsi://{credentials}{}/{target}/0{query}", self.daemon.iscsi)
    }
}

/// Runs a libiscsi tool; panics if it is not installed.
fn tool(name: &str, args: &[&str]) -> (bool, String) {
    let output = Command::new(name)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{name} is required for this test (package libiscsi-bin): {e}"));
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

fn inq_ok(url: &str, extra: &[&str]) -> String {
    let mut args = extra.to_vec();
    args.push(url);
    let (ok, text) = tool("iscsi-inq", &args);
    assert!(ok, "iscsi-inq {url} failed:\n{text}");
    assert!(text.contains("STRATA"), "{text}");
    text
}

/// iscsi-inq must fail to log in; returns its output.
fn inq_refused(url: &str, extra: &[&str]) -> String {
    let mut args = extra.to_vec();
    args.push(url);
    let (ok, text) = tool("iscsi-inq", &args);
    assert!(!ok, "iscsi-inq {url} logged in but must not:\n{text}");
    assert!(!text.contains("STRATA"), "the LUN was reached:\n{text}");
    text
}

fn chap_on(server: &AuthServer) {
    server.set(&[
        "iscsi.auth=chap",
        &format!("iscsi.chap_user={USER}"),
        &format!("iscsi.chap_secret={SECRET}"),
    ]);
}

#[test]
fn chap_login_succeeds_with_the_secret_and_fails_without_it() {
    let server = start_server();
    chap_on(&server);
    inq_ok(&server.url(&format!("{USER}%{SECRET}@"), TARGET, ""), &[]);
    let text = inq_refused(&server.url(&format!("{USER}%wrong-secret-99@"), TARGET, ""), &[]);
    assert!(text.contains("513") || text.contains("uthentication"), "{text}");
    inq_refused(&server.url(&format!("mallory%{SECRET}@"), TARGET, ""), &[]);
    // Without credentials libiscsi skips security negotiation: refused too.
    inq_refused(&server.url("", TARGET, ""), &[]);
    // Other targets are unaffected, and discovery needs no authentication.
    inq_ok(&server.url("", OPEN_TARGET, ""), &[]);
    let (ok, text) = tool("iscsi-ls", &[&format!("iscsi://{}", server.daemon.iscsi)]);
    assert!(ok && text.contains(TARGET) && text.contains(OPEN_TARGET), "{text}");
    // Back to no authentication: a plain login works again at once.
    server.set(&["iscsi.auth=none"]);
    inq_ok(&server.url("", TARGET, ""), &[]);
}

#[test]
fn mutual_chap_authenticates_the_target_too() {
    let server = start_server();
    chap_on(&server);
    server.set(&[
        "iscsi.auth=mutual",
        &format!("iscsi.mutual_user={TARGET_USER}"),
        &format!("iscsi.mutual_secret={TARGET_SECRET}"),
    ]);
    let credentials = format!("{USER}%{SECRET}@");
    let good = format!("?target_user={TARGET_USER}&target_password={TARGET_SECRET}");
    inq_ok(&server.url(&credentials, TARGET, &good), &[]);
    // The initiator expects another target secret: it refuses our answer.
    let wrong = format!("?target_user={TARGET_USER}&target_password=not-the-target-secret");
    let text = inq_refused(&server.url(&credentials, TARGET, &wrong), &[]);
    assert!(text.contains("CHAP_R"), "{text}");
    // iscsi.auth=mutual: an initiator that does not challenge us is refused.
    inq_refused(&server.url(&credentials, TARGET, ""), &[]);
    // A wrong initiator secret fails before the target answers anything.
    inq_refused(&server.url(&format!("{USER}%wrong-secret-99@"), TARGET, &good), &[]);
}

#[test]
fn initiator_allow_list_admits_only_listed_names() {
    let server = start_server();
    server.set(&[&format!("iscsi.initiators={ALLOWED}, iqn.2026-11.test:second")]);
    inq_ok(&server.url("", TARGET, ""), &["-i", ALLOWED]);
    // Names compare case-insensitively.
    inq_ok(&server.url("", TARGET, ""), &["-i", &ALLOWED.to_uppercase()]);
    let text = inq_refused(&server.url("", TARGET, ""), &["-i", "iqn.2026-11.test:stranger"]);
    assert!(text.contains("514") || text.contains("uthorization"), "{text}");
    // Discovery lists only the targets an initiator may log in to.
    let portal = format!("iscsi://{}", server.daemon.iscsi);
    let (ok, text) = tool("iscsi-ls", &["-i", "iqn.2026-11.test:stranger", &portal]);
    assert!(ok && !text.contains(TARGET) && text.contains(OPEN_TARGET), "{text}");
    let (ok, text) = tool("iscsi-ls", &["-i", ALLOWED, &portal]);
    assert!(ok && text.contains(TARGET), "{text}");
    // The list and CHAP together: both must pass.
    chap_on(&server);
    inq_ok(&server.url(&format!("{USER}%{SECRET}@"), TARGET, ""), &["-i", ALLOWED]);
    inq_refused(
        &server.url(&format!("{USER}%{SECRET}@"), TARGET, ""),
        &["-i", "iqn.2026-11.test:stranger"],
    );
}

#[test]
fn properties_are_shown_masked_and_validated_without_echo() {
    let server = start_server();
    chap_on(&server);
    server.set(&[&format!("iscsi.initiators={ALLOWED}")]);
    let output = server.cli(&["volume", "get", "default/vol0"]);
    let shown = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(output.status.success(), "{shown}");
    assert!(!shown.contains(SECRET), "secret shown:\n{shown}");
    let row = |name: &str| {
        shown
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(name))
            .unwrap_or_else(|| panic!("no {name} row in:\n{shown}"))
            .split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(row("iscsi.auth")[2..], ["chap", "local"]);
    assert_eq!(row("iscsi.chap_user")[2..], [USER, "local"]);
    assert_eq!(row("iscsi.chap_secret")[2..], ["********", "local"]);
    assert_eq!(row("iscsi.mutual_secret")[2..], ["-", "default"]);
    assert_eq!(row("iscsi.initiators")[2..], [ALLOWED, "local"]);
    let output = server.cli(&["volume", "get", "default/vol0", "--json"]);
    let json = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success() && json.contains("********") && !json.contains(SECRET));
    // A too-short secret is refused, and the error does not repeat it.
    let output = server.cli(&["volume", "set", "default/vol0", "iscsi.chap_secret=tiny-pw"]);
    let error = String::from_utf8_lossy(&output.stderr).to_string();
    assert!(!output.status.success(), "a 7-byte secret was accepted");
    assert!(error.contains("12") && !error.contains("tiny-pw"), "{error}");
    let output = server.cli(&["volume", "set", "default/vol0", "iscsi.auth=kerberos"]);
    assert!(!output.status.success());
    let output = server.cli(&["volume", "set", "default/vol0", "iscsi.initiators=not-an-iqn"]);
    assert!(!output.status.success());
    // Nothing was changed by the refused requests.
    let output = server.cli(&["volume", "get", "default/vol0", "iscsi.auth", "iscsi.initiators"]);
    let shown = String::from_utf8_lossy(&output.stdout);
    assert!(shown.contains("chap") && shown.contains(ALLOWED), "{shown}");
}

#[test]
fn chap_settings_survive_a_restart() {
    let mut server = start_server();
    chap_on(&server);
    assert!(server.daemon.stop().success());
    server.daemon = common::Server::start(server.dir.path());
    inq_refused(&server.url("", TARGET, ""), &[]);
    inq_ok(&server.url(&format!("{USER}%{SECRET}@"), TARGET, ""), &[]);
}

// ---------------------------------------------------------------------------
// Raw-socket attacks on the CHAP exchange.

fn login_pdu(text: &str, flags: u8) -> Vec<u8> {
    let mut bhs = Bhs::new(op::LOGIN | 0x40);
    bhs.0[1] = flags;
    bhs.0[8..14].copy_from_slice(&[0x80, 0, 0, 0, 0, 9]);
    bhs.set_u32(16, 1);
    pdu::encode(&bhs, text.as_bytes(), false, false)
}

fn status_of(bhs: &Bhs) -> u16 {
    u16::from_be_bytes([bhs.0[36], bhs.0[37]])
}

/// Logs in to the CHAP target up to the challenge: returns the connection,
/// the identifier and the challenge.
fn until_challenge(server: &AuthServer) -> (TcpStream, u8, Vec<u8>) {
    let mut stream = TcpStream::connect(&server.daemon.iscsi).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let first = format!("InitiatorName=iqn.2026-11.test:raw\0TargetName={TARGET}\0AuthMethod=CHAP\0");
    stream.write_all(&login_pdu(&first, 0x81)).unwrap();
    let (bhs, data) = read_response(&mut stream).expect("first login response");
    assert_eq!(status_of(&bhs), 0);
    let keys: HashMap<String, String> = text::parse(&data).unwrap().into_iter().collect();
    assert_eq!(keys["AuthMethod"], "CHAP");
    stream.write_all(&login_pdu("CHAP_A=5\0", 0x01)).unwrap();
    let (bhs, data) = read_response(&mut stream).expect("challenge");
    assert_eq!(status_of(&bhs), 0);
    let keys: HashMap<String, String> = text::parse(&data).unwrap().into_iter().collect();
    let identifier = keys["CHAP_I"].parse().unwrap();
    let challenge = chap::decode_binary(&keys["CHAP_C"], 1024).unwrap();
    (stream, identifier, challenge)
}

/// Sends the answer; asserts the status and that the connection is closed
/// without anything reachable behind it.
fn answer_refused(mut stream: TcpStream, text: &str, expected: u16) {
    stream.write_all(&login_pdu(text, 0x81)).unwrap();
    let (bhs, data) = read_response(&mut stream).expect("login response");
    assert_eq!(status_of(&bhs), expected, "status");
    assert!(
        data.is_empty(),
        "a refusal carries no keys: {:?}",
        String::from_utf8_lossy(&data)
    );
    // A SCSI command now gets nothing: the connection is closed.
    let mut tur = Bhs::new(op::SCSI_COMMAND);
    tur.0[1] = 0x80;
    let _ = stream.write_all(&pdu::encode(&tur, &[], false, false));
    assert!(read_response(&mut stream).is_none(), "connection still open");
}

#[test]
fn reflected_challenge_and_oversized_chap_values_are_refused() {
    let server = start_server();
    chap_on(&server);
    server.set(&[
        "iscsi.auth=mutual",
        &format!("iscsi.mutual_user={TARGET_USER}"),
        &format!("iscsi.mutual_secret={TARGET_SECRET}"),
    ]);
    let answer = |id: u8, challenge: &[u8]| chap::encode_hex(&chap::response(id, SECRET.as_bytes(), challenge));

    // The target's challenge handed back as the initiator's: refused, even
    // with a correct CHAP_R, and the target computes nothing for it.
    let (stream, id, challenge) = until_challenge(&server);
    let text = format!(
        "CHAP_N={USER}\0CHAP_R={}\0CHAP_I={id}\0CHAP_C={}\0",
        answer(id, &challenge),
        chap::encode_hex(&challenge)
    );
    answer_refused(stream, &text, 0x0201);

    // CHAP_R of 1000 bytes (within the text limits): initiator error.
    let (stream, _, _) = until_challenge(&server);
    answer_refused(
        stream,
        &format!("CHAP_N={USER}\0CHAP_R=0x{}\0", "ab".repeat(1000)),
        0x0200,
    );
    // CHAP_R of 30000 hex digits (beyond them): initiator error as well.
    let (mut stream, _, _) = until_challenge(&server);
    let long = format!("CHAP_N={USER}\0CHAP_R=0x{}\0", "f".repeat(6000));
    stream.write_all(&login_pdu(&long, 0x81)).unwrap();
    let (bhs, data) = read_response(&mut stream).expect("login response");
    assert_eq!(bhs.0[36], 2, "initiator error class");
    assert!(data.len() < 100, "nothing echoed");
    // Oversized CHAP_C (1100 bytes in base64).
    let (stream, id, challenge) = until_challenge(&server);
    let big_c = format!("0b{}", "AQEB".repeat(1100 / 3 + 1));
    let text = format!(
        "CHAP_N={USER}\0CHAP_R={}\0CHAP_I=3\0CHAP_C={big_c}\0",
        answer(id, &challenge)
    );
    answer_refused(stream, &text, 0x0200);
    // Missing CHAP_R.
    let (stream, _, _) = until_challenge(&server);
    answer_refused(stream, &format!("CHAP_N={USER}\0"), 0x0207);
    // A wrong answer.
    let (stream, id, challenge) = until_challenge(&server);
    let wrong = chap::encode_hex(&chap::response(id, b"wrong-secret-99", &challenge));
    let text = format!("CHAP_N={USER}\0CHAP_R={wrong}\0CHAP_I=3\0CHAP_C=0x0102030405060708090a0b0c0d0e0f10\0");
    answer_refused(stream, &text, 0x0201);

    // A correct mutual exchange over the same raw path gets the target's answer.
    let (mut stream, id, challenge) = until_challenge(&server);
    let ours = [0x33u8; 16];
    let text = format!(
        "CHAP_N={USER}\0CHAP_R={}\0CHAP_I=77\0CHAP_C={}\0",
        answer(id, &challenge),
        chap::encode_hex(&ours)
    );
    stream.write_all(&login_pdu(&text, 0x81)).unwrap();
    let (bhs, data) = read_response(&mut stream).expect("login response");
    assert_eq!(status_of(&bhs), 0);
    let keys: HashMap<String, String> = text::parse(&data).unwrap().into_iter().collect();
    assert_eq!(keys["CHAP_N"], TARGET_USER);
    assert_eq!(
        keys["CHAP_R"],
        chap::encode_hex(&chap::response(77, TARGET_SECRET.as_bytes(), &ours))
    );
    // The server still serves everyone else.
    inq_ok(
        &server.url(
            &format!("{USER}%{SECRET}@"),
            TARGET,
            &format!("?target_user={TARGET_USER}&target_password={TARGET_SECRET}"),
        ),
        &[],
    );
}

/// `strata iscsi set`, which must succeed.
fn iscsi_set(server: &AuthServer, assignments: &[&str]) {
    let mut args = vec!["iscsi", "set"];
    args.extend_from_slice(assignments);
    let output = server.cli(&args);
    assert!(
        output.status.success(),
        "iscsi set failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn discovery_can_require_chap_and_its_secret_is_never_shown() {
    let mut server = start_server();
    let portal = format!("iscsi://{}", server.daemon.iscsi);
    // Open by default.
    let (ok, text) = tool("iscsi-ls", &[&portal]);
    assert!(ok && text.contains(OPEN_TARGET), "{text}");

    iscsi_set(
        &server,
        &[
            "discovery_auth=chap",
            &format!("discovery_chap_user={USER}"),
            &format!("discovery_chap_secret={SECRET}"),
        ],
    );
    // Without credentials, with a wrong secret or user: no target list.
    for url in [
        portal.clone(),
        format!("iscsi://{USER}%wrong-secret-99@{}", server.daemon.iscsi),
        format!("iscsi://mallory%{SECRET}@{}", server.daemon.iscsi),
    ] {
        let (ok, text) = tool("iscsi-ls", &[&url]);
        assert!(!ok && !text.contains(OPEN_TARGET), "{url} listed targets:\n{text}");
    }
    let (ok, text) = tool(
        "iscsi-ls",
        &[&format!("iscsi://{USER}%{SECRET}@{}", server.daemon.iscsi)],
    );
    assert!(ok && text.contains(OPEN_TARGET) && text.contains(TARGET), "{text}");
    // Normal sessions to an open target are not affected.
    inq_ok(&server.url("", OPEN_TARGET, ""), &[]);

    // The secret is masked in the CLI, the API and the volume rules alike.
    let shown = String::from_utf8_lossy(&server.cli(&["iscsi", "get"]).stdout).into_owned();
    assert!(
        shown.contains("discovery_chap_secret") && shown.contains("********"),
        "{shown}"
    );
    assert!(shown.contains(USER) && !shown.contains(SECRET), "{shown}");
    let json = String::from_utf8_lossy(&server.cli(&["iscsi", "get", "--json"]).stdout).into_owned();
    assert!(!json.contains(SECRET) && json.contains("discovery_auth"), "{json}");
    let answer = common::http(&server.daemon.api, "GET", "/v1/iscsi", "");
    assert!(
        answer.starts_with("HTTP/1.1 200") && !answer.contains(SECRET),
        "{answer}"
    );
    chap_on(&server);
    let answer = common::http(&server.daemon.api, "GET", "/v1/volumes/default/vol0", "");
    assert!(
        answer.starts_with("HTTP/1.1 200") && !answer.contains(SECRET),
        "{answer}"
    );
    // Bad values are refused without echoing a secret.
    let output = server.cli(&["iscsi", "set", "discovery_chap_secret=short"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && !stderr.contains("short") && stderr.contains("12 to 255"),
        "{stderr}"
    );
    let output = server.cli(&["iscsi", "set", "discovery_colour=red"]);
    assert!(String::from_utf8_lossy(&output.stderr).contains("unknown iSCSI setting"));

    // Kept across a restart; `none` opens discovery again.
    assert!(server.daemon.stop().success());
    server.daemon = common::Server::start(server.dir.path());
    let (ok, _) = tool("iscsi-ls", &[&format!("iscsi://{}", server.daemon.iscsi)]);
    assert!(!ok, "discovery CHAP was lost at the restart");
    iscsi_set(&server, &["discovery_auth=none"]);
    let (ok, text) = tool("iscsi-ls", &[&format!("iscsi://{}", server.daemon.iscsi)]);
    assert!(ok && text.contains(OPEN_TARGET), "{text}");
}
