//! The CLI's connection to the daemon's REST API: the Unix socket by
//! default, TCP with the bearer token, TLS for `https://` addresses.
//!
//! Where it goes, in order: `--api`/`STRATA_API` when given (`unix:PATH`
//! or a path, `HOST:PORT`/`http://HOST:PORT`, `https://HOST:PORT`), else
//! the socket `DATA_DIR/api.sock` (`--data-dir`/`STRATA_DATA_DIR`, default
//! `./strata-data`). Over TCP the token is `--token`/`STRATA_TOKEN`, else
//! `DATA_DIR/api.token` when this user can read it. Over TLS the daemon's
//! certificate must be `--cacert`/`STRATA_CACERT` or, by default, the
//! daemon's own `DATA_DIR/api.crt` (pinned: nothing else is trusted).

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use openssl::ssl::SslConnector;

use super::Io;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
pub const DEFAULT_PORT: u16 = 9860;

/// Where the API is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    /// `host:port` (as messages show it) and the host alone (for TLS name checks).
    Tcp {
        address: String,
        host: String,
        tls: bool,
    },
}

impl Endpoint {
    /// Parses `--api`: `unix:PATH`, a path (`/...`, `./...`), `HOST[:PORT]`,
    /// `http://HOST[:PORT]` or `https://HOST[:PORT]`.
    pub fn parse(text: &str) -> Result<Endpoint, String> {
        let trimmed = text.trim();
        if let Some(path) = trimmed.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(format!("invalid --api '{text}': unix: needs a socket path"));
            }
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        if trimmed.starts_with('/') || trimmed.starts_with("./") || trimmed.starts_with("../") {
            return Ok(Endpoint::Unix(PathBuf::from(trimmed)));
        }
        let usage =
            || format!("invalid --api '{text}': use HOST:PORT, http://HOST:PORT, https://HOST:PORT or unix:PATH");
        let (rest, tls) = if let Some(rest) = trimmed.strip_prefix("http://") {
            (rest, false)
        } else if let Some(rest) = trimmed.strip_prefix("https://") {
            (rest, true)
        } else if trimmed.contains("://") {
            return Err(usage());
        } else {
            (trimmed, false)
        };
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        let valid = !authority.is_empty()
            && !authority.contains(['/', '?', '#', '@'])
            && !authority.chars().any(char::is_whitespace);
        if !valid {
            return Err(usage());
        }
        // A bare host (or [v6 address]) gets the default port.
        let port_colon = authority.rfind(':').filter(|&colon| !authority[colon..].contains(']'));
        let (host, address) = match port_colon {
            Some(colon) => {
                let port = &authority[colon + 1..];
                if port.parse::<u16>().is_err() {
                    return Err(format!("invalid --api '{text}': bad port '{port}'"));
                }
                (&authority[..colon], authority.to_string())
            }
            None => (authority, format!("{authority}:{DEFAULT_PORT}")),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
        if host.is_empty() {
            return Err(usage());
        }
        Ok(Endpoint::Tcp { address, host, tls })
    }

    /// How messages name it.
    pub fn describe(&self) -> String {
        match self {
            Endpoint::Unix(path) => path.display().to_string(),
            Endpoint::Tcp { address, .. } => address.clone(),
        }
    }
}

/// What the CLI was told about reaching the daemon.
pub struct Settings {
    pub api: Option<String>,
    pub data_dir: PathBuf,
    pub token: Option<String>,
    pub cacert: Option<PathBuf>,
}

/// An answer: HTTP status and body.
pub struct Answer {
    pub status: u16,
    pub body: String,
}

pub struct Client {
    endpoint: Endpoint,
    token: Option<String>,
    tls: Option<SslConnector>,
    runtime: tokio::runtime::Runtime,
}

impl Client {
    pub fn new(settings: &Settings) -> Result<Client, String> {
        let endpoint = match &settings.api {
            Some(api) => Endpoint::parse(api)?,
            None => Endpoint::Unix(super::auth::default_socket(&settings.data_dir)),
        };
        let token = match (&endpoint, &settings.token) {
            (Endpoint::Unix(_), _) => None,
            (_, Some(token)) => Some(token.trim().to_string()),
            // Readable only by whoever may read the daemon's files; for
            // anyone else the daemon's 401 says what to do.
            (_, None) => std::fs::read_to_string(settings.data_dir.join(super::auth::TOKEN_FILE))
                .ok()
                .map(|t| t.trim().to_string()),
        };
        let tls = match &endpoint {
            Endpoint::Tcp { tls: true, .. } => {
                let ca = settings
                    .cacert
                    .clone()
                    .unwrap_or_else(|| settings.data_dir.join("api.crt"));
                if !ca.exists() {
                    return Err(format!(
                        "no certificate to trust for {}: give --cacert FILE (or STRATA_CACERT) with the daemon's certificate, its DATA_DIR/api.crt",
                        endpoint.describe()
                    ));
                }
                Some(crate::tls::connector(&ca)?)
            }
            _ => None,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start: {e}"))?;
        Ok(Client {
            endpoint,
            token,
            tls,
            runtime,
        })
    }

    pub fn describe(&self) -> String {
        self.endpoint.describe()
    }

    /// One request; any answer the daemon gives, or why there was none.
    pub fn request(&self, method: &str, path: &str, body: Option<String>) -> Result<Answer, String> {
        let exchange = self.exchange(method, path, body);
        self.runtime.block_on(async {
            match tokio::time::timeout(REQUEST_TIMEOUT, exchange).await {
                Ok(result) => result,
                Err(_) => Err(format!(
                    "request to the strata daemon at {} failed (timed out)",
                    self.describe()
                )),
            }
        })
    }

    async fn connect(&self) -> Result<Box<dyn Io>, String> {
        match &self.endpoint {
            Endpoint::Unix(path) => match tokio::net::UnixStream::connect(path).await {
                Ok(stream) => Ok(Box::new(stream)),
                Err(e) => Err(unix_message(path, &e)),
            },
            Endpoint::Tcp { address, host, .. } => {
                let stream = match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(address)).await
                {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => return Err(tcp_message(address, &e)),
                    Err(_) => {
                        return Err(format!(
                            "cannot reach the strata daemon at {address} (timed out); is 'strata serve' running? set --api or STRATA_API"
                        ))
                    }
                };
                let _ = stream.set_nodelay(true);
                let Some(connector) = &self.tls else {
                    return Ok(Box::new(stream));
                };
                let ssl = connector
                    .configure()
                    .and_then(|c| c.into_ssl(host))
                    .map_err(|e| format!("cannot set up TLS for {address}: {e}"))?;
                let mut tls = tokio_openssl::SslStream::new(ssl, stream).map_err(|e| e.to_string())?;
                match tokio::time::timeout(CONNECT_TIMEOUT, Pin::new(&mut tls).connect()).await {
                    Ok(Ok(())) => Ok(Box::new(tls)),
                    Ok(Err(e)) => {
                        let verify = tls.ssl().verify_result();
                        let reason = if verify != openssl::x509::X509VerifyResult::OK {
                            format!("the daemon's certificate is not trusted: {}", verify.error_string())
                        } else {
                            e.to_string()
                        };
                        Err(format!(
                            "TLS with the strata daemon at {address} failed ({reason}); give --cacert FILE with the daemon's certificate (its DATA_DIR/api.crt)"
                        ))
                    }
                    Err(_) => Err(format!("TLS with the strata daemon at {address} failed (timed out)")),
                }
            }
        }
    }

    async fn exchange(&self, method: &str, path: &str, body: Option<String>) -> Result<Answer, String> {
        let io = self.connect().await?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| self.failed(&e))?;
        let driver = tokio::spawn(connection);
        let host = match &self.endpoint {
            Endpoint::Unix(_) => "localhost".to_string(),
            Endpoint::Tcp { address, .. } => address.clone(),
        };
        let mut builder = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("Host", host)
            .header("Accept", "application/json");
        if let Some(token) = &self.token {
            builder = builder.header("Authorization", format!("Bearer {token}"));
        }
        let request = match body {
            Some(body) => builder
                .header("Content-Type", "application/json")
                .body(Full::new(Bytes::from(body))),
            None => builder.body(Full::new(Bytes::new())),
        }
        .map_err(|e| format!("invalid request {method} {path}: {e}"))?;
        let response = sender.send_request(request).await.map_err(|e| self.failed(&e))?;
        let status = response.status().as_u16();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("cannot read the answer from {}: {e}", self.describe()))?
            .to_bytes();
        driver.abort();
        Ok(Answer {
            status,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        })
    }

    /// A request whose body and answer may be long streams (send and
    /// receive): `body` feeds the request body (none: empty); a 2xx answer's
    /// body goes chunk by chunk to `sink` when `stream_answer`, after
    /// `started` was given its headers; any other answer is collected. No
    /// overall timeout: a stream takes as long as it takes.
    pub fn stream(
        &self,
        method: &str,
        path: &str,
        body: Option<tokio::sync::mpsc::Receiver<Result<Bytes, String>>>,
        stream_answer: bool,
        started: &mut dyn FnMut(&hyper::HeaderMap),
        sink: &mut dyn FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<Answer, String> {
        self.runtime.block_on(async {
            let io = self.connect().await?;
            let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
                .await
                .map_err(|e| self.failed(&e))?;
            let driver = tokio::spawn(connection);
            let host = match &self.endpoint {
                Endpoint::Unix(_) => "localhost".to_string(),
                Endpoint::Tcp { address, .. } => address.clone(),
            };
            let mut builder = hyper::Request::builder()
                .method(method)
                .uri(path)
                .header("Host", host)
                .header("Accept", "application/json");
            if let Some(token) = &self.token {
                builder = builder.header("Authorization", format!("Bearer {token}"));
            }
            let request_body: http_body_util::combinators::BoxBody<Bytes, std::io::Error> = match body {
                Some(receiver) => {
                    builder = builder.header("Content-Type", super::send::STREAM_CONTENT_TYPE);
                    BodyExt::boxed(super::send::ChannelBody(receiver))
                }
                None => BodyExt::boxed(Full::new(Bytes::new()).map_err(|never| match never {})),
            };
            let request = builder
                .body(request_body)
                .map_err(|e| format!("invalid request {method} {path}: {e}"))?;
            let response = sender.send_request(request).await.map_err(|e| self.failed(&e))?;
            let status = response.status().as_u16();
            let streaming = stream_answer && (200..300).contains(&status);
            if streaming {
                started(response.headers());
            }
            let mut answer = response.into_body();
            let mut collected = Vec::new();
            while let Some(frame) = answer.frame().await {
                let frame = frame.map_err(|e| {
                    format!(
                        "the stream from the strata daemon at {} broke off ({e})",
                        self.describe()
                    )
                })?;
                if let Ok(data) = frame.into_data() {
                    if streaming {
                        sink(&data)?;
                    } else {
                        collected.extend_from_slice(&data);
                    }
                }
            }
            driver.abort();
            Ok(Answer {
                status,
                body: String::from_utf8_lossy(&collected).into_owned(),
            })
        })
    }

    fn failed(&self, error: &hyper::Error) -> String {
        format!("request to the strata daemon at {} failed ({error})", self.describe())
    }

    /// Whether a token will be sent (for the 401 hint).
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }
}

/// "Connection refused (os error 111)" -> "connection refused".
fn reason(error: &std::io::Error) -> String {
    let text = error.to_string();
    let text = text.split(" (os error").next().unwrap_or(&text).trim().to_string();
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => "unknown error".to_string(),
    }
}

fn tcp_message(address: &str, error: &std::io::Error) -> String {
    format!(
        "cannot reach the strata daemon at {address} ({}); is 'strata serve' running? set --api or STRATA_API",
        reason(error)
    )
}

fn unix_message(path: &Path, error: &std::io::Error) -> String {
    match error.kind() {
        std::io::ErrorKind::NotFound => format!(
            "cannot reach the strata daemon: no API socket at {} ; is 'strata serve' running on that data directory? give --data-dir DIR, or --api HOST:PORT",
            path.display()
        ),
        std::io::ErrorKind::PermissionDenied => format!(
            "permission denied on the API socket {}: run as root, as the daemon's user, or as a member of the group given to 'strata serve --api-socket-group'",
            path.display()
        ),
        _ => format!(
            "cannot reach the strata daemon at {} ({}); is 'strata serve' running? set --api or STRATA_API",
            path.display(),
            reason(error)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_addresses() {
        let tcp = |text: &str| match Endpoint::parse(text) {
            Ok(Endpoint::Tcp { address, tls, .. }) => Some((address, tls)),
            _ => None,
        };
        assert_eq!(tcp("127.0.0.1:9860"), Some(("127.0.0.1:9860".into(), false)));
        assert_eq!(tcp("http://127.0.0.1:1234/"), Some(("127.0.0.1:1234".into(), false)));
        assert_eq!(tcp("https://127.0.0.1:1234"), Some(("127.0.0.1:1234".into(), true)));
        assert_eq!(tcp("localhost"), Some(("localhost:9860".into(), false)));
        assert_eq!(tcp("[::1]"), Some(("[::1]:9860".into(), false)));
        assert_eq!(tcp("[::1]:80"), Some(("[::1]:80".into(), false)));
        assert_eq!(
            Endpoint::parse("unix:/run/s.sock"),
            Ok(Endpoint::Unix("/run/s.sock".into()))
        );
        assert_eq!(
            Endpoint::parse("./d/api.sock"),
            Ok(Endpoint::Unix("./d/api.sock".into()))
        );
        for bad in ["", "ftp://x", "x:port", "x:1/path", "http://", "unix:", "https://:1"] {
            assert!(Endpoint::parse(bad).is_err(), "{bad} should be refused");
        }
    }
}
