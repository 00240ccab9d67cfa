//! NBD over TLS: the `--tls*` flags of `strata serve`, the server's TLS
//! context (X.509 certificates and/or pre-shared keys) and the identity a
//! client proved, which per-volume allow-lists (`nbd.tls_identities`) are
//! checked against.
//!
//! OpenSSL, because the other TLS stacks in Rust have no TLS-PSK, which
//! NBD's PSK mode (as nbdkit, qemu-nbd, libnbd and qemu speak it) needs.
//! TLS 1.2 is the floor; TLS 1.3 is what GnuTLS clients (libnbd, qemu)
//! negotiate, with an external PSK or a certificate.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::nid::Nid;
use openssl::ssl::{Ssl, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslRef, SslVerifyMode, SslVersion};

/// `--tls`: whether clients may (or must) upgrade with NBD_OPT_STARTTLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TlsMode {
    /// STARTTLS is refused; everything is plaintext.
    Off,
    /// STARTTLS is offered; plaintext clients are served too (except
    /// volumes with an `nbd.tls_identities` list).
    On,
    /// Every option but STARTTLS and ABORT is refused before TLS: nothing
    /// is listed or opened in plaintext.
    Require,
}

/// The `strata serve` flags of NBD over TLS.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// NBD over TLS: off, on (STARTTLS offered, plaintext allowed) or
    /// require (nothing before STARTTLS). Default: require when
    /// --tls-certificates or --tls-psk is given, else off.
    #[arg(long = "tls", value_enum, value_name = "MODE")]
    pub tls: Option<TlsMode>,
    /// Directory with ca-cert.pem, server-cert.pem and server-key.pem (the
    /// layout nbdkit and qemu use) for NBD over TLS with X.509.
    #[arg(long = "tls-certificates", value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,
    /// Ask NBD clients for a certificate and verify it against
    /// DIR/ca-cert.pem (needs --tls-certificates).
    #[arg(long = "tls-verify-peer")]
    pub tls_verify_peer: bool,
    /// Pre-shared keys for NBD over TLS-PSK: `username:hexkey` lines (psktool's
    /// format). The file must not be readable or writable by others.
    #[arg(long = "tls-psk", value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,
}

/// The NBD listener's TLS setting, built once at start.
pub struct NbdTls {
    pub mode: TlsMode,
    context: Option<SslContext>,
}

/// Who a client proved to be during the TLS handshake: its PSK user name or
/// its certificate's subject common name (`None` when it showed neither).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub identity: Option<String>,
}

/// Shortest pre-shared key accepted (128 bits); psktool makes 256.
const MIN_PSK_BYTES: usize = 16;
/// Longest pre-shared key OpenSSL takes (`PSK_MAX_PSK_LEN`).
const MAX_PSK_BYTES: usize = 512;
/// TLS 1.2 suites: forward-secret ones only, with certificates or a PSK.
const TLS12_CIPHERS: &str = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20:ECDHE-PSK:DHE-PSK:!aNULL:!SHA1";

impl NbdTls {
    /// Plaintext only.
    pub fn off() -> NbdTls {
        NbdTls {
            mode: TlsMode::Off,
            context: None,
        }
    }

    /// Checks the flags and loads the credentials; a clear message on any
    /// problem (the daemon refuses to start).
    pub fn from_args(args: &TlsArgs) -> Result<NbdTls, String> {
        let has_credentials = args.tls_certificates.is_some() || args.tls_psk.is_some();
        let mode = args.tls.unwrap_or(if has_credentials {
            TlsMode::Require
        } else {
            TlsMode::Off
        });
        if args.tls_verify_peer && args.tls_certificates.is_none() {
            return Err("--tls-verify-peer needs --tls-certificates DIR (its ca-cert.pem)".into());
        }
        if mode == TlsMode::Off {
            if has_credentials {
                tracing::warn!("nbd: --tls=off: the TLS credentials given are not used");
            }
            return Ok(NbdTls::off());
        }
        if !has_credentials {
            return Err(format!(
                "--tls={} needs credentials: --tls-certificates DIR and/or --tls-psk FILE",
                if mode == TlsMode::On { "on" } else { "require" }
            ));
        }
        let context = build_context(args)?;
        Ok(NbdTls {
            mode,
            context: Some(context),
        })
    }

    /// Whether STARTTLS is offered.
    pub fn enabled(&self) -> bool {
        self.context.is_some()
    }

    /// A server-side TLS session for one connection.
    pub fn session(&self) -> Result<Ssl, String> {
        let context = self.context.as_ref().ok_or("TLS is off")?;
        Ssl::new(context).map_err(|e| format!("TLS session: {e}"))
    }
}

/// Where the PSK callback leaves the user name it accepted.
fn identity_index() -> Index<Ssl, String> {
    static INDEX: OnceLock<Index<Ssl, String>> = OnceLock::new();
    *INDEX.get_or_init(|| Ssl::new_ex_index().expect("OpenSSL ex_data index"))
}

fn build_context(args: &TlsArgs) -> Result<SslContext, String> {
    let tls_error = |what: &str, e: ErrorStack| format!("{what}: {e}");
    let mut builder =
        SslContextBuilder::new(SslMethod::tls_server()).map_err(|e| tls_error("cannot set up OpenSSL", e))?;
    builder
        .set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(|e| tls_error("TLS versions", e))?;
    builder
        .set_cipher_list(TLS12_CIPHERS)
        .map_err(|e| tls_error("TLS 1.2 cipher list", e))?;
    // No session tickets or cache: every connection authenticates afresh
    // (and a resumed session would not carry the PSK identity).
    builder.set_session_cache_mode(openssl::ssl::SslSessionCacheMode::OFF);
    builder.set_options(openssl::ssl::SslOptions::NO_TICKET);
    builder
        .set_num_tickets(0)
        .map_err(|e| tls_error("TLS 1.3 session tickets", e))?;
    if let Some(dir) = &args.tls_certificates {
        load_certificates(&mut builder, dir, args.tls_verify_peer)?;
    }
    if let Some(path) = &args.tls_psk {
        let keys = Arc::new(read_psk_file(path)?);
        let index = identity_index();
        builder.set_psk_server_callback(move |ssl: &mut SslRef, identity, out: &mut [u8]| {
            let Some(user) = identity.and_then(|bytes| std::str::from_utf8(bytes).ok()) else {
                return Ok(0);
            };
            // An unknown user gets 0 bytes: OpenSSL then fails the handshake.
            let Some(key) = keys.get(user) else {
                tracing::info!("nbd: TLS-PSK: unknown user {user:?}");
                return Ok(0);
            };
            if key.len() > out.len() {
                return Ok(0);
            }
            out[..key.len()].copy_from_slice(key);
            ssl.set_ex_data(index, user.to_string());
            Ok(key.len())
        });
    }
    Ok(builder.build())
}

fn load_certificates(builder: &mut SslContextBuilder, dir: &Path, verify_peer: bool) -> Result<(), String> {
    let file = |name: &str| {
        let path = dir.join(name);
        if path.is_file() {
            Ok(path)
        } else {
            Err(format!("--tls-certificates: {} not found", path.display()))
        }
    };
    let cert = file("server-cert.pem")?;
    let key = file("server-key.pem")?;
    builder
        .set_certificate_chain_file(&cert)
        .map_err(|e| format!("cannot load {}: {e}", cert.display()))?;
    builder
        .set_private_key_file(&key, SslFiletype::PEM)
        .map_err(|e| format!("cannot load {}: {e}", key.display()))?;
    builder
        .check_private_key()
        .map_err(|e| format!("{} does not match {}: {e}", key.display(), cert.display()))?;
    if verify_peer {
        let ca = file("ca-cert.pem")?;
        builder
            .set_ca_file(&ca)
            .map_err(|e| format!("cannot load {}: {e}", ca.display()))?;
        builder.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    }
    Ok(())
}

/// Reads a psktool key file: `username:hexkey` per line. Refused when
/// others may read or write it, or when a line is malformed.
pub fn read_psk_file(path: &Path) -> Result<HashMap<String, Vec<u8>>, String> {
    let shown = path.display();
    let metadata = std::fs::metadata(path).map_err(|e| format!("--tls-psk {shown}: {e}"))?;
    let mode = metadata.permissions().mode();
    if mode & 0o006 != 0 {
        return Err(format!(
            "--tls-psk {shown}: the key file is accessible to other users (mode {:o}); \
             restrict it first: chmod 600 {shown}",
            mode & 0o777
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("--tls-psk {shown}: {e}"))?;
    parse_psk(&text).map_err(|e| format!("--tls-psk {shown}: {e}"))
}

fn parse_psk(text: &str) -> Result<HashMap<String, Vec<u8>>, String> {
    let mut keys = HashMap::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let number = number + 1;
        let Some((user, hex)) = line.split_once(':') else {
            return Err(format!("line {number}: expected username:hexkey"));
        };
        if user.is_empty() {
            return Err(format!("line {number}: empty user name"));
        }
        let key = decode_hex(hex.trim()).ok_or_else(|| format!("line {number}: the key is not hexadecimal"))?;
        if !(MIN_PSK_BYTES..=MAX_PSK_BYTES).contains(&key.len()) {
            return Err(format!(
                "line {number}: a key of {} bytes (want {MIN_PSK_BYTES} to {MAX_PSK_BYTES}; psktool makes 32)",
                key.len()
            ));
        }
        if keys.insert(user.to_string(), key).is_some() {
            return Err(format!("line {number}: user {user:?} appears twice"));
        }
    }
    if keys.is_empty() {
        return Err("no keys in the file".into());
    }
    Ok(keys)
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The identity the client proved in a finished handshake: the PSK user
/// name, else the verified certificate's subject CN.
pub fn peer_of(ssl: &SslRef) -> Peer {
    if let Some(user) = ssl.ex_data(identity_index()) {
        return Peer {
            identity: Some(user.clone()),
        };
    }
    let common_name = ssl.peer_certificate().and_then(|cert| {
        cert.subject_name()
            .entries_by_nid(Nid::COMMONNAME)
            .next()
            .and_then(|entry| String::from_utf8(entry.data().as_slice().to_vec()).ok())
    });
    Peer { identity: common_name }
}

/// What a volume's `nbd.tls_identities` list says about a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Allowed,
    /// The volume has a list, and the client has not done TLS yet.
    NeedsTls,
    Denied,
}

/// Checks `identities` (the property's value, `None` or `*` for anyone)
/// for a client that is in TLS as `peer` (or still in plaintext: `None`).
pub fn access(identities: Option<&str>, peer: Option<&Peer>) -> Access {
    let Some(list) = identities.filter(|v| !v.is_empty() && *v != "*") else {
        return Access::Allowed;
    };
    let Some(peer) = peer else {
        return Access::NeedsTls;
    };
    match &peer.identity {
        Some(identity) if list.split(',').any(|allowed| allowed == identity) => Access::Allowed,
        _ => Access::Denied,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files_parse_and_bad_lines_are_refused() {
        let key = "0123456789abcdef0123456789ABCDEF";
        let keys = parse_psk(&format!("# keys\nalice:{key}\n\nbob:{key}{key}\n")).unwrap();
        assert_eq!(keys["alice"].len(), 16);
        assert_eq!(keys["bob"].len(), 32);
        assert!(parse_psk("alice").unwrap_err().contains("username:hexkey"));
        assert!(parse_psk(&format!(":{key}")).unwrap_err().contains("empty user"));
        assert!(parse_psk("alice:xyz").unwrap_err().contains("hexadecimal"));
        assert!(parse_psk("alice:0011").unwrap_err().contains("2 bytes"));
        assert!(parse_psk(&format!("a:{key}\na:{key}")).unwrap_err().contains("twice"));
        assert!(parse_psk("\n# nothing\n").unwrap_err().contains("no keys"));
    }

    #[test]
    fn a_world_readable_psk_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.psk");
        std::fs::write(&path, "alice:0123456789abcdef0123456789abcdef\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_psk_file(&path).unwrap_err().contains("chmod 600"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert_eq!(read_psk_file(&path).unwrap().len(), 1);
    }

    #[test]
    fn tls_flags_are_checked() {
        let off = NbdTls::from_args(&TlsArgs::default()).unwrap();
        assert_eq!(off.mode, TlsMode::Off);
        assert!(!off.enabled());
        for mode in [TlsMode::On, TlsMode::Require] {
            let args = TlsArgs {
                tls: Some(mode),
                ..TlsArgs::default()
            };
            assert!(NbdTls::from_args(&args).err().unwrap().contains("needs credentials"));
        }
        let args = TlsArgs {
            tls_verify_peer: true,
            ..TlsArgs::default()
        };
        assert!(NbdTls::from_args(&args).err().unwrap().contains("--tls-certificates"));
    }

    #[test]
    fn allow_lists_admit_only_their_identities() {
        let alice = Peer {
            identity: Some("alice".into()),
        };
        let nobody = Peer { identity: None };
        assert_eq!(access(None, None), Access::Allowed);
        assert_eq!(access(Some("*"), None), Access::Allowed);
        assert_eq!(access(Some("alice,bob"), None), Access::NeedsTls);
        assert_eq!(access(Some("alice,bob"), Some(&alice)), Access::Allowed);
        assert_eq!(access(Some("bob"), Some(&alice)), Access::Denied);
        assert_eq!(access(Some("bob"), Some(&nobody)), Access::Denied);
    }
}
