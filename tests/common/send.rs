//! `strata send` and `strata receive` as the send/receive tests drive
//! them: the stream as bytes, a receive over the TCP API with the token
//! (as from another machine), and what the receiving side shows after.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use super::{cli_ok, run, token_for, Server};

const STRATA: &str = env!("CARGO_BIN_EXE_strata");

/// `strata send ARGS` on `server`: the stream.
pub fn send(server: &Server, args: &[&str]) -> Vec<u8> {
    let output = run(Command::new(STRATA)
        .arg("send")
        .args(args)
        .arg("--data-dir")
        .arg(&server.data_dir));
    output.stdout
}

/// `strata receive ARGS < stream` on `server`, over its TCP API with the
/// token (as from another machine).
pub fn receive(server: &Server, args: &[&str], stream: &[u8]) -> Output {
    let mut child = Command::new(STRATA)
        .arg("receive")
        .args(args)
        .args(["--api", &server.api])
        .env("STRATA_TOKEN", token_for(&server.api).expect("the test daemon's token"))
        .env_remove("STRATA_DATA_DIR")
        .current_dir(std::env::temp_dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run strata receive");
    let mut stdin = child.stdin.take().unwrap();
    // The daemon may refuse early and close: a broken pipe is fine then.
    let _ = stdin.write_all(stream);
    drop(stdin);
    child.wait_with_output().unwrap()
}

pub fn receive_ok(server: &Server, args: &[&str], stream: &[u8]) {
    let output = receive(server, args, stream);
    assert!(
        output.status.success(),
        "strata receive {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A refused receive: its one-line message (stderr's first line).
pub fn receive_refused(server: &Server, args: &[&str], stream: &[u8]) -> String {
    let output = receive(server, args, stream);
    assert!(!output.status.success(), "strata receive {args:?} was not refused");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(stderr.starts_with("strata: error: "), "{stderr}");
    stderr
}

/// `qemu-img compare` of two raw images (NBD URIs or files): equal.
pub fn compare(a: &str, b: &str) {
    let output = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw", a, b])
        .output()
        .expect("run qemu-img compare");
    assert!(
        output.status.success(),
        "qemu-img compare {a} {b}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The volumes `volume list` shows (a receive in progress hides its target).
pub fn volumes(server: &Server) -> Vec<String> {
    let listed: serde_json::Value = serde_json::from_str(&cli_ok(server, &["volume", "list", "--json"])).unwrap();
    listed
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect()
}

/// The bytes the default pool's devices hold, after its cache is placed
/// and its freeing queue emptied.
pub fn placed(server: &Server) -> u64 {
    super::settled_pool_json(server, "default")["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["used_bytes"].as_u64().unwrap())
        .sum()
}

/// `nbdinfo --map` of an export, each line's fields separated by one space.
pub fn map_of(server: &Server, export: &str) -> String {
    super::stdout_of(Command::new("nbdinfo").args(["--map", &server.uri(export)]))
        .lines()
        .map(|line| line.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The export is not served (nbdinfo cannot open it).
pub fn export_missing(server: &Server, export: &str) {
    let output = Command::new("nbdinfo").arg(server.uri(export)).output().unwrap();
    assert!(!output.status.success(), "{export} is exported");
}

/// The resume token the receiving daemon reports for `volume`.
pub fn pending_token(server: &Server, volume: &str) -> String {
    let status = cli_ok(server, &["receive", "--status", volume]);
    let token = status
        .split_whitespace()
        .skip_while(|w| *w != "--resume")
        .nth(1)
        .unwrap_or_else(|| panic!("no token in: {status}"));
    token.to_string()
}

/// The stream bytes a pending receive into `volume` has applied and made
/// durable (0 while none is recorded).
pub fn received_bytes(server: &Server, volume: &str) -> u64 {
    let status = super::cli(server, &["receive", "--status", volume]);
    String::from_utf8_lossy(&status.stdout)
        .split(": ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}
