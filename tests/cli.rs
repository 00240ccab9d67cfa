//! End-to-end tests of the CLI client and the REST API: each test starts the
//! real `strata serve` on free ports and a fresh data directory, runs the
//! `strata` binary against it and checks outputs and exit codes.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_strata");
const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `strata serve`; killed on drop so a failing test leaves no process.
struct Server {
    child: Option<Child>,
    /// `127.0.0.1:PORT` of the REST API.
    api: String,
    data_dir: std::path::PathBuf,
    /// `127.0.0.1:PORT` of the NBD listener.
    nbd: String,
    /// Every stdout line so far. A thread keeps draining stdout until the
    /// daemon exits, so its last lines never hit a closed pipe.
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<JoinHandle<()>>,
}

impl Server {
    fn start(data_dir: &Path) -> Server {
        let mut child = Command::new(BIN)
            .args(["serve", "--data-dir"])
            .arg(data_dir)
            .args([
                "--nbd",
                "127.0.0.1:0",
                "--api",
                "127.0.0.1:0",
                "--iscsi",
                "127.0.0.1:0",
                "--nfs",
                "127.0.0.1:0",
            ])
            .env("STRATA_LOG", "warn")
            .env("STRATA_RAM_DIR", data_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn strata serve");
        let stdout = child.stdout.take().expect("stdout piped");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (found, addresses) = mpsc::channel();
        let reader = {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if let Some(address) = line.strip_prefix("strata: nbd listening on ") {
                        let _ = found.send(("nbd", address.trim().to_string()));
                    }
                    if let Some(address) = line.strip_prefix("strata: api listening on http://") {
                        let _ = found.send(("api", address.trim().to_string()));
                    }
                    lines.lock().unwrap().push(line);
                }
            })
        };
        let mut server = Server {
            child: Some(child),
            api: String::new(),
            data_dir: data_dir.to_path_buf(),
            nbd: String::new(),
            lines,
            reader: Some(reader),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while server.api.is_empty() || server.nbd.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match addresses.recv_timeout(left) {
                Ok(("api", address)) => server.api = address,
                Ok((_, address)) => server.nbd = address,
                Err(_) => panic!(
                    "strata serve did not report its addresses; stdout so far: {:?}",
                    server.lines.lock().unwrap()
                ),
            }
        }
        common::remember_token(&server.api, data_dir);
        server
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().expect("server running").id() as i32
    }

    /// SIGTERM, then waits for the exit; returns the status and stdout.
    fn stop(mut self) -> (ExitStatus, Vec<String>) {
        // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
        let rc = unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        assert_eq!(rc, 0, "kill(SIGTERM) failed");
        let mut child = self.child.take().expect("server running");
        let deadline = Instant::now() + STOP_TIMEOUT;
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for strata serve") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("strata serve did not exit within {STOP_TIMEOUT:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let lines = self.lines.lock().unwrap().clone();
        (status, lines)
    }

    /// Runs `strata ARGS...` against this server over TCP (`STRATA_API`),
    /// with the token the CLI finds in `STRATA_DATA_DIR`, as a local admin's
    /// script would.
    fn cli(&self, args: &[&str]) -> Outcome {
        run_cli_with(args, Some(&self.api), Some(&self.data_dir))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[derive(Debug)]
struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Outcome {
    #[track_caller]
    fn ok(&self) -> &str {
        assert_eq!(self.code, Some(0), "expected success, got {self:#?}");
        // The one warning a success may print comes from the host, not the
        // test: the file system the test's device files sit on (the
        // machine's own, shared) has under 10 % free. Anything else on
        // stderr is a defect.
        let unexpected: Vec<&str> = self
            .stderr
            .lines()
            .filter(|line| !(line.starts_with("strata: warning: ") && line.contains(": its file system has ")))
            .collect();
        assert!(unexpected.is_empty(), "unexpected stderr: {self:#?}");
        &self.stdout
    }

    /// Asserts the failure contract: exit status 1, nothing on stdout, exactly
    /// one line `strata: error: ...` on stderr that contains `needle`.
    #[track_caller]
    fn fails_with(&self, needle: &str) -> &str {
        assert_eq!(self.code, Some(1), "expected exit status 1, got {self:#?}");
        assert!(self.stdout.is_empty(), "stdout should be empty on error: {self:#?}");
        assert!(
            self.stderr.ends_with('\n'),
            "stderr should end with a newline: {self:#?}"
        );
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "error should be exactly one line: {self:#?}");
        let message = lines[0]
            .strip_prefix("strata: error: ")
            .unwrap_or_else(|| panic!("error line should start with 'strata: error: ': {self:#?}"));
        assert!(message.contains(needle), "error should mention {needle:?}: {self:#?}");
        message
    }

    #[track_caller]
    fn json(&self) -> Value {
        serde_json::from_str(self.ok()).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:#?}"))
    }
}

fn run_cli(args: &[&str], api: Option<&str>) -> Outcome {
    run_cli_with(args, api, None)
}

/// The CLI with nothing from the test's own environment: no token, and a
/// data directory that is this server's or none at all.
fn run_cli_with(args: &[&str], api: Option<&str>, data_dir: Option<&Path>) -> Outcome {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_remove("STRATA_API")
        .env_remove("STRATA_TOKEN")
        .env_remove("STRATA_CACERT")
        .env(
            "STRATA_DATA_DIR",
            data_dir.unwrap_or(Path::new("/nonexistent/strata-data")),
        )
        .stdin(Stdio::null());
    if let Some(api) = api {
        command.env("STRATA_API", api);
    }
    let output = command.output().expect("run strata");
    Outcome {
        code: output.status.code(),
        stdout: String::from_utf8(output.stdout).expect("stdout is UTF-8"),
        stderr: String::from_utf8(output.stderr).expect("stderr is UTF-8"),
    }
}

/// Splits a table into rows of whitespace-separated cells (header first).
fn table(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .map(|line| line.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// The row of `table` whose first cell is `name`, as header -> cell.
fn row(text: &str, name: &str) -> Option<Vec<(String, String)>> {
    let rows = table(text);
    let header = rows.first()?.clone();
    let found = rows
        .iter()
        .skip(1)
        .find(|r| r.first().map(String::as_str) == Some(name))?;
    assert_eq!(found.len(), header.len(), "row and header differ in width:\n{text}");
    Some(header.into_iter().zip(found.iter().cloned()).collect())
}

fn cell(row: &[(String, String)], column: &str) -> String {
    row.iter()
        .find(|(h, _)| h == column)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no column {column} in {row:?}"))
}

/// `volume get` rows as (property, value, source).
fn properties(text: &str, volume: &str) -> Vec<(String, String, String)> {
    let rows = table(text);
    assert_eq!(rows[0], ["NAME", "PROPERTY", "VALUE", "SOURCE"], "get header:\n{text}");
    rows[1..]
        .iter()
        .map(|r| {
            assert_eq!(r.len(), 4, "get row:\n{text}");
            assert_eq!(r[0], volume);
            (r[1].clone(), r[2].clone(), r[3].clone())
        })
        .collect()
}

fn prop(text: &str, volume: &str, property: &str) -> (String, String) {
    properties(text, volume)
        .into_iter()
        .find(|(p, _, _)| p == property)
        .map(|(_, v, s)| (v, s))
        .unwrap_or_else(|| panic!("no property {property} in:\n{text}"))
}

fn json_property(info: &Value, property: &str) -> (String, String) {
    let row = info["properties"]
        .as_array()
        .expect("properties array")
        .iter()
        .find(|r| r["property"] == property)
        .unwrap_or_else(|| panic!("no property {property} in {info}"));
    (
        row["value"].as_str().unwrap().to_string(),
        row["source"].as_str().unwrap().to_string(),
    )
}

/// A raw HTTP/1.1 exchange: (status, headers lowercased, body).
fn http(api: &str, method: &str, path: &str, content_type: Option<&str>, body: &str) -> (u16, String, String) {
    let mut stream = TcpStream::connect(api).expect("connect to the API");
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: {api}\r\nConnection: close\r\n");
    if let Some(token) = common::token_for(api) {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    if let Some(content_type) = content_type {
        request.push_str(&format!("Content-Type: {content_type}\r\n"));
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("read the answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("HTTP answer has a head");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {head:?}"));
    (status, head.to_ascii_lowercase(), body.to_string())
}

/// The `error` message of a JSON error body.
#[track_caller]
fn error_message(body: &str) -> String {
    let value: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("error body is not JSON ({e}): {body}"));
    let message = value["error"]
        .as_str()
        .unwrap_or_else(|| panic!("no 'error' string in {body}"))
        .to_string();
    assert_eq!(
        value.as_object().unwrap().len(),
        1,
        "error body has only 'error': {body}"
    );
    assert!(!message.contains('\n'));
    message
}

#[test]
fn volume_lifecycle() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());

    // The first start made default/vol0 (10 GiB).
    let list = server.cli(&["volume", "list"]).ok().to_string();
    let header = &table(&list)[0];
    assert_eq!(
        header,
        &[
            "NAME",
            "VOLSIZE",
            "USED",
            "VOLBLOCKSIZE",
            "SYNC",
            "LOGBIAS",
            "WCE",
            "CONNECTIONS"
        ]
    );
    let vol0 = row(&list, "default/vol0").expect("default/vol0 listed");
    assert_eq!(cell(&vol0, "VOLSIZE"), "10G");
    assert_eq!(cell(&vol0, "VOLBLOCKSIZE"), "16K");
    assert_eq!(cell(&vol0, "SYNC"), "standard");

    // Create with properties; human create prints nothing.
    let created = server.cli(&[
        "volume",
        "create",
        "default/db",
        "--size",
        "1G",
        "-o",
        "sync=always",
        "-o",
        "volblocksize=64K",
    ]);
    assert_eq!(created.ok(), "");

    let list = server.cli(&["volume", "list"]).ok().to_string();
    let db = row(&list, "default/db").expect("default/db listed");
    assert_eq!(cell(&db, "VOLSIZE"), "1G");
    assert_eq!(cell(&db, "VOLBLOCKSIZE"), "64K");
    assert_eq!(cell(&db, "SYNC"), "always");
    assert_eq!(cell(&db, "WCE"), "on");
    assert_eq!(cell(&db, "CONNECTIONS"), "0");
    // Columns are aligned: every VOLSIZE cell ends where the header does.
    let lines: Vec<&str> = list.lines().collect();
    let volsize_end = lines[0].find("VOLSIZE").unwrap() + "VOLSIZE".len();
    for line in &lines[1..] {
        let before = &line[..volsize_end];
        assert!(
            before.ends_with("1G") || before.ends_with("10G"),
            "VOLSIZE column not right-aligned:\n{list}"
        );
    }

    // JSON output, both spellings; it is the API's VolumeInfo list.
    for flags in [&["-o", "json"][..], &["--json"][..]] {
        let mut args = vec!["volume", "list"];
        args.extend_from_slice(flags);
        let volumes = server.cli(&args).json();
        let volumes = volumes.as_array().expect("a JSON array");
        let names: Vec<&str> = volumes.iter().map(|v| v["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["default/db", "default/vol0"]);
        assert_eq!(volumes[0]["volsize"], 1u64 << 30);
        assert_eq!(volumes[0]["volblocksize"], 65536);
        assert_eq!(volumes[0]["pool"], "default");
        assert_eq!(json_property(&volumes[0], "sync"), ("always".into(), "local".into()));
    }
    // Filtering by pool and by volume.
    let only = server.cli(&["volume", "list", "default/db", "--json"]).json();
    assert_eq!(only.as_array().unwrap().len(), 1);
    assert_eq!(only[0]["name"], "default/db");
    let pool = server.cli(&["volume", "ls", "default"]).ok().to_string();
    assert!(row(&pool, "default/db").is_some() && row(&pool, "default/vol0").is_some());

    // get: every property with its source.
    let get = server.cli(&["volume", "get", "default/db"]).ok().to_string();
    let all = properties(&get, "default/db");
    let names: Vec<&str> = all.iter().map(|(p, _, _)| p.as_str()).collect();
    assert_eq!(
        names,
        [
            "volsize",
            "volblocksize",
            "sync",
            "logbias",
            "wce",
            "compression",
            "iscsi.auth",
            "iscsi.chap_user",
            "iscsi.chap_secret",
            "iscsi.mutual_user",
            "iscsi.mutual_secret",
            "iscsi.initiators",
            "nbd.tls_identities",
            "snapshot.schedule",
            "tier",
            "origin",
            "used",
            "referenced",
            "usedbydataset",
            "usedbysnapshots",
            "written",
            "used.fast",
            "used.capacity"
        ]
    );
    assert_eq!(prop(&get, "default/db", "volsize"), ("1G".into(), "local".into()));
    assert_eq!(prop(&get, "default/db", "volblocksize"), ("64K".into(), "local".into()));
    assert_eq!(prop(&get, "default/db", "sync"), ("always".into(), "local".into()));
    assert_eq!(
        prop(&get, "default/db", "logbias"),
        ("latency".into(), "default".into())
    );
    assert_eq!(prop(&get, "default/db", "wce"), ("on".into(), "default".into()));
    assert_eq!(
        prop(&get, "default/db", "compression"),
        ("off".into(), "default".into())
    );
    // get of named properties, in the order asked.
    let some = server
        .cli(&["volume", "get", "default/db", "wce", "sync"])
        .ok()
        .to_string();
    let rows = properties(&some, "default/db");
    assert_eq!(
        rows,
        [
            ("wce".to_string(), "on".to_string(), "default".to_string()),
            ("sync".to_string(), "always".to_string(), "local".to_string())
        ]
    );

    // set, then get shows the value with source local.
    assert_eq!(
        server
            .cli(&["volume", "set", "default/db", "wce=off", "logbias=throughput"])
            .ok(),
        ""
    );
    let get = server.cli(&["volume", "get", "default/db"]).ok().to_string();
    assert_eq!(prop(&get, "default/db", "wce"), ("off".into(), "local".into()));
    assert_eq!(
        prop(&get, "default/db", "logbias"),
        ("throughput".into(), "local".into())
    );
    assert_eq!(prop(&get, "default/db", "sync"), ("always".into(), "local".into()));
    let json = server.cli(&["volume", "get", "default/db", "wce", "-o", "json"]).json();
    assert_eq!(json["name"], "default/db");
    assert_eq!(json["properties"].as_array().unwrap().len(), 1);
    assert_eq!(json_property(&json, "wce"), ("off".into(), "local".into()));
    // set --json answers with the updated volume.
    let json = server
        .cli(&["volume", "set", "default/db", "sync=standard", "--json"])
        .json();
    assert_eq!(json_property(&json, "sync"), ("standard".into(), "local".into()));

    // resize: grow with --size and positionally; shrinking is refused.
    assert_eq!(server.cli(&["volume", "resize", "default/db", "--size", "2G"]).ok(), "");
    let json = server.cli(&["volume", "get", "default/db", "--json"]).json();
    assert_eq!(json["volsize"], 2u64 << 30);
    let json = server
        .cli(&["volume", "resize", "default/db", "3G", "-o", "json"])
        .json();
    assert_eq!(json["volsize"], 3u64 << 30);
    let get = server.cli(&["volume", "get", "default/db", "volsize"]).ok().to_string();
    assert_eq!(prop(&get, "default/db", "volsize"), ("3G".into(), "local".into()));
    server
        .cli(&["volume", "resize", "default/db", "--size", "1G"])
        .fails_with("cannot shrink volume 'default/db'");
    let json = server.cli(&["volume", "get", "default/db", "--json"]).json();
    assert_eq!(json["volsize"], 3u64 << 30, "a refused shrink changes nothing");

    // delete: gone from list and get.
    assert_eq!(server.cli(&["volume", "delete", "default/db"]).ok(), "");
    let list = server.cli(&["volume", "list"]).ok().to_string();
    assert!(
        row(&list, "default/db").is_none(),
        "deleted volume still listed:\n{list}"
    );
    assert!(row(&list, "default/vol0").is_some());
    server
        .cli(&["volume", "get", "default/db"])
        .fails_with("volume 'default/db' does not exist");

    let (status, stdout) = server.stop();
    assert!(status.success(), "strata serve exited with {status}");
    assert!(
        stdout.iter().any(|l| l.starts_with("strata: stopped (SIGTERM)")),
        "no clean-stop line in {stdout:?}"
    );
}

#[test]
fn volumes_and_properties_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    server
        .cli(&["volume", "create", "default/keep", "--size", "64M", "-o", "wce=off"])
        .ok();
    server.cli(&["volume", "resize", "default/keep", "128M"]).ok();
    let (status, _) = server.stop();
    assert!(status.success());

    let server = Server::start(dir.path());
    let info = server.cli(&["volume", "get", "default/keep", "--json"]).json();
    assert_eq!(info["volsize"], 128u64 << 20);
    assert_eq!(json_property(&info, "wce"), ("off".into(), "local".into()));
    let (status, _) = server.stop();
    assert!(status.success());
}

#[test]
fn errors_are_one_line_with_exit_status_1() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());

    // Unknown property: on create, set and get.
    server
        .cli(&["volume", "create", "default/x", "--size", "1G", "-o", "colour=red"])
        .fails_with("unknown property 'colour'");
    server
        .cli(&["volume", "set", "default/vol0", "colour=red"])
        .fails_with("unknown property 'colour'");
    server
        .cli(&["volume", "get", "default/vol0", "colour"])
        .fails_with("unknown property 'colour'");

    // Two volumes with one iSCSI target name (names compare without case).
    server
        .cli(&["volume", "create", "default/VOL0", "--size", "1G"])
        .fails_with("would have the iSCSI target name of volume 'default/vol0'");

    // Bad values.
    server
        .cli(&["volume", "create", "default/x", "--size", "1G", "-o", "sync=sometimes"])
        .fails_with("bad value 'sometimes' for property 'sync'");
    server
        .cli(&["volume", "create", "default/x", "--size", "1G", "-o", "volblocksize=3K"])
        .fails_with("bad value '3K' for property 'volblocksize'");
    server
        .cli(&["volume", "set", "default/vol0", "wce=maybe"])
        .fails_with("bad value 'maybe' for property 'wce'");
    server
        .cli(&["volume", "set", "default/vol0", "compression=lz4"])
        .fails_with("bad value 'lz4' for property 'compression'");
    server
        .cli(&["volume", "set", "default/vol0", "volblocksize=32K"])
        .fails_with("can only be set when the volume is created");
    server
        .cli(&["volume", "set", "default/vol0", "sync"])
        .fails_with("expected property=value, got 'sync'");

    // Bad sizes are refused before anything is sent.
    server
        .cli(&["volume", "create", "default/x", "--size", "10X"])
        .fails_with("invalid size '10X'");
    server
        .cli(&["volume", "resize", "default/vol0", "1.2.3G"])
        .fails_with("invalid size '1.2.3G'");
    server
        .cli(&["volume", "set", "default/vol0", "volsize=lots"])
        .fails_with("invalid size 'lots'");
    server
        .cli(&["volume", "create", "default/x", "--size", "0"])
        .fails_with("volsize must be greater than zero");
    server
        .cli(&["volume", "create", "default/x", "--size", "1000"])
        .fails_with("not a multiple of volblocksize");
    // None of the refused creates left a volume behind.
    server
        .cli(&["volume", "get", "default/x"])
        .fails_with("volume 'default/x' does not exist");

    // Taken name.
    server
        .cli(&["volume", "create", "default/vol0", "--size", "1G"])
        .fails_with("volume 'default/vol0' already exists");

    // Missing volume / pool.
    for args in [
        &["volume", "get", "default/nope"][..],
        &["volume", "set", "default/nope", "sync=always"][..],
        &["volume", "resize", "default/nope", "--size", "20G"][..],
        &["volume", "delete", "default/nope"][..],
        &["volume", "list", "default/nope"][..],
    ] {
        server.cli(args).fails_with("volume 'default/nope' does not exist");
    }
    server
        .cli(&["volume", "create", "tank/x", "--size", "1G"])
        .fails_with("pool 'tank' does not exist");
    server
        .cli(&["pool", "status", "tank"])
        .fails_with("pool 'tank' does not exist");
    server
        .cli(&["volume", "list", "tank"])
        .fails_with("pool 'tank' does not exist");

    // Bad names and bad -o values.
    server
        .cli(&["volume", "create", "novolume", "--size", "1G"])
        .fails_with("expected POOL/NAME");
    server
        .cli(&["volume", "get", "default/a b"])
        .fails_with("invalid volume name 'a b'");
    server
        .cli(&["volume", "list", "-o", "yaml"])
        .fails_with("invalid -o value 'yaml'");
    server
        .cli(&["volume", "list", "-o", "sync=always"])
        .fails_with("only valid with 'volume create'");
    server
        .cli(&["volume", "set", "default/vol0", "-o", "sync=always", "wce=off"])
        .fails_with("only valid with 'volume create'");
    server
        .cli(&["pool", "status", "-o", "sync=always"])
        .fails_with("only valid with 'volume create'");
    // ... and none of the refused commands changed default/vol0.
    let info = server.cli(&["volume", "get", "default/vol0", "--json"]).json();
    assert_eq!(info["volsize"], 10u64 << 30);
    assert_eq!(json_property(&info, "sync"), ("standard".into(), "default".into()));
    assert_eq!(json_property(&info, "wce"), ("on".into(), "default".into()));

    // Bad --api values.
    run_cli(&["volume", "list", "--api", "https://127.0.0.1:1"], None).fails_with("no certificate to trust");
    run_cli(&["volume", "list", "--api", "ftp://127.0.0.1:1"], None).fails_with("use HOST:PORT");
    run_cli(&["volume", "list", "--api", "127.0.0.1:notaport"], None).fails_with("bad port");

    let (status, _) = server.stop();
    assert!(status.success());
}

#[test]
fn unreachable_daemon() {
    let port = {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let address = format!("127.0.0.1:{port}");
    let expected = format!(
        "cannot reach the strata daemon at {address} (connection refused); is 'strata serve' running? set --api or STRATA_API"
    );
    // Through --api (both spellings) and through STRATA_API.
    for args in [
        &["volume", "list", "--api", &address][..],
        &["volume", "get", "default/vol0", "--api", &format!("http://{address}")][..],
        &["pool", "status", "--api", &format!("http://{address}/")][..],
    ] {
        let message = run_cli(args, None).fails_with(&expected).to_string();
        assert_eq!(message, expected);
    }
    let outcome = run_cli(&["volume", "create", "default/x", "--size", "1G"], Some(&address));
    assert_eq!(outcome.fails_with(&expected), expected);
    // Argument errors are reported before the daemon is contacted.
    run_cli(&["volume", "create", "default/x", "--size", "1Q"], Some(&address)).fails_with("invalid size '1Q'");
}

/// A pool's status without what moves with the rest of the file system
/// under its device files (other tests write there too).
fn still(mut pool: Value) -> Value {
    for device in pool["devices"].as_array_mut().expect("devices") {
        device["backing"]["fs_free_bytes"] = Value::Null;
        device["unbackable_bytes"] = Value::Null;
    }
    pool
}

#[test]
fn pool_status() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    server.cli(&["volume", "create", "default/p", "--size", "2G"]).ok();

    let text = server.cli(&["pool", "status"]).ok().to_string();
    let default = row(&text, "default").expect("pool default listed");
    assert_eq!(cell(&default, "VOLUMES"), "2");
    assert_eq!(cell(&default, "PROVISIONED"), "12G");
    assert_eq!(cell(&default, "READ_ERRORS"), "0");
    assert_eq!(cell(&default, "WRITE_ERRORS"), "0");
    assert_eq!(cell(&default, "CKSUM_ERRORS"), "0");
    assert_eq!(cell(&default, "USED"), "0B");
    // The default pool: a fast and a capacity device, both data tiers.
    assert!(text.contains("fast.dev") && text.contains("capacity.dev"), "{text}");

    let all = server.cli(&["pool", "status", "--json"]).json();
    assert_eq!(all.as_array().unwrap().len(), 1);
    let one = server.cli(&["pool", "status", "default", "-o", "json"]).json();
    assert!(one["available_bytes"].as_u64().unwrap() > 0);
    // Free space moves with everything else on the file system; the rest must match.
    let mut first = still(all[0].clone());
    first["available_bytes"] = Value::Null;
    let mut still_one = still(one.clone());
    still_one["available_bytes"] = Value::Null;
    assert_eq!(still_one, first);
    assert_eq!(one["name"], "default");
    assert_eq!(one["volumes"], 2);
    assert_eq!(one["provisioned_bytes"], 12u64 << 30);
    let devices = one["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[0]["role"], "fast");
    assert_eq!(devices[1]["role"], "capacity");
    let path = devices[0]["name"].as_str().unwrap();
    assert!(path.starts_with(dir.path().to_str().unwrap()), "device path {path}");
    assert_eq!(
        one["size_bytes"].as_u64().unwrap(),
        devices.iter().map(|d| d["data_bytes"].as_u64().unwrap()).sum::<u64>()
    );

    let (status, _) = server.stop();
    assert!(status.success());
}

#[test]
fn rest_api() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let api = server.api.clone();

    // Metrics: Prometheus text; the HELP/TYPE lines are there before any I/O.
    let (status, head, body) = http(&api, "GET", "/metrics", None, "");
    assert_eq!(status, 200);
    assert!(head.contains("content-type: text/plain; version=0.0.4"), "{head}");
    assert!(
        body.contains("# TYPE strata_volume_latency_seconds histogram"),
        "{body}"
    );
    assert!(body.contains("# TYPE strata_volume_operations_total counter"), "{body}");
    // The NFS server runs: its duplicate-request cache is shown, empty.
    assert!(body.contains("\nstrata_nfs_drc_replays_total 0\n"), "{body}");
    assert!(body.contains("\nstrata_nfs_drc_entries 0\n"), "{body}");

    // Index.
    let (status, _, body) = http(&api, "GET", "/v1", None, "");
    assert_eq!(status, 200);
    let index: Value = serde_json::from_str(&body).unwrap();
    assert!(index["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e == "POST /v1/volumes"));

    // Malformed JSON and wrong shapes: 400 with {"error": ...}.
    let json = Some("application/json");
    let (status, head, body) = http(&api, "POST", "/v1/volumes", json, r#"{"name": "default/x", "size": "#);
    assert_eq!(status, 400, "{body}");
    assert!(head.contains("content-type: application/json"), "{head}");
    assert!(error_message(&body).starts_with("invalid JSON body"), "{body}");
    let (status, _, body) = http(&api, "POST", "/v1/volumes", json, r#"{"size": "1G"}"#);
    assert_eq!(status, 400);
    assert!(error_message(&body).contains("missing field `name`"), "{body}");
    let (status, _, body) = http(
        &api,
        "POST",
        "/v1/volumes",
        json,
        r#"{"name": "default/x", "size": "1X"}"#,
    );
    assert_eq!(status, 400);
    assert!(error_message(&body).contains("invalid size '1X'"), "{body}");
    let (status, _, body) = http(&api, "PATCH", "/v1/volumes/default/vol0", json, "[1, 2");
    assert_eq!(status, 400);
    assert!(error_message(&body).starts_with("invalid JSON body"), "{body}");
    let (status, _, body) = http(&api, "POST", "/v1/volumes/default/vol0/resize", json, "{}");
    assert_eq!(status, 400);
    assert!(error_message(&body).contains("missing field `size`"), "{body}");
    // A body that is not labelled JSON.
    let (status, _, body) = http(&api, "POST", "/v1/volumes", None, r#"{"name":"default/x","size":"1G"}"#);
    assert_eq!(status, 415);
    error_message(&body);

    // Status codes of the manager's errors.
    let (status, _, body) = http(&api, "GET", "/v1/volumes/default/nope", None, "");
    assert_eq!(status, 404);
    assert_eq!(error_message(&body), "volume 'default/nope' does not exist");
    let (status, _, body) = http(&api, "GET", "/v1/pools/tank", None, "");
    assert_eq!(status, 404);
    assert_eq!(error_message(&body), "pool 'tank' does not exist");
    let (status, _, body) = http(
        &api,
        "POST",
        "/v1/volumes",
        json,
        r#"{"name":"default/vol0","size":"1G"}"#,
    );
    assert_eq!(status, 409);
    assert_eq!(error_message(&body), "volume 'default/vol0' already exists");
    let (status, _, body) = http(&api, "GET", "/v1/nothing", None, "");
    assert_eq!(status, 404);
    error_message(&body);
    let (status, _, body) = http(&api, "PUT", "/v1/volumes/default/vol0", json, "{}");
    assert_eq!(status, 405);
    error_message(&body);

    // Create (size as a string, properties typed loosely), patch, resize
    // (size in bytes), delete.
    let (status, _, body) = http(
        &api,
        "POST",
        "/v1/volumes",
        json,
        r#"{"name":"default/r","size":"64M","properties":{"wce":false,"volblocksize":8192,"sync":"always"}}"#,
    );
    assert_eq!(status, 201, "{body}");
    let info: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(info["volsize"], 64u64 << 20);
    assert_eq!(info["volblocksize"], 8192);
    assert_eq!(json_property(&info, "wce"), ("off".into(), "local".into()));
    let (status, _, body) = http(
        &api,
        "PATCH",
        "/v1/volumes/default/r",
        json,
        r#"{"properties":{"logbias":"throughput"}}"#,
    );
    assert_eq!(status, 200, "{body}");
    let info: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json_property(&info, "logbias"), ("throughput".into(), "local".into()));
    let (status, _, body) = http(
        &api,
        "POST",
        "/v1/volumes/default/r/resize",
        json,
        r#"{"size":134217728}"#,
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["volsize"], 128u64 << 20);
    let (status, _, body) = http(&api, "GET", "/v1/volumes?pool=default", None, "");
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap().as_array().unwrap().len(),
        2
    );
    let (status, _, body) = http(&api, "DELETE", "/v1/volumes/default/r", None, "");
    assert_eq!(status, 204);
    assert!(body.is_empty());
    let (status, _, _) = http(&api, "GET", "/v1/volumes/default/r", None, "");
    assert_eq!(status, 404);

    let (status, _) = server.stop();
    assert!(status.success());
}

/// Opens an NBD connection to `export` with the oldest way to pick an export
/// (fixed newstyle handshake, NBD_OPT_EXPORT_NAME); returns the socket in the
/// transmission phase and the export size the server announced.
fn nbd_connect(address: &str, export: &str) -> (TcpStream, u64) {
    const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
    const FLAG_FIXED_NEWSTYLE: u32 = 1;
    const FLAG_NO_ZEROES: u32 = 2;
    const OPT_EXPORT_NAME: u32 = 1;
    let mut stream = TcpStream::connect(address).expect("connect to NBD");
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).expect("NBD greeting");
    assert_eq!(&greeting[..8], b"NBDMAGIC");
    assert_eq!(u64::from_be_bytes(greeting[8..16].try_into().unwrap()), IHAVEOPT);
    let mut out = (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes().to_vec();
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
    out.extend_from_slice(&(export.len() as u32).to_be_bytes());
    out.extend_from_slice(export.as_bytes());
    stream.write_all(&out).unwrap();
    let mut answer = [0u8; 10];
    stream.read_exact(&mut answer).expect("NBD export size and flags");
    (stream, u64::from_be_bytes(answer[..8].try_into().unwrap()))
}

/// Polls `volume get --json` until `connections` is `want`.
fn wait_for_connections(server: &Server, volume: &str, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = server.cli(&["volume", "get", volume, "--json"]).json();
        if info["connections"] == want {
            return;
        }
        assert!(Instant::now() < deadline, "connections never became {want}: {info}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_connected_volume_is_busy() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    server.cli(&["volume", "create", "default/busy", "--size", "64M"]).ok();

    let (connection, size) = nbd_connect(&server.nbd, "default/busy");
    assert_eq!(size, 64 << 20);
    wait_for_connections(&server, "default/busy", 1);
    let list = server.cli(&["volume", "list"]).ok().to_string();
    assert_eq!(cell(&row(&list, "default/busy").unwrap(), "CONNECTIONS"), "1");

    server
        .cli(&["volume", "delete", "default/busy"])
        .fails_with("volume 'default/busy' is busy: 1 client connection(s) open");
    let (status, _, body) = http(&server.api, "DELETE", "/v1/volumes/default/busy", None, "");
    assert_eq!(status, 409);
    assert!(error_message(&body).contains("is busy"), "{body}");
    // Properties can still change while connected; the volume is still there.
    server.cli(&["volume", "set", "default/busy", "sync=always"]).ok();
    server.cli(&["volume", "resize", "default/busy", "128M"]).ok();

    drop(connection);
    wait_for_connections(&server, "default/busy", 0);
    server.cli(&["volume", "delete", "default/busy"]).ok();
    server
        .cli(&["volume", "get", "default/busy"])
        .fails_with("volume 'default/busy' does not exist");

    let (status, _) = server.stop();
    assert!(status.success());
}

/// One NBD request with a simple reply on a connection from `nbd_connect`:
/// `NBD_CMD_WRITE` of `data`, or `NBD_CMD_READ` of `read` bytes. Returns the
/// reply's error (0 = success) and the data read.
fn nbd_request(stream: &mut TcpStream, offset: u64, data: &[u8], read: u32) -> (u32, Vec<u8>) {
    const REQUEST_MAGIC: u32 = 0x2560_9513;
    const REPLY_MAGIC: u32 = 0x6744_6698;
    let (command, length) = if read > 0 {
        (0u16, read)
    } else {
        (1u16, data.len() as u32)
    };
    let mut out = REQUEST_MAGIC.to_be_bytes().to_vec();
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&command.to_be_bytes());
    out.extend_from_slice(&7u64.to_be_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(data);
    stream.write_all(&out).unwrap();
    let mut reply = [0u8; 16];
    stream.read_exact(&mut reply).expect("NBD reply");
    assert_eq!(u32::from_be_bytes(reply[..4].try_into().unwrap()), REPLY_MAGIC);
    let error = u32::from_be_bytes(reply[4..8].try_into().unwrap());
    let mut payload = vec![0u8; if error == 0 { read as usize } else { 0 }];
    stream.read_exact(&mut payload).expect("NBD read payload");
    (error, payload)
}

/// 1 MiB of data for MiB number `index` of the test volume.
fn mib_pattern(index: u64) -> Vec<u8> {
    (0..1u64 << 20)
        .map(|i| (i.wrapping_mul(31) ^ index.wrapping_mul(0x9e37) ^ (i >> 12)) as u8)
        .collect()
}

#[test]
fn pool_add_device_online() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let file = |name: &str, bytes: u64| common::sparse_file(dir.path(), name, bytes);
    // Chunk 0 + 32 MiB metadata + 64 MiB log + 4 data chunks of 1 MiB.
    let fast = file("fast.img", 101 << 20);
    let capacity = file("capacity.img", 32 << 20);
    let fast2 = file("fast2.img", 8 << 20);
    let tiny = file("tiny.img", 4 << 20);
    let huge = file("huge.img", 8 << 30);
    let server = Server::start(&data);
    server.cli(&["pool", "create", "tank", "--fast", &fast]).ok();
    // The space figures below are exact: no blocks moving between tiers
    // (which hold two slots each until the move commits).
    server.cli(&["pool", "set", "tank", "migration=off"]).ok();
    server.cli(&["volume", "create", "tank/v", "--size", "64M"]).ok();

    // A client fills the pool and stays connected.
    let (mut nbd, _) = nbd_connect(&server.nbd, "tank/v");
    for mib in 0..4 {
        assert_eq!(nbd_request(&mut nbd, mib << 20, &mib_pattern(mib), 0).0, 0, "MiB {mib}");
    }
    const ENOSPC: u32 = 28;
    assert_eq!(nbd_request(&mut nbd, 4 << 20, &mib_pattern(4), 0).0, ENOSPC);
    wait_for_connections(&server, "tank/v", 1);
    let pool_state = || still(server.cli(&["pool", "status", "tank", "--json"]).json());
    let before = pool_state();
    assert_eq!(before["size_bytes"], 4u64 << 20);
    assert_eq!(before["available_bytes"], 0);

    // Errors: one line, exit status 1, and the right HTTP status; nothing changes.
    server
        .cli(&["pool", "add-device", "nope", "--capacity", &capacity])
        .fails_with("pool 'nope' does not exist");
    server
        .cli(&["pool", "add-device", "tank", "--capacity", &fast])
        .fails_with("already part of pool 'tank'");
    let default_capacity = data.join("pools/default/capacity.dev");
    server
        .cli(&[
            "pool",
            "add-device",
            "tank",
            "--fast",
            default_capacity.to_str().unwrap(),
        ])
        .fails_with("already part of pool 'default'");
    server
        .cli(&["pool", "add-device", "tank", "--capacity", &tiny])
        .fails_with("is too small");
    server
        .cli(&["pool", "add-device", "tank", "--capacity", &huge])
        .fails_with("metadata region");
    server
        .cli(&[
            "pool",
            "add-device",
            "tank",
            "--capacity",
            dir.path().join("absent.img").to_str().unwrap(),
        ])
        .fails_with("cannot open device");
    server
        .cli(&["pool", "add-device", "tank", "--log", &capacity])
        .fails_with("a log device cannot be added to an existing pool");
    server
        .cli(&["pool", "add-device", "tank", "--ram", "1G"])
        .fails_with("a RAM tier cannot be added");
    server
        .cli(&["pool", "add-device", "bad name", "--capacity", &capacity])
        .fails_with("invalid pool name");
    // Usage errors: exit status 2 (clap).
    for args in [
        &["pool", "add-device", "tank", &capacity][..],
        &[
            "pool",
            "add-device",
            "tank",
            "--fast",
            &capacity,
            "--capacity",
            &capacity,
        ][..],
    ] {
        assert_eq!(server.cli(args).code, Some(2), "{args:?}");
    }
    let json = Some("application/json");
    let post = |pool: &str, body: &str| {
        let (status, _, body) = http(&server.api, "POST", &format!("/v1/pools/{pool}/devices"), json, body);
        (status, error_message(&body))
    };
    let body = |path: &str, role: &str| format!(r#"{{"path": "{path}", "role": "{role}"}}"#);
    let (status, message) = post("nope", &body(&capacity, "capacity"));
    assert_eq!((status, message.as_str()), (404, "pool 'nope' does not exist"));
    let (status, message) = post("tank", &body(&fast, "fast"));
    assert_eq!(status, 409, "{message}");
    let (status, message) = post("tank", &body(&tiny, "capacity"));
    assert_eq!(status, 400, "{message}");
    let (status, message) = post("tank", &body(&huge, "capacity"));
    assert_eq!(status, 400, "{message}");
    for (role, needle) in [
        ("log", "the log's place is fixed when the pool is created"),
        ("ram", "a RAM tier cannot be added"),
        ("bogus", "unknown device role 'bogus'"),
    ] {
        let (status, message) = post("tank", &body(&capacity, role));
        assert_eq!(status, 400, "{message}");
        assert!(message.contains(needle), "{message}");
    }
    let (status, message) = post("tank", r#"{"path": "/x", "role": "fast", "size": 1}"#);
    assert_eq!(status, 400, "{message}");
    let (status, _, _) = http(&server.api, "GET", "/v1/pools/tank/devices", None, "");
    assert_eq!(status, 405);
    assert_eq!(pool_state(), before);

    // The addition itself, while the client is connected.
    let added = server
        .cli(&["pool", "add-device", "tank", "--capacity", &capacity, "--json"])
        .json();
    assert_eq!(added["size_bytes"], 35u64 << 20, "4 + 31 data chunks");
    let devices = added["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[1]["role"], "capacity");
    assert_eq!(devices[1]["name"], capacity.as_str());
    server
        .cli(&["pool", "add-device", "tank", "--capacity", &capacity])
        .fails_with("already part of pool 'tank'");
    // Without --json it prints nothing, like the other changes.
    assert_eq!(server.cli(&["pool", "add-device", "tank", "--fast", &fast2]).ok(), "");
    // The same connection writes on: the pool has room again.
    for mib in 4..20 {
        assert_eq!(nbd_request(&mut nbd, mib << 20, &mib_pattern(mib), 0).0, 0, "MiB {mib}");
    }
    for mib in 0..20 {
        let (error, read) = nbd_request(&mut nbd, mib << 20, &[], 1 << 20);
        assert_eq!(error, 0);
        assert!(read == mib_pattern(mib), "MiB {mib} differs");
    }
    let text = server.cli(&["pool", "status", "tank"]).ok().to_string();
    assert!(text.contains("capacity.img") && text.contains("fast2.img"), "{text}");
    let catalog = std::fs::read_to_string(data.join("catalog.json")).unwrap();
    assert!(
        catalog.contains(&capacity) && catalog.contains(&fast2) && !catalog.contains("\"adding\""),
        "{catalog}"
    );
    drop(nbd);

    // After a restart the pool opens with both devices and the data is there.
    let (status, _) = server.stop();
    assert!(status.success());
    let server = Server::start(&data);
    let after = server.cli(&["pool", "status", "tank", "--json"]).json();
    assert_eq!(after["devices"].as_array().unwrap().len(), 3);
    assert_eq!(after["size_bytes"], 42u64 << 20, "4 + 31 + 7 data chunks");
    assert_eq!(after["used_bytes"], 20u64 << 20, "{after:#}");
    let (mut nbd, _) = nbd_connect(&server.nbd, "tank/v");
    for mib in 0..20 {
        let (error, read) = nbd_request(&mut nbd, mib << 20, &[], 1 << 20);
        assert_eq!(error, 0);
        assert!(read == mib_pattern(mib), "MiB {mib} differs after the restart");
    }
    drop(nbd);
    let (status, _) = server.stop();
    assert!(status.success());
}

/// Rewrites `catalog.json` through `edit` (the daemon must be stopped).
fn edit_catalog(data: &Path, edit: impl FnOnce(&mut Value)) {
    let path = data.join("catalog.json");
    let mut catalog: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut catalog);
    std::fs::write(&path, serde_json::to_string_pretty(&catalog).unwrap()).unwrap();
}

#[test]
fn an_interrupted_pool_add_device_is_settled_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let file = |name: &str, bytes: u64| common::sparse_file(dir.path(), name, bytes);
    let fast = file("fast.img", 101 << 20);
    let capacity = file("capacity.img", 32 << 20);
    let blank = file("blank.img", 32 << 20);
    let server = Server::start(&data);
    server.cli(&["pool", "create", "tank", "--fast", &fast]).ok();
    server
        .cli(&["pool", "add-device", "tank", "--capacity", &capacity])
        .ok();
    assert!(server.stop().0.success());

    // A crash after the superblocks were written but before the catalog
    // moved the device from "adding" to "devices": the start completes it.
    edit_catalog(&data, |catalog| {
        let tank = &mut catalog["pools"]["tank"];
        let device = tank["devices"].as_array_mut().unwrap().pop().unwrap();
        assert_eq!(device["path"], capacity.as_str());
        tank["adding"] = device;
    });
    let server = Server::start(&data);
    let status = server.cli(&["pool", "status", "tank", "--json"]).json();
    assert_eq!(status["devices"].as_array().unwrap().len(), 2);
    assert!(server.stop().0.success());
    let catalog = std::fs::read_to_string(data.join("catalog.json")).unwrap();
    assert!(
        catalog.contains(&capacity) && !catalog.contains("\"adding\""),
        "{catalog}"
    );

    // A crash before any superblock named the device: the start drops it.
    edit_catalog(&data, |catalog| {
        catalog["pools"]["tank"]["adding"] = serde_json::json!({ "path": blank, "role": "capacity" });
    });
    let server = Server::start(&data);
    let status = server.cli(&["pool", "status", "tank", "--json"]).json();
    assert_eq!(status["devices"].as_array().unwrap().len(), 2);
    // The dropped device can be added for real.
    server.cli(&["pool", "add-device", "tank", "--capacity", &blank]).ok();
    assert!(server.stop().0.success());
    let catalog = std::fs::read_to_string(data.join("catalog.json")).unwrap();
    assert!(catalog.contains(&blank) && !catalog.contains("\"adding\""), "{catalog}");

    // A catalog that lost a device the superblocks list: a clear refusal.
    edit_catalog(&data, |catalog| {
        catalog["pools"]["tank"]["devices"].as_array_mut().unwrap().pop();
    });
    let output = Command::new(BIN)
        .args(["serve", "--data-dir"])
        .arg(&data)
        .args([
            "--nbd",
            "127.0.0.1:0",
            "--api",
            "127.0.0.1:0",
            "--iscsi",
            "127.0.0.1:0",
            "--nfs",
            "127.0.0.1:0",
        ])
        .env("STRATA_LOG", "warn")
        .env("STRATA_RAM_DIR", &data)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("pool tank: pool 'tank' is missing its capacity device") && stderr.contains("catalog.json"),
        "{stderr}"
    );
}

/// `fs get` rows as (property, value).
fn fs_properties(text: &str, dataset: &str) -> Vec<(String, String)> {
    let rows = table(text);
    assert_eq!(rows[0], ["NAME", "PROPERTY", "VALUE"], "fs get header:\n{text}");
    rows[1..]
        .iter()
        .map(|r| {
            assert_eq!(r.len(), 3, "fs get row:\n{text}");
            assert_eq!(r[0], dataset);
            (r[1].clone(), r[2].clone())
        })
        .collect()
}

#[test]
fn fs_lifecycle() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());

    // A fresh data directory has default/files (id 2) beside default/vol0.
    let list = server.cli(&["fs", "list"]).ok().to_string();
    assert_eq!(table(&list)[0], ["NAME", "EXPORT", "FILES", "USED", "QUOTA"]);
    let files = row(&list, "default/files").expect("default/files listed");
    assert_eq!(cell(&files, "EXPORT"), "/default/files");
    assert_eq!(cell(&files, "QUOTA"), "none");
    let json = server.cli(&["fs", "list", "--json"]).json();
    let all = json.as_array().expect("a JSON array");
    assert_eq!(all.len(), 1, "{json}");
    assert_eq!(all[0]["name"], "default/files");
    assert_eq!(all[0]["id"], 2);
    assert_eq!(all[0]["export"], "/default/files");

    // Create with properties; human create prints nothing.
    let created = server.cli(&["fs", "create", "default/docs", "-o", "quota=1G", "-o", "nfs.ro=on"]);
    assert_eq!(created.ok(), "");
    let list = server.cli(&["fs", "ls"]).ok().to_string();
    let docs = row(&list, "default/docs").expect("default/docs listed");
    assert_eq!(cell(&docs, "EXPORT"), "/default/docs");
    assert_eq!(cell(&docs, "QUOTA"), "1G");
    assert!(cell(&docs, "FILES").parse::<u64>().is_ok(), "{list}");
    assert!(cell(&docs, "USED").ends_with(['B', 'K', 'M']), "{list}");
    assert!(row(&list, "default/files").is_some());

    // get: every property in the documented order, or the ones asked for.
    let get = server.cli(&["fs", "get", "default/docs"]).ok().to_string();
    let names: Vec<String> = fs_properties(&get, "default/docs")
        .into_iter()
        .map(|(p, _)| p)
        .collect();
    assert_eq!(
        names,
        [
            "recordsize",
            "quota",
            "nfs.clients",
            "nfs.ro",
            "nfs.squash",
            "nfs.anonuid",
            "nfs.anongid",
            "nfs.insecure",
            "snapshot.schedule"
        ]
    );
    let one = server.cli(&["fs", "get", "default/docs", "quota"]).ok().to_string();
    assert_eq!(
        fs_properties(&one, "default/docs"),
        [("quota".to_string(), "1G".to_string())]
    );
    let one = server.cli(&["fs", "get", "default/docs", "nfs.ro"]).ok().to_string();
    assert_eq!(
        fs_properties(&one, "default/docs"),
        [("nfs.ro".to_string(), "on".to_string())]
    );
    let json = server.cli(&["fs", "get", "default/docs", "quota", "--json"]).json();
    assert_eq!(json["name"], "default/docs");
    assert_eq!(json["properties"], serde_json::json!({ "quota": "1073741824" }));

    // set, then get shows it; --json answers with the dataset.
    assert_eq!(server.cli(&["fs", "set", "default/docs", "nfs.squash=all"]).ok(), "");
    let one = server
        .cli(&["fs", "get", "default/docs", "nfs.squash"])
        .ok()
        .to_string();
    assert_eq!(
        fs_properties(&one, "default/docs"),
        [("nfs.squash".to_string(), "all".to_string())]
    );
    let json = server
        .cli(&["fs", "set", "default/docs", "nfs.anonuid=1000", "--json"])
        .json();
    assert_eq!(json["properties"]["nfs.anonuid"], "1000");
    assert_eq!(json["properties"]["nfs.squash"], "all");

    // Refusals: one line, exit status 1, nothing changed.
    server
        .cli(&["fs", "create", "default/bad", "-o", "recordsize=3K"])
        .fails_with("recordsize must be a power of two from 4K to 128K");
    server
        .cli(&["fs", "create", "default/bad", "-o", "colour=red"])
        .fails_with("unknown dataset property \"colour\"");
    server
        .cli(&["fs", "set", "default/docs", "colour=red"])
        .fails_with("unknown dataset property \"colour\"");
    server
        .cli(&["fs", "set", "default/docs", "recordsize=64K"])
        .fails_with("recordsize is set when a dataset is created and cannot change");
    server
        .cli(&["fs", "set", "default/docs", "nfs.squash=some"])
        .fails_with("some");
    server
        .cli(&["fs", "get", "default/docs", "colour"])
        .fails_with("unknown dataset property 'colour'");
    server
        .cli(&["fs", "create", "default/docs"])
        .fails_with("'default/docs' already exists");
    server
        .cli(&["fs", "create", "default/vol0"])
        .fails_with("'default/vol0' already exists");
    server
        .cli(&["fs", "create", "nopool/docs"])
        .fails_with("pool 'nopool' does not exist");
    server
        .cli(&["fs", "create", "docs"])
        .fails_with("invalid dataset name 'docs': expected POOL/NAME");
    server
        .cli(&["fs", "set", "default/docs", "nfs.ro=off", "-o", "quota=2G"])
        .fails_with("only valid with 'fs create'; use 'strata fs set POOL/NAME quota=2G'");
    let list = server.cli(&["fs", "list"]).ok().to_string();
    assert!(row(&list, "default/bad").is_none(), "{list}");
    let json = server.cli(&["fs", "get", "default/docs", "--json"]).json();
    assert_eq!(json["properties"]["recordsize"], "16384");
    assert_eq!(json["properties"]["nfs.ro"], "on");

    // The REST API: the same objects, the usual statuses.
    let api = server.api.clone();
    let json_type = Some("application/json");
    let (status, _, body) = http(&api, "GET", "/v1/filesystems/default/files", None, "");
    assert_eq!(status, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["id"], 2);
    let (status, _, body) = http(
        &api,
        "POST",
        "/v1/filesystems",
        json_type,
        r#"{"name": "default/web", "properties": {"recordsize": 65536, "nfs.ro": true}}"#,
    );
    assert_eq!(status, 201, "{body}");
    let web: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(web["export"], "/default/web");
    assert_eq!(web["properties"]["recordsize"], "65536");
    assert_eq!(web["properties"]["nfs.ro"], "on");
    let (status, _, body) = http(
        &api,
        "PATCH",
        "/v1/filesystems/default/web",
        json_type,
        r#"{"properties": {"quota": "10M"}}"#,
    );
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = http(
        &api,
        "PATCH",
        "/v1/filesystems/default/web",
        json_type,
        r#"{"properties": {"recordsize": "4K"}}"#,
    );
    assert_eq!(status, 400);
    assert!(error_message(&body).contains("recordsize"), "{body}");
    let (status, _, body) = http(&api, "POST", "/v1/filesystems", json_type, r#"{"name": "default/web"}"#);
    assert_eq!(status, 409);
    assert!(error_message(&body).contains("already exists"), "{body}");
    let (status, _, body) = http(&api, "DELETE", "/v1/filesystems/default/web", None, "");
    assert_eq!(status, 204, "{body}");
    let (status, _, body) = http(&api, "GET", "/v1/filesystems/default/web", None, "");
    assert_eq!(status, 404);
    assert_eq!(error_message(&body), "dataset 'default/web' does not exist");

    // Snapshots of a dataset: created, listed (CLI and REST), refused
    // names, the dataset kept while it has them, destroyed.
    let json = server.cli(&["fs", "snapshot", "default/docs@one", "--json"]).json();
    assert_eq!(json["name"], "default/docs@one");
    assert_eq!(json["path"], "/default/docs/.snapshot/one");
    assert_eq!(server.cli(&["fs", "snapshot", "default/docs@two"]).ok(), "");
    let list = server.cli(&["fs", "snapshots", "default/docs"]).ok().to_string();
    // (CREATED is a date and a time: split by hand.)
    let lines: Vec<Vec<&str>> = list.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(lines[0], ["NAME", "PATH", "FILES", "USED", "REFER", "CREATED"]);
    assert_eq!(lines[1][..3], ["default/docs@one", "/default/docs/.snapshot/one", "1"]);
    assert_eq!(lines[2][0], "default/docs@two", "{list}");
    let all = server.cli(&["fs", "snapshots", "--json"]).json();
    assert_eq!(all.as_array().map(Vec::len), Some(2), "{all}");
    server.cli(&["fs", "snapshot", "default/docs@one"]).fails_with("exists");
    server
        .cli(&["fs", "snapshot", "default/docs@.hidden"])
        .fails_with("invalid snapshot name");
    server
        .cli(&["fs", "snapshot", "default/nope@one"])
        .fails_with("dataset 'default/nope' does not exist");
    server
        .cli(&["fs", "destroy", "default/docs"])
        .fails_with("has 2 snapshot(s)");
    let (status, _, body) = http(&api, "GET", "/v1/filesystems/default/docs/snapshots", None, "");
    assert_eq!(status, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()[1]["snapshot"], "two");
    let (status, _, body) = http(&api, "DELETE", "/v1/filesystems/default/docs/snapshots/two", None, "");
    assert_eq!(status, 204, "{body}");
    let (status, _, body) = http(&api, "DELETE", "/v1/filesystems/default/docs/snapshots/two", None, "");
    assert_eq!(status, 404, "{body}");
    // Volumes' snapshot listings leave datasets' out.
    let volumes = server.cli(&["snapshot", "list", "--json"]).json();
    assert!(!volumes.to_string().contains("default/docs"), "{volumes}");

    // Clones: the origin's properties, -o over them, the snapshot kept.
    let json = server
        .cli(&[
            "fs",
            "clone",
            "default/docs@one",
            "default/docs2",
            "-o",
            "nfs.ro=on",
            "--json",
        ])
        .json();
    assert_eq!(json["name"], "default/docs2");
    assert_eq!(json["origin"], "default/docs@one");
    assert_eq!(json["properties"]["nfs.squash"], "all", "taken from the origin");
    assert_eq!(json["properties"]["nfs.ro"], "on");
    let get = server.cli(&["fs", "get", "default/docs2"]).ok().to_string();
    assert!(
        get.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["default/docs2", "origin", "default/docs@one"]),
        "{get}"
    );
    server
        .cli(&["fs", "clone", "default/docs@one", "default/docs2"])
        .fails_with("already exists");
    server
        .cli(&[
            "fs",
            "clone",
            "default/docs@one",
            "default/docs3",
            "-o",
            "recordsize=64K",
        ])
        .fails_with("keeps its origin's recordsize");
    server
        .cli(&["fs", "clone", "default/docs@nope", "default/docs3"])
        .fails_with("does not exist");
    server
        .cli(&["fs", "destroy", "default/docs@one"])
        .fails_with("has clones (default/docs2)");

    // Rollback: to the newest; -r (REST destroy_newer) destroys newer ones.
    assert_eq!(server.cli(&["fs", "rollback", "default/docs@one"]).ok(), "");
    assert_eq!(server.cli(&["fs", "snapshot", "default/docs@three"]).ok(), "");
    server
        .cli(&["fs", "rollback", "default/docs@one"])
        .fails_with("more recent snapshots of 'default/docs' exist (@three)");
    // -r with a newer snapshot that has a clone: refused before any newer
    // snapshot is destroyed.
    server.cli(&["fs", "clone", "default/docs@three", "default/docs3"]).ok();
    assert_eq!(server.cli(&["fs", "snapshot", "default/docs@four"]).ok(), "");
    server
        .cli(&["fs", "rollback", "default/docs@one", "-r"])
        .fails_with("snapshot 'default/docs@three' has clones (default/docs3)");
    let left = server.cli(&["fs", "snapshots", "default/docs", "--json"]).json();
    assert_eq!(left.as_array().map(Vec::len), Some(3), "none destroyed: {left}");
    assert_eq!(server.cli(&["fs", "destroy", "default/docs3"]).ok(), "");
    let path = "/v1/filesystems/default/docs/snapshots/one/rollback";
    let (status, _, body) = http(
        &api,
        "POST",
        path,
        Some("application/json"),
        r#"{"destroy_newer": true}"#,
    );
    assert_eq!(status, 204, "{body}");
    let left = server.cli(&["fs", "snapshots", "default/docs", "--json"]).json();
    assert_eq!(
        left.as_array().map(Vec::len),
        Some(1),
        "three and four destroyed: {left}"
    );
    server
        .cli(&["fs", "rollback", "default/docs@gone"])
        .fails_with("does not exist");

    // Datasets, their properties and snapshots survive a restart.
    let (status, _) = server.stop();
    assert!(status.success());
    let server = Server::start(dir.path());
    let json = server.cli(&["fs", "get", "default/docs", "--json"]).json();
    assert_eq!(json["properties"]["quota"], "1073741824");
    assert_eq!(json["properties"]["nfs.squash"], "all");

    let list = server.cli(&["fs", "snapshots"]).ok().to_string();
    assert!(list.lines().any(|l| l.starts_with("default/docs@one ")), "{list}");

    let json = server.cli(&["fs", "get", "default/docs2", "--json"]).json();
    assert_eq!(json["origin"], "default/docs@one", "a clone stays one");

    // destroy: gone from list and get (the clone first, then its origin).
    assert_eq!(server.cli(&["fs", "destroy", "default/docs2"]).ok(), "");
    assert_eq!(server.cli(&["fs", "destroy", "default/docs@one"]).ok(), "");
    assert_eq!(server.cli(&["fs", "destroy", "default/docs"]).ok(), "");
    let list = server.cli(&["fs", "list"]).ok().to_string();
    assert!(
        row(&list, "default/docs").is_none(),
        "destroyed dataset still listed:\n{list}"
    );
    assert!(row(&list, "default/files").is_some());
    server
        .cli(&["fs", "get", "default/docs"])
        .fails_with("dataset 'default/docs' does not exist");
    server
        .cli(&["fs", "destroy", "default/docs"])
        .fails_with("dataset 'default/docs' does not exist");

    let (status, _) = server.stop();
    assert!(status.success(), "strata serve exited with {status}");
}

/// The snapshot names of `fs snapshots DATASET --json`.
fn fs_snapshot_names(server: &Server, dataset: &str) -> Vec<String> {
    let json = server.cli(&["fs", "snapshots", dataset, "--json"]).json();
    json.as_array()
        .expect("a JSON array")
        .iter()
        .map(|s| {
            assert_eq!(s["dataset"], dataset, "{json}");
            s["snapshot"].as_str().unwrap().to_string()
        })
        .collect()
}

/// The `origin` row of `fs get DATASET`, if it has one.
fn fs_origin_row(server: &Server, dataset: &str) -> Option<String> {
    let get = server.cli(&["fs", "get", dataset]).ok().to_string();
    fs_properties(&get, dataset)
        .into_iter()
        .find(|(property, _)| property == "origin")
        .map(|(_, value)| value)
}

/// `fs promote` (CLI and REST): the clone takes its origin snapshot and the
/// older ones, names kept; the origin becomes its clone (`fs get`, `fs
/// list --json`); refusals name the problem; it survives a restart, and
/// the former origin can be destroyed afterwards.
#[test]
fn fs_promote() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let api = server.api.clone();
    for snapshot in ["one", "two", "three"] {
        assert_eq!(
            server
                .cli(&["fs", "snapshot", &format!("default/files@{snapshot}")])
                .ok(),
            ""
        );
    }
    assert_eq!(
        server.cli(&["fs", "clone", "default/files@two", "default/work"]).ok(),
        ""
    );

    // Refusals.
    server
        .cli(&["fs", "promote", "default/files"])
        .fails_with("dataset 'default/files' is not a clone");
    server
        .cli(&["fs", "promote", "default/nope"])
        .fails_with("dataset 'default/nope' does not exist");
    server
        .cli(&["fs", "promote", "work"])
        .fails_with("invalid dataset name 'work'");
    server
        .cli(&["fs", "promote", "default/vol0"])
        .fails_with("dataset 'default/vol0' does not exist");
    assert_eq!(server.cli(&["fs", "snapshot", "default/work@one"]).ok(), "");
    server
        .cli(&["fs", "promote", "default/work"])
        .fails_with("'default/work' has a snapshot named 'one' like default/files@one");
    let (status, _, body) = http(&api, "POST", "/v1/filesystems/default/work/promote", None, "");
    assert_eq!(status, 400, "{body}");
    assert!(
        error_message(&body).contains("destroy default/work@one first"),
        "{body}"
    );
    let (status, _, body) = http(&api, "POST", "/v1/filesystems/default/files/promote", None, "");
    assert_eq!(status, 400, "{body}");
    let (status, _, body) = http(&api, "POST", "/v1/filesystems/default/nope/promote", None, "");
    assert_eq!(status, 404, "{body}");
    assert_eq!(fs_snapshot_names(&server, "default/files"), ["one", "two", "three"]);
    assert_eq!(
        fs_origin_row(&server, "default/work").as_deref(),
        Some("default/files@two")
    );
    assert_eq!(server.cli(&["fs", "destroy", "default/work@one"]).ok(), "");
    assert_eq!(server.cli(&["fs", "snapshot", "default/work@mine"]).ok(), "");

    // CLI: work takes one and two; files becomes a clone of work@two.
    let json = server.cli(&["fs", "promote", "default/work", "--json"]).json();
    assert_eq!(json["name"], "default/work");
    assert!(json.get("origin").is_none(), "no origin any more: {json}");
    let promoted = |server: &Server| {
        assert_eq!(fs_snapshot_names(server, "default/work"), ["one", "two", "mine"]);
        assert_eq!(fs_snapshot_names(server, "default/files"), ["three"]);
        assert_eq!(fs_origin_row(server, "default/work"), None);
        assert_eq!(
            fs_origin_row(server, "default/files").as_deref(),
            Some("default/work@two")
        );
        let list = server.cli(&["fs", "list", "--json"]).json();
        let origin_of = |name: &str| {
            list.as_array()
                .unwrap()
                .iter()
                .find(|d| d["name"] == name)
                .unwrap_or_else(|| panic!("{name} listed: {list}"))
                .get("origin")
                .cloned()
        };
        assert_eq!(origin_of("default/files"), Some(Value::from("default/work@two")));
        assert_eq!(origin_of("default/work"), None);
        let snapshots = server.cli(&["fs", "snapshots"]).ok().to_string();
        assert!(
            snapshots
                .lines()
                .any(|l| l.starts_with("default/work@two ") && l.contains("/default/work/.snapshot/two")),
            "{snapshots}"
        );
    };
    promoted(&server);
    server
        .cli(&["fs", "promote", "default/work"])
        .fails_with("dataset 'default/work' is not a clone");
    server
        .cli(&["fs", "destroy", "default/work@two"])
        .fails_with("has clones (default/files)");

    // REST: promoting files back returns one and two to it, and again.
    let (status, _, body) = http(&api, "POST", "/v1/filesystems/default/files/promote", None, "");
    assert_eq!(status, 200, "{body}");
    let json: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["name"], "default/files");
    assert!(json.get("origin").is_none(), "{json}");
    assert_eq!(fs_snapshot_names(&server, "default/files"), ["one", "two", "three"]);
    assert_eq!(fs_snapshot_names(&server, "default/work"), ["mine"]);
    assert_eq!(
        fs_origin_row(&server, "default/work").as_deref(),
        Some("default/files@two")
    );
    assert_eq!(fs_origin_row(&server, "default/files"), None);
    let (status, _, body) = http(&api, "POST", "/v1/filesystems/default/work/promote", None, "");
    assert_eq!(status, 200, "{body}");
    promoted(&server);

    // A restart keeps it.
    let (status, _) = server.stop();
    assert!(status.success());
    let server = Server::start(dir.path());
    promoted(&server);

    // The former origin can go (its own snapshot first); the promoted
    // clone keeps its snapshots, now free of clones.
    server
        .cli(&["fs", "destroy", "default/files"])
        .fails_with("has 1 snapshot(s)");
    assert_eq!(server.cli(&["fs", "destroy", "default/files@three"]).ok(), "");
    assert_eq!(server.cli(&["fs", "destroy", "default/files"]).ok(), "");
    let list = server.cli(&["fs", "list"]).ok().to_string();
    assert!(row(&list, "default/files").is_none(), "{list}");
    assert_eq!(fs_snapshot_names(&server, "default/work"), ["one", "two", "mine"]);
    assert_eq!(server.cli(&["fs", "destroy", "default/work@one"]).ok(), "");
    let (status, _) = server.stop();
    assert!(status.success());
    let server = Server::start(dir.path());
    assert_eq!(fs_snapshot_names(&server, "default/work"), ["two", "mine"]);
    assert_eq!(fs_origin_row(&server, "default/work"), None);
    let (status, _) = server.stop();
    assert!(status.success(), "strata serve exited with {status}");
}
