//! NBD over TLS with real clients: libnbd's nbdinfo/nbdcopy (GnuTLS) and
//! qemu-img/qemu-io, with pre-shared keys (psktool) and X.509 certificates
//! made here with openssl; wrong keys, unknown users, an untrusted CA and
//! plaintext clients in `--tls=require` are refused, and a volume's
//! `nbd.tls_identities` list hides it from everyone else.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{pseudo_random, require_tool, run, stdout_of, Server};

const VOLUME: &str = "default/tls";

fn tools() {
    for tool in ["nbdinfo", "nbdcopy", "qemu-img", "qemu-io", "psktool", "openssl"] {
        require_tool(tool);
    }
}

/// Runs a command that is expected to fail; its output.
fn failing(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        !output.status.success(),
        "{command:?} succeeded but should have been refused\nstdout:\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
    output
}

/// A psktool key file for `user` in `dir` (named keys.psk, as qemu wants),
/// mode 0600.
fn psk_dir(root: &Path, name: &str, user: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("keys.psk");
    run(Command::new("psktool").arg("-u").arg(user).arg("-p").arg(&file));
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    dir
}

/// Concatenates the key files of `dirs` into one server key file.
fn server_psk_file(root: &Path, dirs: &[&Path]) -> PathBuf {
    let mut text = String::new();
    for dir in dirs {
        text.push_str(&std::fs::read_to_string(dir.join("keys.psk")).unwrap());
    }
    let file = root.join("server.psk");
    std::fs::write(&file, text).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    file
}

fn openssl(dir: &Path, args: &[&str]) {
    run(Command::new("openssl").current_dir(dir).args(args));
}

/// A CA in `dir` (ca-cert.pem, ca-key.pem).
fn make_ca(dir: &Path, name: &str) {
    std::fs::create_dir_all(dir).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca-cert.pem",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
        ],
    );
}

/// A certificate for `common_name` signed by the CA in `ca`, written into
/// `dir` as `{prefix}-cert.pem` and `{prefix}-key.pem`, with the CA's
/// certificate beside it as ca-cert.pem (the layout nbdkit, libnbd and qemu
/// read).
fn make_cert(ca: &Path, dir: &Path, prefix: &str, common_name: &str, extensions: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let key = dir.join(format!("{prefix}-key.pem"));
    let csr = dir.join(format!("{prefix}.csr"));
    let cert = dir.join(format!("{prefix}-cert.pem"));
    let ext = dir.join(format!("{prefix}.ext"));
    std::fs::write(&ext, extensions).unwrap();
    let path = |p: &Path| p.to_str().unwrap().to_string();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &path(&key),
            "-out",
            &path(&csr),
            "-subj",
            &format!("/CN={common_name}"),
        ],
    );
    openssl(
        ca,
        &[
            "x509",
            "-req",
            "-in",
            &path(&csr),
            "-CA",
            "ca-cert.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            &path(&cert),
            "-days",
            "2",
            "-extfile",
            &path(&ext),
        ],
    );
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    if dir != ca {
        std::fs::copy(ca.join("ca-cert.pem"), dir.join("ca-cert.pem")).unwrap();
    }
}

const SERVER_EXTENSIONS: &str =
    "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature\n";
const CLIENT_EXTENSIONS: &str = "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature\n";

/// `nbds://[user@]127.0.0.1:PORT/EXPORT?QUERY`.
fn nbds(server: &Server, user: Option<&str>, export: &str, query: &str) -> String {
    let user = user.map(|u| format!("{u}@")).unwrap_or_default();
    format!("nbds://{user}{}/{export}?{query}", server.nbd)
}

fn psk_query(dir: &Path) -> String {
    format!("tls-psk-file={}", dir.join("keys.psk").display())
}

fn host_port(server: &Server) -> (String, String) {
    let (host, port) = server.nbd.rsplit_once(':').unwrap();
    (host.to_string(), port.to_string())
}

/// qemu-io (or qemu-img) arguments opening `export` with the TLS object `object`.
fn qemu_args(server: &Server, object: &str, export: &str) -> Vec<String> {
    let (host, port) = host_port(server);
    vec![
        "--object".into(),
        object.into(),
        "--image-opts".into(),
        format!("driver=nbd,host={host},port={port},export={export},tls-creds=tls0"),
    ]
}

/// The export names `nbdinfo --list` shows for `uri`.
fn listed(uri: &str) -> Vec<String> {
    let out = stdout_of(Command::new("nbdinfo").arg("--list").arg(uri));
    out.lines()
        .filter_map(|line| line.strip_prefix("export=\"")?.strip_suffix("\":").map(str::to_string))
        .collect()
}

#[test]
fn psk_clients_read_and_write_and_wrong_keys_users_and_plaintext_are_refused() {
    tools();
    let root = tempfile::tempdir().unwrap();
    let alice = psk_dir(root.path(), "alice", "alice");
    let server_keys = server_psk_file(root.path(), &[&alice]);
    let data = root.path().join("data");
    let server = Server::start_with_args(
        &data,
        Some(&data),
        &["--tls=require", "--tls-psk", server_keys.to_str().unwrap()],
    );
    server.create_volume(VOLUME, "8M");

    // nbdcopy writes 4 MiB through TLS-PSK and reads the volume back.
    let expected = pseudo_random(18, 4 << 20);
    let source = root.path().join("source.raw");
    std::fs::write(&source, &expected).unwrap();
    let uri = nbds(&server, Some("alice"), VOLUME, &psk_query(&alice));
    run(Command::new("nbdcopy").arg(&source).arg(&uri));
    let copy = root.path().join("copy.raw");
    run(Command::new("nbdcopy").arg(&uri).arg(&copy));
    let copied = std::fs::read(&copy).unwrap();
    assert_eq!(copied.len(), 8 << 20);
    assert!(copied[..4 << 20] == expected[..], "data read back through TLS differs");

    // qemu-io with tls-creds-psk writes a pattern and reads it back; qemu-img sees the size.
    let object = format!(
        "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
        alice.display()
    );
    let mut qemu_io = Command::new("qemu-io");
    qemu_io
        .args(qemu_args(&server, &object, VOLUME))
        .args(["-c", "write -P 0x5a 4M 1M", "-c", "read -P 0x5a 4M 1M"]);
    let out = String::from_utf8_lossy(&run(&mut qemu_io).stdout).into_owned();
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert!(out.contains("read 1048576/1048576 bytes"), "{out}");
    let info = stdout_of(
        Command::new("qemu-img")
            .arg("info")
            .args(qemu_args(&server, &object, VOLUME)),
    );
    assert!(info.contains("virtual size: 8 MiB"), "{info}");
    // nbdinfo says it is TLS and sees qemu's pattern.
    let info = stdout_of(Command::new("nbdinfo").arg(&uri));
    assert!(info.contains("with TLS"), "{info}");
    let pattern = root.path().join("pattern.raw");
    run(Command::new("nbdcopy").arg(&uri).arg(&pattern));
    let read = std::fs::read(&pattern).unwrap();
    assert!(read[4 << 20..5 << 20].iter().all(|&b| b == 0x5a));
    assert!(read[..4 << 20] == expected[..]);

    // The same user name with another key is refused.
    let wrong = psk_dir(root.path(), "wrong", "alice");
    failing(Command::new("nbdinfo").arg(nbds(&server, Some("alice"), VOLUME, &psk_query(&wrong))));
    let object = format!(
        "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
        wrong.display()
    );
    failing(
        Command::new("qemu-img")
            .arg("info")
            .args(qemu_args(&server, &object, VOLUME)),
    );
    // A user the server does not know is refused.
    let mallory = psk_dir(root.path(), "mallory", "mallory");
    failing(Command::new("nbdinfo").arg(nbds(&server, Some("mallory"), VOLUME, &psk_query(&mallory))));

    // Plaintext clients get nothing: no list, no export.
    let plain = failing(
        Command::new("nbdinfo")
            .arg("--list")
            .arg(format!("nbd://{}", server.nbd)),
    );
    let stdout = String::from_utf8_lossy(&plain.stdout);
    assert!(!stdout.contains(VOLUME), "listed in plaintext: {stdout}");
    // (libnbd 1.14 reports NBD_REP_ERR_TLS_REQD as "Operation not supported".)
    let stderr = String::from_utf8_lossy(&plain.stderr);
    assert!(stderr.contains("list"), "{stderr}");
    failing(Command::new("nbdinfo").arg(server.uri(VOLUME)));
    failing(Command::new("qemu-img").arg("info").arg(server.uri(VOLUME)));
}

#[test]
fn x509_clients_connect_an_untrusted_ca_is_refused_and_client_certificates_are_checked() {
    tools();
    let root = tempfile::tempdir().unwrap();
    let ca = root.path().join("ca");
    make_ca(&ca, "strata test CA");
    let server_dir = root.path().join("server");
    make_cert(&ca, &server_dir, "server", "localhost", SERVER_EXTENSIONS);
    // Clients: alice and bob with certificates, and one with only the CA.
    let alice = root.path().join("alice");
    make_cert(&ca, &alice, "client", "alice", CLIENT_EXTENSIONS);
    let bob = root.path().join("bob");
    make_cert(&ca, &bob, "client", "bob", CLIENT_EXTENSIONS);
    let anonymous = root.path().join("anonymous");
    std::fs::create_dir_all(&anonymous).unwrap();
    std::fs::copy(ca.join("ca-cert.pem"), anonymous.join("ca-cert.pem")).unwrap();
    // A client that trusts another CA only.
    let other = root.path().join("other");
    make_ca(&other, "another CA");

    let data = root.path().join("data");
    let server = Server::start_with_args(
        &data,
        Some(&data),
        &["--tls=require", "--tls-certificates", server_dir.to_str().unwrap()],
    );
    let query = |dir: &Path| format!("tls-certificates={}", dir.display());
    let info = stdout_of(Command::new("nbdinfo").arg(nbds(&server, None, "default/vol0", &query(&anonymous))));
    assert!(info.contains("with TLS"), "{info}");
    let object = |dir: &Path| format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", dir.display());
    let out = stdout_of(
        Command::new("qemu-io")
            .args(qemu_args(&server, &object(&anonymous), "default/vol0"))
            .args(["-c", "write -P 0x33 0 64k", "-c", "read -P 0x33 0 64k"]),
    );
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert!(out.contains("read 65536/65536 bytes"), "{out}");
    // The server's certificate is not signed by a CA the client trusts.
    failing(Command::new("nbdinfo").arg(nbds(&server, None, "default/vol0", &query(&other))));
    failing(
        Command::new("qemu-img")
            .arg("info")
            .args(qemu_args(&server, &object(&other), "default/vol0")),
    );
    drop(server);

    // With --tls-verify-peer a client needs a certificate from the CA, and
    // its CN is its identity for nbd.tls_identities.
    let server = Server::start_with_args(
        &data,
        Some(&data),
        &[
            "--tls=require",
            "--tls-certificates",
            server_dir.to_str().unwrap(),
            "--tls-verify-peer",
        ],
    );
    failing(Command::new("nbdinfo").arg(nbds(&server, None, "default/vol0", &query(&anonymous))));
    server.create_volume(VOLUME, "8M");
    server.set_property(VOLUME, "nbd.tls_identities", "bob");
    let alice_sees = listed(&nbds(&server, None, "", &query(&alice)));
    assert!(alice_sees.contains(&"default/vol0".to_string()), "{alice_sees:?}");
    assert!(!alice_sees.contains(&VOLUME.to_string()), "{alice_sees:?}");
    failing(Command::new("nbdinfo").arg(nbds(&server, None, VOLUME, &query(&alice))));
    failing(
        Command::new("qemu-img")
            .arg("info")
            .args(qemu_args(&server, &object(&alice), VOLUME)),
    );
    let bob_sees = listed(&nbds(&server, None, "", &query(&bob)));
    assert!(bob_sees.contains(&VOLUME.to_string()), "{bob_sees:?}");
    let info = stdout_of(
        Command::new("qemu-img")
            .arg("info")
            .args(qemu_args(&server, &object(&bob), VOLUME)),
    );
    assert!(info.contains("virtual size: 8 MiB"), "{info}");
}

#[test]
fn tls_on_serves_plaintext_too_and_allow_lists_hide_volumes_from_others() {
    tools();
    let root = tempfile::tempdir().unwrap();
    let alice = psk_dir(root.path(), "alice", "alice");
    let bob = psk_dir(root.path(), "bob", "bob");
    let server_keys = server_psk_file(root.path(), &[&alice, &bob]);
    let data = root.path().join("data");
    let server = Server::start_with_args(
        &data,
        Some(&data),
        &["--tls=on", "--tls-psk", server_keys.to_str().unwrap()],
    );
    server.create_volume(VOLUME, "8M");
    server.set_property(VOLUME, "nbd.tls_identities", "alice");

    // Plaintext works for a volume without a list, and does not see or open
    // the listed one (it needs TLS).
    let plain = listed(&format!("nbd://{}", server.nbd));
    assert!(plain.contains(&"default/vol0".to_string()), "{plain:?}");
    assert!(!plain.contains(&VOLUME.to_string()), "{plain:?}");
    let info = stdout_of(Command::new("nbdinfo").arg(server.uri("default/vol0")));
    assert!(!info.contains("with TLS"), "{info}");
    failing(Command::new("nbdinfo").arg(server.uri(VOLUME)));
    failing(Command::new("qemu-img").arg("info").arg(server.uri(VOLUME)));

    // alice sees and opens it over TLS; bob neither sees nor opens it.
    let alice_sees = listed(&nbds(&server, Some("alice"), "", &psk_query(&alice)));
    assert!(alice_sees.contains(&VOLUME.to_string()), "{alice_sees:?}");
    let info = stdout_of(Command::new("nbdinfo").arg(nbds(&server, Some("alice"), VOLUME, &psk_query(&alice))));
    assert!(info.contains("with TLS") && info.contains("8388608"), "{info}");
    let bob_sees = listed(&nbds(&server, Some("bob"), "", &psk_query(&bob)));
    assert!(!bob_sees.contains(&VOLUME.to_string()), "{bob_sees:?}");
    assert!(bob_sees.contains(&"default/vol0".to_string()), "{bob_sees:?}");
    failing(Command::new("nbdinfo").arg(nbds(&server, Some("bob"), VOLUME, &psk_query(&bob))));
    let object = format!(
        "tls-creds-psk,id=tls0,endpoint=client,dir={},username=bob",
        bob.display()
    );
    failing(
        Command::new("qemu-img")
            .arg("info")
            .args(qemu_args(&server, &object, VOLUME)),
    );
}

/// Starts `strata serve` with `args` and expects it to refuse: its stderr.
fn refused_start(data: &Path, args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("serve")
        .arg("--data-dir")
        .arg(data)
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
        .args(args)
        .env("STRATA_RAM_DIR", data)
        .output()
        .unwrap();
    assert!(!output.status.success(), "strata serve {args:?} started");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn the_daemon_refuses_tls_without_credentials_and_readable_keys() {
    tools();
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let error = refused_start(&data, &["--tls=require"]);
    assert!(error.contains("needs credentials"), "{error}");
    let alice = psk_dir(root.path(), "alice", "alice");
    let keys = alice.join("keys.psk");
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o644)).unwrap();
    let error = refused_start(&data, &["--tls-psk", keys.to_str().unwrap()]);
    assert!(error.contains("chmod 600"), "{error}");
    let error = refused_start(&data, &["--tls-certificates", root.path().to_str().unwrap()]);
    assert!(error.contains("server-cert.pem not found"), "{error}");
}

/// Opens a plaintext NBD connection and finishes the greeting: the socket.
fn greeted(server: &Server) -> std::net::TcpStream {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(&server.nbd).unwrap();
    socket
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut greeting = [0u8; 18];
    socket.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting[..8], b"NBDMAGIC");
    socket.write_all(&3u32.to_be_bytes()).unwrap(); // fixed newstyle, no zeroes
    socket
}

/// Sends option `option` with `data` and returns the reply types up to
/// the first that is not NBD_REP_SERVER.
fn option_replies(socket: &mut std::net::TcpStream, option: u32, data: &[u8]) -> Vec<u32> {
    use std::io::{Read, Write};
    let mut message = b"IHAVEOPT".to_vec();
    message.extend_from_slice(&option.to_be_bytes());
    message.extend_from_slice(&(data.len() as u32).to_be_bytes());
    message.extend_from_slice(data);
    socket.write_all(&message).unwrap();
    let mut kinds = Vec::new();
    loop {
        let mut header = [0u8; 20];
        socket.read_exact(&mut header).unwrap();
        assert_eq!(
            u64::from_be_bytes(header[..8].try_into().unwrap()),
            0x0003_e889_0455_65a9
        );
        assert_eq!(u32::from_be_bytes(header[8..12].try_into().unwrap()), option);
        let kind = u32::from_be_bytes(header[12..16].try_into().unwrap());
        let length = u32::from_be_bytes(header[16..20].try_into().unwrap());
        let mut payload = vec![0u8; length as usize];
        socket.read_exact(&mut payload).unwrap();
        kinds.push(kind);
        if kind != 2 {
            return kinds;
        }
    }
}

const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_ERR_POLICY: u32 = (1 << 31) + 2;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
const OPT_LIST: u32 = 3;
const OPT_STARTTLS: u32 = 5;
const OPT_GO: u32 = 7;

#[test]
fn the_option_replies_follow_the_protocol_for_each_mode() {
    tools();
    let root = tempfile::tempdir().unwrap();
    let alice = psk_dir(root.path(), "alice", "alice");
    let keys = alice.join("keys.psk");
    let go_vol0 = {
        let name = b"default/vol0";
        let mut data = (name.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(name);
        data.extend_from_slice(&0u16.to_be_bytes());
        data
    };

    // off: STARTTLS is refused by policy, everything else works.
    let data = root.path().join("off");
    let server = Server::start_with_args(&data, Some(&data), &[]);
    let mut socket = greeted(&server);
    assert_eq!(option_replies(&mut socket, OPT_STARTTLS, &[]), [REP_ERR_POLICY]);
    assert_eq!(option_replies(&mut socket, OPT_LIST, &[]), [REP_SERVER, REP_ACK]);
    drop(server);

    // require: LIST and GO get TLS_REQD (no export named), STARTTLS with data
    // is invalid, a bare STARTTLS is acknowledged.
    let data = root.path().join("require");
    let server = Server::start_with_args(&data, Some(&data), &["--tls-psk", keys.to_str().unwrap()]);
    let mut socket = greeted(&server);
    assert_eq!(option_replies(&mut socket, OPT_LIST, &[]), [REP_ERR_TLS_REQD]);
    assert_eq!(option_replies(&mut socket, OPT_GO, &go_vol0), [REP_ERR_TLS_REQD]);
    assert_eq!(option_replies(&mut socket, OPT_STARTTLS, b"x"), [REP_ERR_INVALID]);
    assert_eq!(option_replies(&mut socket, OPT_STARTTLS, &[]), [REP_ACK]);
    drop(server);

    // on: plaintext LIST and GO work; a volume with a list needs TLS.
    let data = root.path().join("on");
    let server = Server::start_with_args(&data, Some(&data), &["--tls=on", "--tls-psk", keys.to_str().unwrap()]);
    server.set_property("default/vol0", "nbd.tls_identities", "alice");
    let mut socket = greeted(&server);
    assert_eq!(option_replies(&mut socket, OPT_LIST, &[]), [REP_ACK]);
    assert_eq!(option_replies(&mut socket, OPT_GO, &go_vol0), [REP_ERR_TLS_REQD]);
    server.set_property("default/vol0", "nbd.tls_identities", "*");
    let mut socket = greeted(&server);
    assert_eq!(option_replies(&mut socket, OPT_LIST, &[]), [REP_SERVER, REP_ACK]);
    assert_eq!(option_replies(&mut socket, OPT_GO, &go_vol0)[0], 3, "NBD_REP_INFO");
}
