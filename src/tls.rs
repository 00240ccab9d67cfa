//! TLS with OpenSSL: the one TLS stack of the daemon and the CLI.
//!
//! OpenSSL rather than rustls because NBD's pre-shared-key mode (the one
//! nbdkit and qemu-nbd users run without a PKI) needs TLS-PSK, which rustls
//! does not offer; one stack means one way to load certificates and one set
//! of protocol settings to review. This module holds what the REST API needs:
//! a self-signed certificate made at first start, a server acceptor, and the
//! client side the CLI uses (trust a CA file or exactly one pinned
//! certificate). NBD's TLS context (certificates and pre-shared keys) is
//! built in `frontend::nbd::tls`.

use std::net::IpAddr;
use std::path::Path;

use openssl::asn1::Asn1Time;
use openssl::bn::{BigNum, MsbOption};
use openssl::ec::{EcGroup, EcKey};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::PKey;
use openssl::ssl::{SslAcceptor, SslConnector, SslFiletype, SslMethod, SslVerifyMode, SslVersion};
use openssl::x509::extension::{BasicConstraints, ExtendedKeyUsage, KeyUsage, SubjectAlternativeName};
use openssl::x509::{X509NameBuilder, X509};

/// Days a generated certificate is valid: long, as for a pinned certificate
/// expiry only adds an outage; replace the files to rotate it.
const SELF_SIGNED_DAYS: u32 = 3650;

/// A certificate and its private key, both PEM.
pub struct CertifiedKey {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

/// A self-signed ECDSA P-256 certificate for `common_name`, valid for the
/// DNS names and IP addresses given (its subjectAltName: clients check the
/// address they dialled against it).
pub fn self_signed(common_name: &str, dns_names: &[String], ips: &[IpAddr]) -> Result<CertifiedKey, String> {
    let build = || -> Result<CertifiedKey, openssl::error::ErrorStack> {
        let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
        let key = PKey::from_ec_key(EcKey::generate(&group)?)?;
        let mut name = X509NameBuilder::new()?;
        name.append_entry_by_nid(Nid::COMMONNAME, common_name)?;
        name.append_entry_by_nid(Nid::ORGANIZATIONNAME, "strata")?;
        let name = name.build();
        let mut serial = BigNum::new()?;
        serial.rand(127, MsbOption::MAYBE_ZERO, false)?;
        let mut cert = X509::builder()?;
        cert.set_version(2)?;
        let serial = serial.to_asn1_integer()?;
        cert.set_serial_number(&serial)?;
        cert.set_subject_name(&name)?;
        cert.set_issuer_name(&name)?;
        cert.set_pubkey(&key)?;
        let not_before = Asn1Time::days_from_now(0)?;
        let not_after = Asn1Time::days_from_now(SELF_SIGNED_DAYS)?;
        cert.set_not_before(&not_before)?;
        cert.set_not_after(&not_after)?;
        // Its own trust anchor: a client given this file as its CA accepts
        // exactly this certificate.
        cert.append_extension(BasicConstraints::new().critical().ca().pathlen(0).build()?)?;
        cert.append_extension(KeyUsage::new().critical().digital_signature().key_cert_sign().build()?)?;
        cert.append_extension(ExtendedKeyUsage::new().server_auth().build()?)?;
        let mut alt = SubjectAlternativeName::new();
        for dns in dns_names {
            alt.dns(dns);
        }
        for ip in ips {
            alt.ip(&ip.to_string());
        }
        let alt = alt.build(&cert.x509v3_context(None, None))?;
        cert.append_extension(alt)?;
        cert.sign(&key, MessageDigest::sha256())?;
        Ok(CertifiedKey {
            cert_pem: cert.build().to_pem()?,
            key_pem: key.private_key_to_pem_pkcs8()?,
        })
    };
    build().map_err(|e| format!("cannot generate a self-signed certificate: {e}"))
}

/// A server acceptor for the certificate chain and key in these PEM files
/// (TLS 1.2 or newer, Mozilla's intermediate settings).
pub fn acceptor(cert: &Path, key: &Path) -> Result<SslAcceptor, String> {
    let context = |what: &str, e: openssl::error::ErrorStack| format!("{what}: {e}");
    let mut builder =
        SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server()).map_err(|e| context("cannot set up TLS", e))?;
    builder
        .set_certificate_chain_file(cert)
        .map_err(|e| context(&format!("cannot load the certificate {}", cert.display()), e))?;
    builder
        .set_private_key_file(key, SslFiletype::PEM)
        .map_err(|e| context(&format!("cannot load the private key {}", key.display()), e))?;
    builder
        .check_private_key()
        .map_err(|e| context("the private key does not match the certificate", e))?;
    builder
        .set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(|e| context("cannot set up TLS", e))?;
    Ok(builder.build())
}

/// A client connector that trusts only the certificates in `ca_file` (a CA,
/// or the server's self-signed certificate itself: pinning).
pub fn connector(ca_file: &Path) -> Result<SslConnector, String> {
    let mut builder = SslConnector::builder(SslMethod::tls_client()).map_err(|e| format!("cannot set up TLS: {e}"))?;
    // Only the given file: the system's CAs are not asked about our daemon.
    let store = {
        let mut store = openssl::x509::store::X509StoreBuilder::new().map_err(|e| format!("cannot set up TLS: {e}"))?;
        let pem = std::fs::read(ca_file).map_err(|e| format!("cannot read {}: {e}", ca_file.display()))?;
        let certs =
            X509::stack_from_pem(&pem).map_err(|e| format!("{} holds no PEM certificate: {e}", ca_file.display()))?;
        if certs.is_empty() {
            return Err(format!("{} holds no PEM certificate", ca_file.display()));
        }
        for cert in certs {
            store
                .add_cert(cert)
                .map_err(|e| format!("cannot use {}: {e}", ca_file.display()))?;
        }
        store.build()
    };
    builder.set_cert_store(store);
    builder.set_verify(SslVerifyMode::PEER);
    builder
        .set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(|e| format!("cannot set up TLS: {e}"))?;
    Ok(builder.build())
}

/// SHA-256 of a PEM certificate's DER form, as lowercase hex pairs joined
/// by `:` (what `openssl x509 -fingerprint -sha256` prints, lowercased).
pub fn fingerprint(cert_pem: &[u8]) -> Result<String, String> {
    let cert = X509::from_pem(cert_pem).map_err(|e| format!("not a PEM certificate: {e}"))?;
    let digest = cert
        .digest(MessageDigest::sha256())
        .map_err(|e| format!("cannot hash the certificate: {e}"))?;
    Ok(digest.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":"))
}

/// `len` random bytes from OpenSSL's CSPRNG.
pub fn random_bytes(len: usize) -> Result<Vec<u8>, String> {
    let mut bytes = vec![0u8; len];
    openssl::rand::rand_bytes(&mut bytes).map_err(|e| format!("no random bytes: {e}"))?;
    Ok(bytes)
}

/// Compares two secrets in time independent of where they differ.
pub fn secrets_equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && openssl::memcmp::eq(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_self_signed_certificate_is_accepted_by_a_connector_pinned_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let made = self_signed("test", &["localhost".into()], &["127.0.0.1".parse().unwrap()]).unwrap();
        let cert = dir.path().join("c.pem");
        let key = dir.path().join("k.pem");
        std::fs::write(&cert, &made.cert_pem).unwrap();
        crate::private::write_private_file(&key, &made.key_pem).unwrap();
        let acceptor = acceptor(&cert, &key).unwrap();
        let connector = connector(&cert).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut tls = acceptor.accept(stream).unwrap();
            std::io::Write::write_all(&mut tls, b"hello").unwrap();
        });
        let stream = std::net::TcpStream::connect(address).unwrap();
        let mut configuration = connector.configure().unwrap();
        configuration.set_use_server_name_indication(false);
        configuration.set_verify_hostname(true);
        configuration.param_mut().set_ip("127.0.0.1".parse().unwrap()).unwrap();
        let mut tls = configuration.connect("127.0.0.1", stream).unwrap();
        let mut got = String::new();
        std::io::Read::read_to_string(&mut tls, &mut got).ok();
        assert_eq!(got, "hello");
        server.join().unwrap();

        // Another self-signed certificate is not trusted.
        let other = self_signed("other", &["localhost".into()], &[]).unwrap();
        let other_path = dir.path().join("other.pem");
        std::fs::write(&other_path, &other.cert_pem).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let acceptor2 = super::acceptor(&cert, &key).unwrap();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            assert!(acceptor2.accept(stream).is_err());
        });
        let stream = std::net::TcpStream::connect(address).unwrap();
        let refused = connector_for(&other_path).connect("localhost", stream);
        assert!(refused.is_err(), "a certificate not pinned must be refused");
        server.join().unwrap();
        assert_eq!(fingerprint(&made.cert_pem).unwrap().len(), 32 * 3 - 1);
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(secrets_equal(b"abc", b"abc"));
        assert!(!secrets_equal(b"abc", b"abd"));
        assert!(!secrets_equal(b"abc", b"abcd"));
    }

    fn connector_for(path: &Path) -> SslConnector {
        connector(path).unwrap()
    }
}
