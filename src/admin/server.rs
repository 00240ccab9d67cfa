//! The REST API's listeners: the Unix socket, and TCP (plain on loopback,
//! TLS otherwise). Each accepted connection is served by hyper with the
//! caller attached to every request ([`Caller`]), which the authentication
//! middleware (`admin::auth`) reads.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use openssl::ssl::{Ssl, SslAcceptor};
use tokio::net::{TcpListener, UnixListener};

use super::auth::Caller;
use super::Io;
use crate::frontend::limits::ConnectionLimits;
use crate::frontend::Connections;
use crate::frontend::Shutdown;

/// A client has this long to complete TLS and then to send each request's
/// headers; a slow or idle one is cut.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Open API connections at once, over both listeners: plenty for scripts
/// and dashboards, and a bound on what idle clients can hold.
const MAX_API_CONNECTIONS: usize = 256;
/// Open API connections one client address may hold (the Unix socket's
/// callers count as one client).
const MAX_API_CONNECTIONS_PER_CLIENT: usize = 64;

/// The API's TCP side: a listener and, when TLS is on, its acceptor.
pub struct TcpApi {
    pub listener: TcpListener,
    pub tls: Option<Arc<SslAcceptor>>,
}

/// Binds the Unix socket at `path` (a stale one from an unclean stop is
/// replaced: the data directory's lock, taken before, proves no other
/// daemon owns it) with mode 0660, group `group` if given.
pub fn bind_socket(path: &Path, group: Option<u32>) -> Result<UnixListener, String> {
    match std::fs::symlink_metadata(path) {
        Ok(metadata) if std::os::unix::fs::FileTypeExt::is_socket(&metadata.file_type()) => {
            std::fs::remove_file(path).map_err(|e| format!("cannot remove the old socket {}: {e}", path.display()))?;
        }
        Ok(_) => {
            return Err(format!(
                "{} exists and is not a socket; move it away or give --api-socket",
                path.display()
            ))
        }
        Err(_) => {}
    }
    // Created owner-only (umask 0177 around bind), then opened to the group:
    // no moment where others could connect.
    // SAFETY: umask only changes this process's file creation mask.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    let listener = bound.map_err(|e| format!("cannot listen on the API socket {}: {e}", path.display()))?;
    if let Some(gid) = group {
        std::os::unix::fs::chown(path, None, Some(gid))
            .map_err(|e| format!("cannot give {} to group {gid}: {e}", path.display()))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| format!("cannot set the mode of {}: {e}", path.display()))?;
    Ok(listener)
}

/// A group name or number as a gid.
pub fn group_id(group: &str) -> Result<u32, String> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let name = std::ffi::CString::new(group).map_err(|_| format!("invalid group name '{group}'"))?;
    // SAFETY: `libc::group` is plain C data; all zeros is a valid value.
    let mut entry: libc::group = unsafe { std::mem::zeroed() };
    let mut buffer = vec![0 as libc::c_char; 16 * 1024];
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: getgrnam_r writes into `entry` and `buffer`, both live and
    // sized as passed; `result` points at `entry` or is null.
    let status = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            &mut entry,
            buffer.as_mut_ptr(),
            buffer.len(),
            &mut result,
        )
    };
    if status != 0 || result.is_null() {
        return Err(format!("no such group '{group}'"));
    }
    Ok(entry.gr_gid)
}

/// Serves `router` on the socket and the TCP listener until `stop`.
pub async fn serve(router: Router, unix: UnixListener, unix_path: PathBuf, tcp: TcpApi, mut stop: Shutdown) {
    let limits = ConnectionLimits::new("api", MAX_API_CONNECTIONS, MAX_API_CONNECTIONS_PER_CLIENT);
    let mut connections = Connections::default();
    loop {
        let event = tokio::select! {
            _ = stop.wait_for(|stopped| *stopped) => break,
            accepted = unix.accept() => accepted.map(|(stream, _)| {
                let credentials = stream.peer_cred().ok();
                let caller = Caller::Unix {
                    uid: credentials.map_or(u32::MAX, |c| c.uid()),
                    pid: credentials.and_then(|c| c.pid()),
                };
                (Accepted::Plain(Box::new(stream)), caller)
            }),
            accepted = tcp.listener.accept() => accepted.map(|(stream, peer)| {
                let _ = stream.set_nodelay(true);
                let connection = match &tcp.tls {
                    Some(acceptor) => Accepted::Tls(stream, acceptor.clone()),
                    None => Accepted::Plain(Box::new(stream)),
                };
                (connection, Caller::Tcp { peer })
            }),
        };
        let (connection, caller) = match event {
            Ok(accepted) => accepted,
            Err(e) => {
                // Typically EMFILE; back off instead of spinning.
                tracing::warn!("api: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let client = match &caller {
            Caller::Tcp { peer } => peer.ip(),
            Caller::Unix { .. } => std::net::IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        };
        let Ok(slot) = limits.admit(client) else {
            continue;
        };
        let router = router.clone();
        let stop = stop.clone();
        connections.spawn(async move {
            let _slot = slot;
            let io: Box<dyn Io> = match connection {
                Accepted::Plain(io) => io,
                Accepted::Tls(stream, acceptor) => match tls_accept(stream, &acceptor).await {
                    Ok(io) => io,
                    Err(e) => {
                        tracing::info!("api: TLS with {caller} failed: {e}");
                        return;
                    }
                },
            };
            serve_connection(io, router, caller, stop).await;
        });
    }
    connections.drain("api").await;
    let _ = std::fs::remove_file(&unix_path);
}

enum Accepted {
    Plain(Box<dyn Io>),
    Tls(tokio::net::TcpStream, Arc<SslAcceptor>),
}

async fn tls_accept(stream: tokio::net::TcpStream, acceptor: &SslAcceptor) -> Result<Box<dyn Io>, String> {
    let ssl = Ssl::new(acceptor.context()).map_err(|e| e.to_string())?;
    let mut tls = tokio_openssl::SslStream::new(ssl, stream).map_err(|e| e.to_string())?;
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, Pin::new(&mut tls).accept()).await {
        Ok(Ok(())) => Ok(Box::new(tls)),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no handshake within {HANDSHAKE_TIMEOUT:?}")),
    }
}

async fn serve_connection(io: Box<dyn Io>, router: Router, caller: Caller, mut stop: Shutdown) {
    let service = tower::ServiceExt::map_request(router, move |mut request: axum::http::Request<Incoming>| {
        request.extensions_mut().insert(caller.clone());
        request
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HANDSHAKE_TIMEOUT)
        .serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
    tokio::pin!(connection);
    let stopping = async move {
        let _ = stop.wait_for(|stopped| *stopped).await;
    };
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(e) = result {
                tracing::debug!("api: connection ended: {e}");
            }
            return;
        }
        () = stopping => {}
    }
    // Stopping: finish the request in progress, then close.
    connection.as_mut().graceful_shutdown();
    let _ = connection.await;
}

/// Whether a socket address may serve the API without TLS.
pub fn is_loopback(address: &std::net::SocketAddr) -> bool {
    address.ip().is_loopback()
}

/// The API's certificate and key: `--api-cert`/`--api-key` when given, else
/// `DATA_DIR/api.crt` and `api.key`, made self-signed at first use for
/// `localhost`, this host's name, the loopback addresses and `address`.
pub fn certificate(
    data_dir: &Path,
    address: &std::net::SocketAddr,
    given: Option<(PathBuf, PathBuf)>,
) -> Result<(PathBuf, PathBuf), String> {
    if let Some(pair) = given {
        return Ok(pair);
    }
    let cert = data_dir.join("api.crt");
    let key = data_dir.join("api.key");
    if cert.exists() && key.exists() {
        crate::private::tighten(&key)?;
        return Ok((cert, key));
    }
    let host = hostname();
    let mut names = vec!["localhost".to_string()];
    names.extend(host.clone());
    let mut ips: Vec<std::net::IpAddr> = vec!["127.0.0.1".parse().expect("an IP"), "::1".parse().expect("an IP")];
    if !address.ip().is_unspecified() && !ips.contains(&address.ip()) {
        ips.push(address.ip());
    }
    let made = crate::tls::self_signed(host.as_deref().unwrap_or("strata"), &names, &ips)?;
    // The key first: a crash between the two leaves no certificate without its key.
    let _ = std::fs::remove_file(&key);
    crate::private::write_private_file(&key, &made.key_pem)
        .map_err(|e| format!("cannot write {}: {e}", key.display()))?;
    std::fs::write(&cert, &made.cert_pem).map_err(|e| format!("cannot write {}: {e}", cert.display()))?;
    tracing::info!(
        "api: made a self-signed certificate {} for {names:?} and {ips:?} (sha256 {})",
        cert.display(),
        crate::tls::fingerprint(&made.cert_pem).unwrap_or_default()
    );
    Ok((cert, key))
}

fn hostname() -> Option<String> {
    let mut buffer = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the live buffer.
    let status = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) };
    if status != 0 {
        return None;
    }
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    let name = String::from_utf8_lossy(&buffer[..end]).trim().to_string();
    (!name.is_empty()).then_some(name)
}
