//! Helpers shared by the integration tests: start the real `strata` binary on
//! ephemeral loopback ports, stop it by PID, and run external clients.
#![allow(dead_code)]

pub mod engine;
pub mod iscsi;
pub mod nbd;
pub mod send;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The API token of each running test daemon, by its API address, so
/// [`http`] can authenticate as a script with the token would.
static TOKENS: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// Remembers the token of the daemon whose API is at `api`.
pub fn remember_token(api: &str, data_dir: &Path) {
    let token = std::fs::read_to_string(data_dir.join("api.token")).expect("the daemon wrote DATA_DIR/api.token");
    let mut tokens = TOKENS.lock().unwrap();
    tokens.retain(|(address, _)| address != api);
    tokens.push((api.to_string(), token.trim().to_string()));
}

/// The token of the test daemon at `api`, if one was started here.
pub fn token_for(api: &str) -> Option<String> {
    TOKENS
        .lock()
        .unwrap()
        .iter()
        .find(|(address, _)| address == api)
        .map(|(_, token)| token.clone())
}

pub struct Server {
    child: Child,
    /// `127.0.0.1:PORT` of the NBD listener.
    pub nbd: String,
    /// `127.0.0.1:PORT` of the REST API.
    pub api: String,
    /// `127.0.0.1:PORT` of the iSCSI target.
    pub iscsi: String,
    /// `127.0.0.1:PORT` of the NFS server (printed before the iSCSI line).
    pub nfs: Option<String>,
    pub data_dir: PathBuf,
    /// What the daemon prints on stdout after its listening lines.
    stdout: mpsc::Receiver<String>,
    /// Started without `STRATA_RAM_DIR`: its RAM tier files may be in
    /// /dev/shm, and are removed when it is dropped (see `Drop`).
    default_ram_dir: bool,
    /// The daemon's log (stderr, at `info`) when the test gave no file of
    /// its own for it: shown (its end) if the test fails while the daemon
    /// is running, deleted otherwise.
    own_log: Option<tempfile::NamedTempFile>,
}

impl Server {
    /// Starts `strata serve` on `data_dir` with every listener on port 0 and
    /// waits until it prints where it listens.
    ///
    /// Its pools keep their RAM tier files in `data_dir` (`STRATA_RAM_DIR`),
    /// not in /dev/shm: a test's kill -9 must not leave RAM behind in tmpfs.
    pub fn start(data_dir: &Path) -> Server {
        Server::start_with_ram_dir(data_dir, Some(data_dir))
    }

    /// Like `start`, with the RAM tier files in `ram_dir`, or where the
    /// daemon puts them by default (/dev/shm when it is tmpfs) for `None`.
    pub fn start_with_ram_dir(data_dir: &Path, ram_dir: Option<&Path>) -> Server {
        Server::start_with_args(data_dir, ram_dir, &[])
    }

    /// Like `start_with_ram_dir`, with more arguments for `strata serve`.
    pub fn start_with_args(data_dir: &Path, ram_dir: Option<&Path>, extra: &[&str]) -> Server {
        Server::start_logged(data_dir, ram_dir, extra, None)
    }

    /// Like `start_with_args`, with the daemon's log (stderr, at `info`)
    /// written to `log` when given (else to a file of its own, shown if the
    /// test fails: see `Drop`).
    pub fn start_logged(data_dir: &Path, ram_dir: Option<&Path>, extra: &[&str], log: Option<&Path>) -> Server {
        let own_log = match log {
            Some(_) => None,
            None => Some(
                tempfile::Builder::new()
                    .prefix("strata-daemon-")
                    .suffix(".log")
                    .tempfile()
                    .expect("create the daemon's log"),
            ),
        };
        let stderr = match (log, &own_log) {
            (Some(path), _) => std::fs::File::create(path).expect("create the daemon's log"),
            (None, Some(file)) => file.reopen().expect("open the daemon's log"),
            (None, None) => unreachable!(),
        };
        let mut command = Command::new(env!("CARGO_BIN_EXE_strata"));
        command.env_remove("STRATA_RAM_DIR");
        if let Some(dir) = ram_dir {
            command.env("STRATA_RAM_DIR", dir);
        }
        let mut child = command
            .arg("serve")
            .arg("--data-dir")
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
            .args(extra)
            .env("STRATA_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .spawn()
            .expect("start strata serve");
        let stdout = child.stdout.take().expect("stdout");
        let (lines, received) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if lines.send(line).is_err() {
                    // Keep draining so the server never blocks on a full pipe.
                    continue;
                }
            }
        });
        let mut nbd = None;
        let mut api = None;
        let mut iscsi = None;
        let mut nfs = None;
        while nbd.is_none() || api.is_none() || iscsi.is_none() {
            let line = received.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
                panic!(
                    "strata serve did not report its addresses within 60 s (exit: {:?})",
                    child.try_wait()
                )
            });
            if let Some(address) = line.strip_prefix("strata: nbd listening on ") {
                nbd = Some(address.trim().to_string());
            }
            let api_line = line
                .strip_prefix("strata: api listening on http://")
                .or_else(|| line.strip_prefix("strata: api listening on https://"));
            if let Some(address) = api_line {
                api = Some(address.trim().to_string());
            }
            if let Some(rest) = line.strip_prefix("strata: nfs listening on ") {
                nfs = rest.split_whitespace().next().map(str::to_string);
            }
            if let Some(address) = line.strip_prefix("strata: iscsi listening on ") {
                iscsi = Some(address.trim().to_string());
            }
        }
        let api = api.unwrap();
        remember_token(&api, data_dir);
        Server {
            child,
            nbd: nbd.unwrap(),
            api,
            iscsi: iscsi.unwrap(),
            nfs,
            data_dir: data_dir.to_path_buf(),
            stdout: received,
            default_ram_dir: ram_dir.is_none(),
            own_log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `nbd://127.0.0.1:PORT/EXPORT`.
    pub fn uri(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.nbd)
    }

    /// Creates a volume through the REST API (`size` like "64M").
    pub fn create_volume(&self, name: &str, size: &str) {
        let body = format!("{{\"name\":\"{name}\",\"size\":\"{size}\"}}");
        let response = http(&self.api, "POST", "/v1/volumes", &body);
        assert!(response.starts_with("HTTP/1.1 201"), "creating {name}: {response}");
    }

    /// Sets one volume property through the REST API (`volume set`).
    pub fn set_property(&self, volume: &str, key: &str, value: &str) {
        let body = format!("{{\"properties\":{{\"{key}\":\"{value}\"}}}}");
        let response = http(&self.api, "PATCH", &format!("/v1/volumes/{volume}"), &body);
        assert!(
            response.starts_with("HTTP/1.1 200"),
            "setting {key}={value} on {volume}: {response}"
        );
    }

    /// SIGTERM, then wait for the exit status.
    pub fn stop(&mut self) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid with a valid signal number.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.wait(Duration::from_secs(30))
    }

    /// SIGTERM, wait for the exit status and for what the daemon printed
    /// on stdout since it started listening (its last words).
    pub fn stop_saying(&mut self) -> (ExitStatus, String) {
        let status = self.stop();
        let mut said = String::new();
        while let Ok(line) = self.stdout.recv_timeout(Duration::from_secs(5)) {
            said.push_str(&line);
            said.push('\n');
        }
        (status, said)
    }

    /// SIGKILL (a crash), then reap.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn wait(&mut self, limit: Duration) -> ExitStatus {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            if std::time::Instant::now() > deadline {
                self.kill9();
                panic!("strata did not exit within {limit:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill9();
        }
        // A daemon killed (or failed) with its RAM tier in /dev/shm leaves
        // the file there, pinning RAM: not the tests'.
        if self.default_ram_dir {
            remove_ram_tiers_of(&self.data_dir, Path::new(strata::control::manager::DEFAULT_RAM_DIR));
        }
        // A failing test shows what the daemon logged last (a client's
        // "Input/output error" says nothing of why).
        if let (true, Some(log)) = (std::thread::panicking(), &self.own_log) {
            let text = std::fs::read_to_string(log.path()).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(80)..];
            eprintln!(
                "--- the last {} lines of strata's log ({} in all) ---\n{}\n---",
                tail.len(),
                lines.len(),
                tail.join("\n")
            );
        }
    }
}

/// Removes the RAM tier files of `data_dir`'s pools in `ram_dir` that no
/// process holds.
pub fn remove_ram_tiers_of(data_dir: &Path, ram_dir: &Path) {
    let prefix = format!("strata-{}", strata::control::manager::ram_file_key(data_dir, ""));
    for file in strata::pool::ram::region_files(ram_dir).unwrap_or_default() {
        let ours = file
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&prefix));
        if ours && file.held_by.is_none() {
            let _ = strata::pool::ram::remove_region_file(&file.path, true);
        }
    }
}

/// Creates a sparse file of `bytes` in `dir` (a device for `pool create`)
/// and returns its path as a string.
#[allow(dead_code)]
pub fn sparse_file(dir: &Path, name: &str, bytes: u64) -> String {
    let path = dir.join(name);
    std::fs::File::create(&path).unwrap().set_len(bytes).unwrap();
    path.display().to_string()
}

/// Creates the default pool's device files in `data_dir` before the first
/// start, small (1 GiB fast, 2 GiB capacity; the daemon takes the files it
/// finds): its usual 80 GiB of sparse files are more than many machines
/// have free, which makes the pool's backing space low, and every iSCSI LU
/// of the pool then reports the thin provisioning soft threshold (a unit
/// attention) at its first command.
pub fn small_default_pool(data_dir: &Path) {
    let directory = data_dir.join("pools/default");
    std::fs::create_dir_all(&directory).unwrap();
    sparse_file(&directory, "fast.dev", 1 << 30);
    sparse_file(&directory, "capacity.dev", 2 << 30);
}

/// Panics (never skips) when an external client the tests rely on is missing.
pub fn require_tool(name: &str) {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(name).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "required test tool '{name}' is not installed; run scripts/test (it installs fio qemu-utils libnbd-bin nbdkit ...)"
    );
}

/// Runs a command, panicking with its output unless it succeeds.
pub fn run(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

pub fn stdout_of(command: &mut Command) -> String {
    String::from_utf8_lossy(&run(command).stdout).into_owned()
}

/// Deterministic pseudo-random bytes (xorshift), so failures reproduce.
pub fn pseudo_random(seed: u64, length: usize) -> Vec<u8> {
    let mut state = seed | 1;
    let mut out = Vec::with_capacity(length + 8);
    while out.len() < length {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(length);
    out
}

/// A minimal HTTP/1.1 request, with the daemon's token when it is one this
/// test started; returns the whole response (status line first).
pub fn http(address: &str, method: &str, path: &str, body: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).expect("connect to the API");
    let authorization = token_for(address)
        .map(|token| format!("Authorization: Bearer {token}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n{authorization}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// fio options for a write load that a kill -9 interrupts.
///
/// fio before 3.41 (Debian 12 ships 3.33) saves a verify state that assumes
/// every write issued more than `iodepth` writes before the last one has
/// completed. A write that stalls in the server while later writes complete
/// (a request waiting for log space or a checkpoint) would then be verified
/// although it was never acknowledged, and reported as lost (fio fixed this
/// in commit a9ba7cef, "rework write tracking for use with
/// verify_save_state()"). With one write in flight per job the assumption
/// holds; eight jobs, each on its own NBD connection and its own 128 MiB
/// range, still keep eight writes in flight, so group commit is exercised.
/// Every block is written at most once.
#[allow(dead_code)]
pub const FIO_KILL_LOAD: &[&str] = &[
    "--numjobs=8",
    "--iodepth=1",
    "--size=128m",
    "--offset_increment=128m",
    "--group_reporting",
];

/// Runs `strata ARGS --data-dir DIR` against `server`'s data directory.
pub fn cli(server: &Server, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .arg("--data-dir")
        .arg(&server.data_dir)
        .output()
        .unwrap()
}

/// [`cli`] that must succeed; returns its stdout.
pub fn cli_ok(server: &Server, args: &[&str]) -> String {
    let output = cli(server, args);
    assert!(
        output.status.success(),
        "strata {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `strata pool status POOL --json`.
pub fn pool_json(server: &Server, pool: &str) -> serde_json::Value {
    serde_json::from_str(&cli_ok(server, &["pool", "status", pool, "--json"])).unwrap()
}

/// `pool status --json` once the pool's cache is placed and its freeing
/// queue (deleted snapshots and volumes, freed in the background) is empty.
pub fn settled_pool_json(server: &Server, pool: &str) -> serde_json::Value {
    cli_ok(server, &["pool", "sync", pool]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let status = pool_json(server, pool);
        if status["freeing_bytes"].as_u64() == Some(0) {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "space still freeing after 2 minutes: {status}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Runs qemu-io with `commands` on `uri` (nbd:// or iscsi://): (exit
/// status success, stdout + stderr).
pub fn qemu_io(uri: &str, commands: &[String]) -> (bool, String) {
    let mut command = Command::new("qemu-io");
    command.args(["-f", "raw"]);
    for c in commands {
        command.arg("-c").arg(c);
    }
    let output = command.arg(uri).output().expect("run qemu-io");
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

/// qemu-io that must succeed with no failed command or pattern mismatch.
pub fn qemu_io_ok(uri: &str, commands: &[String]) -> String {
    let (ok, text) = qemu_io(uri, commands);
    assert!(
        ok && !text.contains("failed") && !text.contains("error"),
        "qemu-io {commands:?} on {uri}:\n{text}"
    );
    text
}

/// `qemu_io_ok` opening the export read-only (`-r`: a snapshot).
pub fn qemu_io_read_only(uri: &str, commands: &[String]) -> String {
    let mut command = Command::new("qemu-io");
    command.args(["-r", "-f", "raw"]);
    for c in commands {
        command.arg("-c").arg(c);
    }
    let output = command.arg(uri).output().expect("run qemu-io");
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    let ok = output.status.success();
    assert!(
        ok && !text.contains("failed") && !text.contains("error"),
        "qemu-io {commands:?} on {uri}:\n{text}"
    );
    text
}

/// A tmpfs mounted for a test; unmounted when dropped, however the test ends.
pub struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Mounts a tmpfs of `size` (like "160m") at `path`, creating the directory.
/// Needs root, as CI has.
pub fn mount_tmpfs(path: &Path, size: &str) -> Mount {
    std::fs::create_dir_all(path).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(path)
        .status()
        .expect("run mount");
    assert!(
        mounted.success(),
        "this test mounts a small tmpfs and needs root (CI runs as root)"
    );
    Mount(path.to_path_buf())
}

/// Waits up to 30 s for `text` to appear in the daemon's log file.
pub fn wait_for_log(log: &Path, text: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(log).unwrap_or_default().contains(text) {
        assert!(std::time::Instant::now() < deadline, "no '{text}' in the daemon's log");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pattern byte of the i-th MiB [`fill_until_failure`] writes.
pub fn fill_pattern(i: u64) -> u8 {
    0x40 + i as u8
}

/// Writes MiB after MiB from offset 0 with qemu-io on `uri` (one client
/// each, MiB i holding [`fill_pattern`]`(i)`) until a write fails; returns
/// how many were acknowledged and the failing qemu-io's output. Panics if
/// more than `limit_mib` are acknowledged.
pub fn fill_until_failure(uri: &str, limit_mib: u64) -> (u64, String) {
    let mut acknowledged = 0u64;
    loop {
        assert!(
            acknowledged <= limit_mib,
            "wrote more than {limit_mib} MiB: more than there is room for"
        );
        let (ok, text) = qemu_io(
            uri,
            &[format!(
                "write -P {:#x} {} 1M",
                fill_pattern(acknowledged),
                acknowledged << 20
            )],
        );
        if ok && text.contains("wrote 1048576/1048576 bytes") {
            acknowledged += 1;
        } else {
            return (acknowledged, text);
        }
    }
}

/// A 160 MiB tmpfs mounted for one test (unmounted when dropped), holding
/// a sparse 497 MiB device file: 97 MiB of chunk 0, metadata and log, then
/// 400 MiB of data space. The daemon's data and RAM directories are beside
/// it, on the ordinary file system.
pub struct SmallFs {
    _mount: Mount,
    /// The device file, for `pool create tank --fast`.
    pub fast: String,
    pub data: PathBuf,
    pub ram: PathBuf,
    /// Where the test has the daemon log (`Server::start_logged`).
    pub log: PathBuf,
    pub dir: tempfile::TempDir,
}

impl SmallFs {
    pub fn mount() -> SmallFs {
        let dir = tempfile::tempdir().unwrap();
        let fs = dir.path().join("fs");
        let mount = mount_tmpfs(&fs, "160m");
        let ram = dir.path().join("ram");
        std::fs::create_dir(&ram).unwrap();
        SmallFs {
            _mount: mount,
            fast: sparse_file(&fs, "fast.img", (97 + 400) << 20),
            data: dir.path().join("data"),
            ram,
            log: dir.path().join("daemon.log"),
            dir,
        }
    }
}

/// Fills `uri` (a volume of `server`'s pool `tank` on a [`SmallFs`]) until
/// the file system under the pool is full: the failing write must be
/// ENOSPC, never EIO, and come neither too early nor while the pool itself
/// is short. Returns how many MiB were acknowledged (see
/// [`fill_until_failure`]).
pub fn fill_full_fs(server: &Server, uri: &str) -> u64 {
    let (acknowledged, failure) = fill_until_failure(uri, 399);
    eprintln!("{acknowledged} MiB acknowledged before the file system was full; then:\n{failure}");
    assert!(failure.contains("No space left on device"), "{failure}");
    assert!(!failure.contains("Input/output error"), "{failure}");
    assert!(
        acknowledged >= 16,
        "the file system filled too early: {acknowledged} MiB"
    );
    // The pool itself had room: this was the file system.
    let available = pool_json(server, "tank")["available_bytes"].as_u64().unwrap();
    assert!(available > 100 << 20, "{available}");
    acknowledged
}
