//! Who may use the REST API, and the audit trail of what they changed.
//!
//! Two ways in, as with dockerd and libvirtd:
//! - the Unix socket in the data directory (mode 0660, the daemon's owner
//!   and an optional group): reaching it is the credential, checked by the
//!   kernel's file permissions; the caller is named by its peer uid;
//! - TCP, where every request but an open `GET /metrics`, the dashboard's
//!   page (`GET /ui`, no data in it) and `GET /openapi.json` carries
//!   `Authorization: Bearer TOKEN`, the token created at first start in
//!   `DATA_DIR/api.token` (mode 0600). The token is named in logs by its id,
//!   the first 8 hex digits of its SHA-256, never by itself.
//!
//! Every request that can change something (any method but GET/HEAD)
//! logs one audit line (target `strata::audit`): who, what, the result.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// The token file's name in the data directory.
pub const TOKEN_FILE: &str = "api.token";
/// Random bytes in a token (written as 64 hex digits).
const TOKEN_BYTES: usize = 32;

/// The connection a request came in on, attached by the API's accept loop.
#[derive(Debug, Clone)]
pub enum Caller {
    /// The Unix socket; the peer's credentials as the kernel gave them.
    Unix { uid: u32, pid: Option<i32> },
    /// TCP (plain on loopback, or TLS).
    Tcp { peer: SocketAddr },
}

impl std::fmt::Display for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Caller::Unix { uid, pid: Some(pid) } => write!(f, "uid {uid} (pid {pid}, unix socket)"),
            Caller::Unix { uid, pid: None } => write!(f, "uid {uid} (unix socket)"),
            Caller::Tcp { peer } => write!(f, "{peer}"),
        }
    }
}

/// The API's credentials and policy.
pub struct ApiAuth {
    token: Vec<u8>,
    token_id: String,
    /// `GET /metrics` over TCP without a token (node_exporter's default).
    metrics_open: bool,
}

impl ApiAuth {
    pub fn new(token: String, metrics_open: bool) -> ApiAuth {
        let token_id = token_id(&token);
        ApiAuth {
            token: token.into_bytes(),
            token_id,
            metrics_open,
        }
    }

    /// Reads `DATA_DIR/api.token`, creating it (mode 0600) at first start;
    /// an existing file readable by others is tightened, with a log line.
    pub fn load_or_create(data_dir: &Path, metrics_open: bool) -> Result<ApiAuth, String> {
        let path = data_dir.join(TOKEN_FILE);
        let token = match std::fs::read_to_string(&path) {
            Ok(text) => {
                crate::private::tighten(&path)?;
                let token = text.trim().to_string();
                if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(format!(
                        "{} does not hold a usable token (at least 16 printable characters); delete it to have a new one made",
                        path.display()
                    ));
                }
                token
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let bytes = crate::tls::random_bytes(TOKEN_BYTES)?;
                let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
                crate::private::write_private_file(&path, format!("{token}\n").as_bytes())
                    .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
                tracing::info!(
                    "api: created the API token {} (id {})",
                    path.display(),
                    token_id(&token)
                );
                token
            }
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        Ok(ApiAuth::new(token, metrics_open))
    }

    pub fn token_id(&self) -> &str {
        &self.token_id
    }

    /// Who is asking, or why they may not.
    fn identify(&self, caller: Option<&Caller>, request: &Request) -> Result<String, (String, &'static str)> {
        match caller {
            Some(unix @ Caller::Unix { .. }) => Ok(unix.to_string()),
            Some(Caller::Tcp { peer }) => {
                if self.metrics_open && request.uri().path() == "/metrics" && request.method() == Method::GET {
                    return Ok(format!("{peer} (open /metrics)"));
                }
                // The dashboard's page and the API's description hold no
                // data: the page asks for the token and sends it with every
                // request it makes.
                if matches!(request.uri().path(), "/ui" | "/openapi.json") && request.method() == Method::GET {
                    return Ok(format!("{peer} (dashboard page)"));
                }
                let anonymous = format!("{peer} (no valid token)");
                let Some(value) = request.headers().get(header::AUTHORIZATION) else {
                    return Err((anonymous, "missing"));
                };
                let presented = value
                    .to_str()
                    .ok()
                    .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
                    .map(str::trim);
                match presented {
                    Some(token) if crate::tls::secrets_equal(token.as_bytes(), &self.token) => {
                        Ok(format!("token {} from {peer}", self.token_id))
                    }
                    Some(_) => Err((anonymous, "invalid")),
                    None => Err((anonymous, "malformed")),
                }
            }
            // Only the accept loop builds requests; one without a caller is a bug.
            None => Err(("unknown connection".to_string(), "missing")),
        }
    }
}

/// A token's public name: the first 8 hex digits of its SHA-256.
fn token_id(token: &str) -> String {
    match openssl::hash::hash(openssl::hash::MessageDigest::sha256(), token.as_bytes()) {
        Ok(digest) => digest.iter().take(4).map(|b| format!("{b:02x}")).collect(),
        Err(_) => "unknown".to_string(),
    }
}

/// Methods that cannot change anything.
fn read_only(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// The middleware in front of every route: 401 unless the caller is
/// authenticated; an audit line for each request that may change state.
pub async fn authenticate(State(auth): State<Arc<ApiAuth>>, request: Request, next: Next) -> Response {
    let caller = request.extensions().get::<Caller>().cloned();
    let what = format!("{} {}", request.method(), request.uri().path());
    let audited = !read_only(request.method());
    match auth.identify(caller.as_ref(), &request) {
        Ok(who) => {
            let response = next.run(request).await;
            if audited {
                tracing::info!(target: "strata::audit", "audit: who={who} what=\"{what}\" result={}", response.status().as_u16());
            }
            response
        }
        Err((who, problem)) => {
            if audited {
                tracing::warn!(target: "strata::audit", "audit: who={who} what=\"{what}\" result=401 ({problem} token)");
            } else {
                tracing::debug!("api: refused {what} from {who}: {problem} token");
            }
            let message = match problem {
                "invalid" => "invalid API token",
                "malformed" => "malformed Authorization header: expected 'Bearer TOKEN'",
                _ => "authentication required: send 'Authorization: Bearer TOKEN' (the token is in the daemon's DATA_DIR/api.token) or use the Unix socket",
            };
            (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer realm=\"strata\"")],
                Json(json!({ "error": message })),
            )
                .into_response()
        }
    }
}

/// Where the daemon's Unix socket is by default.
pub fn default_socket(data_dir: &Path) -> PathBuf {
    data_dir.join("api.sock")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_token_is_created_private_and_read_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let first = ApiAuth::load_or_create(dir.path(), true).unwrap();
        let path = dir.path().join(TOKEN_FILE);
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.trim().len(), 64);
        let second = ApiAuth::load_or_create(dir.path(), true).unwrap();
        assert_eq!(first.token, second.token);
        assert_eq!(first.token_id().len(), 8);

        // A loose file is tightened; a junk one is refused.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        ApiAuth::load_or_create(dir.path(), true).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::write(&path, "short\n").unwrap();
        assert!(ApiAuth::load_or_create(dir.path(), true).is_err());
    }

    fn request(path: &str, authorization: Option<&str>) -> Request {
        let mut builder = axum::http::Request::builder().uri(path).method(Method::POST);
        if let Some(value) = authorization {
            builder = builder.header(header::AUTHORIZATION, value);
        }
        builder.body(axum::body::Body::empty()).unwrap()
    }

    #[test]
    fn tcp_callers_need_the_token_and_socket_callers_do_not() {
        let auth = ApiAuth::new("0123456789abcdef0123".into(), true);
        let tcp = Caller::Tcp {
            peer: "127.0.0.1:5".parse().unwrap(),
        };
        assert!(auth
            .identify(Some(&tcp), &request("/v1/pools", Some("Bearer 0123456789abcdef0123")))
            .is_ok());
        for bad in [
            None,
            Some("Bearer wrong"),
            Some("Basic abc"),
            Some("Bearer 0123456789abcdef012"),
        ] {
            assert!(
                auth.identify(Some(&tcp), &request("/v1/pools", bad)).is_err(),
                "{bad:?}"
            );
        }
        let unix = Caller::Unix { uid: 0, pid: None };
        assert!(auth.identify(Some(&unix), &request("/v1/pools", None)).is_ok());
        assert!(auth.identify(None, &request("/v1/pools", None)).is_err());
    }
}
