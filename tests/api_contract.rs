//! The REST API against its own OpenAPI document, as a client generated
//! from it sees it: schemathesis (from PyPI; scripts/test installs it)
//! reads `GET /openapi.json` from a running daemon and sends every
//! operation valid and invalid requests, with every check on (statuses,
//! content types, headers and bodies as documented, valid data accepted,
//! invalid data refused, the token required where the document says so).
//! `tests/api_contract.toml` names the few operations whose rules join two
//! parameters (which OpenAPI cannot state) and may refuse such a request.
//! Any failure, or schemathesis missing, fails the test. The daemon runs
//! on ephemeral loopback ports, in a directory of its own (device paths the
//! requests name are relative to it), and is stopped by PID.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Test cases per operation: enough for the coverage phase's boundary
/// values and some fuzzing of each, within about two minutes on 2 cores.
const MAX_EXAMPLES: &str = "10";
/// A fixed seed: a failure seen in CI replays with the same command.
const SEED: &str = "20261201";
/// schemathesis is stopped (and the test fails) past this.
const LIMIT: Duration = Duration::from_secs(300);

/// `strata serve` on ephemeral ports, its working directory `dir`.
struct Daemon {
    child: Child,
    api: String,
}

impl Daemon {
    fn start(dir: &Path) -> Daemon {
        let data = dir.join("data");
        let pool = data.join("pools/default");
        std::fs::create_dir_all(&pool).unwrap();
        for (name, bytes) in [("fast.dev", 1u64 << 30), ("capacity.dev", 2 << 30)] {
            std::fs::File::create(pool.join(name)).unwrap().set_len(bytes).unwrap();
        }
        let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .current_dir(dir)
            .env("STRATA_RAM_DIR", &data)
            .env("STRATA_LOG", "info")
            .arg("serve")
            .arg("--data-dir")
            .arg(&data)
            .args(["--nbd", "127.0.0.1:0", "--api", "127.0.0.1:0"])
            .args(["--iscsi", "127.0.0.1:0", "--nfs", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start strata serve");
        let stdout = child.stdout.take().unwrap();
        let (lines, received) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = lines.send(line);
            }
        });
        let mut daemon = Daemon {
            child,
            api: String::new(),
        };
        while daemon.api.is_empty() {
            let line = received
                .recv_timeout(Duration::from_secs(60))
                .expect("strata serve reports its API address within 60 s");
            if let Some(address) = line.strip_prefix("strata: api listening on http://") {
                daemon.api = address.trim().to_string();
            }
        }
        daemon
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid with a valid signal number.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request with the token; the status line and body.
fn request(api: &str, token: &str, method: &str, path: &str, body: &str) -> String {
    let mut stream = std::net::TcpStream::connect(api).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {api}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

fn created(api: &str, token: &str, path: &str, body: &str) {
    let response = request(api, token, "POST", path, body);
    assert!(response.starts_with("HTTP/1.1 201"), "POST {path} {body}: {response}");
}

#[test]
fn the_api_answers_as_its_openapi_document_says() {
    let schemathesis = Command::new("python3")
        .args(["-c", "import schemathesis; print(schemathesis.__version__)"])
        .output()
        .expect("python3");
    assert!(
        schemathesis.status.success(),
        "schemathesis is not installed for python3; run scripts/test (it installs schemathesis==4.32.5 from PyPI): {}",
        String::from_utf8_lossy(&schemathesis.stderr)
    );

    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(dir.path());
    let token = std::fs::read_to_string(dir.path().join("data/api.token")).unwrap();
    let token = token.trim();
    // Something for the routes to act on: a volume with a snapshot, a
    // dataset with a snapshot.
    created(
        &daemon.api,
        token,
        "/v1/volumes",
        r#"{"name":"default/vol1","size":"64M"}"#,
    );
    created(
        &daemon.api,
        token,
        "/v1/snapshots",
        r#"{"names":["default/vol1@snap1"]}"#,
    );
    created(&daemon.api, token, "/v1/filesystems", r#"{"name":"default/fs1"}"#);
    created(
        &daemon.api,
        token,
        "/v1/filesystems/default/fs1/snapshots",
        r#"{"name":"snap1"}"#,
    );

    let begun = Instant::now();
    let schemathesis = || {
        let started = Instant::now();
        let mut run = Command::new("python3")
            .current_dir(dir.path())
            .args(["-m", "schemathesis.cli", "--config-file"])
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/api_contract.toml"))
            .arg("run")
            .arg(format!("http://{}/openapi.json", daemon.api))
            .args(["--checks", "all", "--max-examples", MAX_EXAMPLES, "--seed", SEED])
            .args(["--workers", "2", "--no-color", "--request-timeout", "60"])
            .arg("--header")
            .arg(format!("Authorization: Bearer {token}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run python3 -m schemathesis.cli");
        let mut stdout = run.stdout.take().unwrap();
        let mut stderr = run.stderr.take().unwrap();
        let out = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stdout.read_to_string(&mut text);
            text
        });
        let err = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        let status = loop {
            if let Some(status) = run.try_wait().unwrap() {
                break Some(status);
            }
            if started.elapsed() > LIMIT {
                let _ = run.kill();
                let _ = run.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        (status, format!("{}{}", out.join().unwrap(), err.join().unwrap()))
    };
    let (mut status, mut output) = schemathesis();
    // CPython 3.11 before 3.11.8 can raise this SystemError at random while
    // building an AST (python/cpython#106905): the tool's own crash, not an
    // answer of the API. One more run; a second failure of any kind fails.
    if !status.is_some_and(|s| s.success()) && output.contains("AST constructor recursion depth mismatch") {
        eprintln!("schemathesis hit CPython's AST recursion depth bug (cpython#106905); running it again");
        (status, output) = schemathesis();
    }
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default();
    let log_tail: Vec<&str> = log
        .lines()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let status = status.unwrap_or_else(|| {
        panic!(
            "schemathesis did not finish within {LIMIT:?}:\n{output}\n--- daemon log (end) ---\n{}",
            log_tail.join("\n")
        )
    });
    assert!(
        status.success(),
        "schemathesis found the API and /openapi.json disagreeing ({status}):\n{output}\n--- daemon log (end) ---\n{}",
        log_tail.join("\n")
    );
    // A run that tested nothing is no pass.
    assert!(
        output.contains("passed") && !output.contains("No operations"),
        "schemathesis ran no test:\n{output}"
    );
    eprintln!("schemathesis passed in {:?}:\n{output}", begun.elapsed());
}
