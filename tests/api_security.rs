//! The REST API's security: every mutating route refuses a missing or wrong
//! token with 401 and changes nothing; the Unix socket and the token file
//! are closed to other users (a real unprivileged user made with useradd);
//! TLS with a pinned self-signed or a given certificate; /metrics open or
//! behind the token; audit lines without secrets. The daemon runs on
//! ephemeral loopback ports and is stopped by PID.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::Server;

const BIN: &str = env!("CARGO_BIN_EXE_strata");
/// The unprivileged user the tests act as.
const OTHER_USER: &str = "strata-test";

/// A raw HTTP/1.1 exchange with an explicit Authorization header (or none).
fn request(api: &str, method: &str, path: &str, authorization: Option<&str>, body: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(api).expect("connect to the API");
    let header = authorization
        .map(|value| format!("Authorization: {value}\r\n"))
        .unwrap_or_default();
    // A TLS listener may answer with an alert or a reset, even before the
    // whole request is written: whatever came back is the answer.
    let _ = write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {api}\r\nConnection: close\r\n{header}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// The CLI against `data_dir`'s socket (the local default).
fn cli(data_dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .env_remove("STRATA_API")
        .env_remove("STRATA_TOKEN")
        .env_remove("STRATA_CACERT")
        .output()
        .expect("run the strata CLI")
}

#[track_caller]
fn succeeded(output: &Output) -> String {
    assert!(
        output.status.success(),
        "expected success: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[track_caller]
fn failed_with(output: &Output, needle: &str) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(1), "expected failure: {stderr}");
    assert!(
        stderr.starts_with("strata: error: ") && stderr.contains(needle),
        "expected {needle:?} in {stderr:?}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr:?}");
    stderr
}

fn mode_of(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// What the daemon holds, as the socket shows it: volumes with their
/// properties, and pools with their devices.
fn state(data_dir: &Path) -> String {
    let volumes = succeeded(&cli(data_dir, &["volume", "list", "--json"]));
    let properties = succeeded(&cli(data_dir, &["volume", "get", "default/vol0", "--json"]));
    let pools: serde_json::Value =
        serde_json::from_str(&succeeded(&cli(data_dir, &["pool", "status", "--json"]))).unwrap();
    let devices: Vec<String> = pools[0]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["path"].to_string())
        .collect();
    let iscsi = succeeded(&cli(data_dir, &["iscsi", "get", "--json"]));
    format!("{volumes}\n{properties}\n{devices:?}\n{iscsi}")
}

#[test]
fn missing_or_wrong_tokens_get_401_on_every_mutating_route_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let log = dir.path().join("daemon.log");
    let mut server = Server::start_logged(&data, Some(&data), &[], Some(&log));
    let token = std::fs::read_to_string(data.join("api.token"))
        .unwrap()
        .trim()
        .to_string();
    assert_eq!(token.len(), 64);
    let fast = common::sparse_file(dir.path(), "new-fast.img", 256 << 20);
    let spare = common::sparse_file(dir.path(), "spare.img", 256 << 20);
    let before = state(&data);

    let create_pool = format!(r#"{{"name":"evil","devices":[{{"path":"{fast}","role":"fast"}}]}}"#);
    let add_device = format!(r#"{{"path":"{spare}","role":"capacity"}}"#);
    let routes: Vec<(&str, &str, String)> = vec![
        ("POST", "/v1/pools", create_pool.clone()),
        ("POST", "/v1/pools/default/devices", add_device),
        ("POST", "/v1/pools/default/sync", String::new()),
        ("POST", "/v1/volumes", r#"{"name":"default/evil","size":"1G"}"#.into()),
        (
            "PATCH",
            "/v1/volumes/default/vol0",
            r#"{"properties":{"sync":"always"}}"#.into(),
        ),
        ("POST", "/v1/volumes/default/vol0/resize", r#"{"size":"20G"}"#.into()),
        ("DELETE", "/v1/volumes/default/vol0", String::new()),
        (
            "PATCH",
            "/v1/iscsi",
            r#"{"properties":{"discovery_auth":"chap"}}"#.into(),
        ),
        // Reads need the token too: volume names and CHAP users are not public.
        ("GET", "/v1/volumes", String::new()),
        ("GET", "/v1/pools", String::new()),
        ("GET", "/v1/iscsi", String::new()),
    ];
    let wrong = format!("Bearer {}", "f".repeat(64));
    let near_miss = format!("Bearer {}", &token[..63]);
    for (method, path, body) in &routes {
        for authorization in [
            None,
            Some(wrong.as_str()),
            Some(near_miss.as_str()),
            Some("Basic YWRtaW46YWRtaW4="),
        ] {
            let answer = request(&server.api, method, path, authorization, body);
            assert!(
                answer.starts_with("HTTP/1.1 401"),
                "{method} {path} with {authorization:?}: {answer}"
            );
            let lower = answer.to_ascii_lowercase();
            assert!(lower.contains("www-authenticate: bearer"), "{answer}");
            assert!(answer.contains("\"error\""), "{answer}");
        }
    }
    assert_eq!(state(&data), before, "a refused request changed the daemon's state");
    for file in [&fast, &spare] {
        let bytes = std::fs::read(file).unwrap();
        assert!(bytes.iter().all(|&b| b == 0), "{file} was written to");
    }

    // The same requests with the token work (so the 401s were about the token).
    let bearer = format!("Bearer {token}");
    let answer = request(
        &server.api,
        "POST",
        "/v1/volumes",
        Some(&bearer),
        r#"{"name":"default/ok","size":"1G"}"#,
    );
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    let answer = request(&server.api, "GET", "/v1/volumes", Some(&bearer), "");
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("default/ok"),
        "{answer}"
    );
    // /metrics stays open, as node_exporter's does.
    let answer = request(&server.api, "GET", "/metrics", None, "");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // Over the socket as root: allowed, audited with the uid.
    succeeded(&cli(&data, &["volume", "set", "default/ok", "sync=always"]));
    assert!(server.stop().success());
    let log = std::fs::read_to_string(&log).unwrap();
    let audit: Vec<&str> = log.lines().filter(|l| l.contains("audit: ")).collect();
    // One line per refused mutating request (4 variants x 8 routes), one per allowed one.
    let refused = audit.iter().filter(|l| l.contains("result=401")).count();
    assert_eq!(refused, 4 * 8, "{audit:#?}");
    assert!(
        audit
            .iter()
            .any(|l| l.contains("POST /v1/volumes") && l.contains("result=201") && l.contains("token ")),
        "{audit:#?}"
    );
    assert!(
        audit.iter().any(|l| l.contains("PATCH /v1/volumes/default/ok")
            && l.contains("result=200")
            && l.contains("uid 0")
            && l.contains("unix socket")),
        "{audit:#?}"
    );
    // Reads are not audited; no secret appears anywhere in the log.
    assert!(!audit.iter().any(|l| l.contains("GET ")), "{audit:#?}");
    for secret in [token.as_str(), &token[..63], &"f".repeat(64)] {
        assert!(!log.contains(secret), "the log holds a token");
    }
}

#[test]
fn metrics_can_be_put_behind_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with_args(dir.path(), Some(dir.path()), &["--metrics-auth"]);
    let token = std::fs::read_to_string(dir.path().join("api.token")).unwrap();
    let answer = request(&server.api, "GET", "/metrics", None, "");
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    let answer = request(
        &server.api,
        "GET",
        "/metrics",
        Some(&format!("Bearer {}", token.trim())),
        "",
    );
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("strata_volume"),
        "{answer}"
    );
}

#[test]
fn files_are_private_and_the_socket_is_owner_and_group_only() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start_with_args(dir.path(), Some(dir.path()), &["--api-tls", "on"]);
    assert_eq!(mode_of(&dir.path().join("api.token")), 0o600);
    assert_eq!(mode_of(&dir.path().join("api.key")), 0o600);
    assert_eq!(mode_of(&dir.path().join("api.sock")), 0o660);
    assert!(server.stop().success());
    // The socket goes with the daemon; a loose token is tightened at the next start.
    assert!(!dir.path().join("api.sock").exists());
    std::fs::set_permissions(dir.path().join("api.token"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let _server = Server::start(dir.path());
    assert_eq!(mode_of(&dir.path().join("api.token")), 0o600);
}

/// Makes the unprivileged test user (and its group) if it is missing.
fn other_user() -> (u32, u32) {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test acts as another user and must run as root (CI does)"
    );
    let exists = Command::new("id").arg("-u").arg(OTHER_USER).output().unwrap();
    if !exists.status.success() {
        let made = Command::new("useradd")
            .args([
                "--system",
                "--user-group",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                OTHER_USER,
            ])
            .output()
            .expect("run useradd");
        // Another test process may have made it at the same moment.
        let again = Command::new("id").arg("-u").arg(OTHER_USER).output().unwrap();
        assert!(again.status.success(), "useradd failed: {made:?}");
    }
    let number = |flag: &str| -> u32 {
        let output = Command::new("id").arg(flag).arg(OTHER_USER).output().unwrap();
        String::from_utf8_lossy(&output.stdout).trim().parse().unwrap()
    };
    (number("-u"), number("-g"))
}

/// Runs the CLI (a copy other users can execute) as the unprivileged user.
fn as_other_user(binary: &Path, args: &[&str]) -> Output {
    Command::new("runuser")
        .args(["-u", OTHER_USER, "--"])
        .arg(binary)
        .args(args)
        .env_remove("STRATA_TOKEN")
        .env_remove("STRATA_API")
        .output()
        .expect("run runuser")
}

#[test]
fn another_user_can_neither_use_the_socket_nor_read_the_token_unless_given_the_group() {
    let (_, gid) = other_user();
    let dir = tempfile::tempdir().unwrap();
    // The other user may walk to the data directory and run the CLI; what
    // stops it must be the daemon's own modes.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let binary: PathBuf = dir.path().join("strata");
    std::fs::copy(BIN, &binary).unwrap();
    std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
    let data_arg = data.to_str().unwrap();

    let mut server = Server::start(&data);
    let output = as_other_user(&binary, &["volume", "list", "--data-dir", data_arg]);
    failed_with(&output, "permission denied");
    let output = Command::new("runuser")
        .args(["-u", OTHER_USER, "--", "cat"])
        .arg(data.join("api.token"))
        .output()
        .unwrap();
    assert!(!output.status.success(), "the other user read the token");
    assert!(output.stdout.is_empty());
    // Over TCP it has no token to give: 401, said plainly.
    let api = server.api.clone();
    let output = as_other_user(
        &binary,
        &[
            "volume",
            "create",
            "default/x",
            "--size",
            "1G",
            "--api",
            &api,
            "--data-dir",
            data_arg,
        ],
    );
    failed_with(&output, "not authorized");
    let output = as_other_user(
        &binary,
        &[
            "volume",
            "create",
            "default/x",
            "--size",
            "1G",
            "--api",
            &api,
            "--token",
            "not-the-token-at-all",
        ],
    );
    failed_with(&output, "invalid API token");
    assert!(!succeeded(&cli(&data, &["volume", "list"])).contains("default/x"));
    assert!(server.stop().success());

    // With the socket's group, the user is an administrator (as with docker's group).
    let mut server = Server::start_with_args(&data, Some(&data), &["--api-socket-group", OTHER_USER]);
    let socket = std::fs::metadata(data.join("api.sock")).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::gid(&socket), gid);
    let output = as_other_user(
        &binary,
        &["volume", "create", "default/y", "--size", "1G", "--data-dir", data_arg],
    );
    succeeded(&output);
    assert!(succeeded(&cli(&data, &["volume", "list"])).contains("default/y"));
    // ...but still cannot read the token.
    let output = Command::new("runuser")
        .args(["-u", OTHER_USER, "--", "cat"])
        .arg(data.join("api.token"))
        .output()
        .unwrap();
    assert!(!output.status.success(), "the group member read the token");
    assert!(server.stop().success());
}

/// `openssl req` makes a self-signed certificate for `cn` (and 127.0.0.1).
fn openssl_certificate(dir: &Path, name: &str, cn: &str) -> (PathBuf, PathBuf) {
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    let output = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
        ])
        .args([
            "-subj",
            &format!("/CN={cn}"),
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("run openssl (package openssl)");
    assert!(
        output.status.success(),
        "openssl req: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    (cert, key)
}

#[test]
fn tls_api_with_the_pinned_self_signed_certificate_or_a_given_one() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut server = Server::start_with_args(&data, Some(&data), &["--api-tls", "on"]);
    let url = format!("https://{}", server.api);
    // The CLI pins DATA_DIR/api.crt and finds the token beside it.
    let output = Command::new(BIN)
        .args([
            "volume",
            "create",
            "default/tls",
            "--size",
            "1G",
            "--api",
            &url,
            "--data-dir",
        ])
        .arg(&data)
        .output()
        .unwrap();
    succeeded(&output);
    // By name too (the certificate names localhost).
    let port = server.api.rsplit(':').next().unwrap();
    let output = Command::new(BIN)
        .args([
            "volume",
            "list",
            "--api",
            &format!("https://localhost:{port}"),
            "--data-dir",
        ])
        .arg(&data)
        .output()
        .unwrap();
    assert!(succeeded(&output).contains("default/tls"));
    // Another certificate is not trusted: one clear line.
    let (other, _) = openssl_certificate(dir.path(), "other", "127.0.0.1");
    let token = std::fs::read_to_string(data.join("api.token")).unwrap();
    let output = Command::new(BIN)
        .args(["volume", "list", "--api", &url, "--data-dir", "/nonexistent"])
        .arg("--cacert")
        .arg(&other)
        .env("STRATA_TOKEN", token.trim())
        .output()
        .unwrap();
    failed_with(&output, "not trusted");
    // Plain HTTP to the TLS port gets no HTTP answer.
    let answer = request(&server.api, "GET", "/v1", Some(&format!("Bearer {}", token.trim())), "");
    assert!(!answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(server.stop().success());

    // A certificate given with --api-cert/--api-key is served; clients trust it with --cacert.
    let (cert, key) = openssl_certificate(dir.path(), "given", "localhost");
    let server = Server::start_with_args(
        &data,
        Some(&data),
        &[
            "--api-tls",
            "on",
            "--api-cert",
            cert.to_str().unwrap(),
            "--api-key",
            key.to_str().unwrap(),
        ],
    );
    let output = Command::new(BIN)
        .args([
            "volume",
            "list",
            "--api",
            &format!("https://{}", server.api),
            "--data-dir",
            "/nonexistent",
        ])
        .arg("--cacert")
        .arg(&cert)
        .env("STRATA_TOKEN", token.trim())
        .output()
        .unwrap();
    assert!(succeeded(&output).contains("default/tls"));
    // The daemon's own self-signed certificate is not what it serves now.
    let output = Command::new(BIN)
        .args([
            "volume",
            "list",
            "--api",
            &format!("https://{}", server.api),
            "--data-dir",
        ])
        .arg(&data)
        .output()
        .unwrap();
    failed_with(&output, "not trusted");
}

#[test]
fn an_api_on_other_than_loopback_without_tls_is_refused_before_listening() {
    let dir = tempfile::tempdir().unwrap();
    // Refused before anything binds: no listener on 0.0.0.0 is ever opened.
    let output = Command::new(BIN)
        .args([
            "serve",
            "--nbd",
            "127.0.0.1:0",
            "--iscsi",
            "127.0.0.1:0",
            "--nfs",
            "127.0.0.1:0",
            "--api",
            "0.0.0.0:0",
            "--api-tls",
            "off",
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .env("STRATA_RAM_DIR", dir.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("refusing to serve the REST API on 0.0.0.0:0 without TLS"),
        "{stderr}"
    );
}
