//! How a dataset is exported over NFS: who may mount it, read-only or not,
//! whose credentials are squashed. Kept as the dataset's `nfs.*` properties.

use std::net::IpAddr;
use std::sync::Arc;

use super::types::Cred;
use super::FileSystem;

/// Which callers' credentials become the anonymous user's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Squash {
    /// Credentials are taken as they come.
    None,
    /// uid 0 becomes the anonymous user (knfsd's `root_squash`, its default).
    #[default]
    Root,
    /// Everyone is the anonymous user.
    All,
}

impl Squash {
    pub fn parse(text: &str) -> Result<Squash, String> {
        match text {
            "none" => Ok(Squash::None),
            "root" => Ok(Squash::Root),
            "all" => Ok(Squash::All),
            other => Err(format!("nfs.squash must be root, all or none, not {other:?}")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Squash::None => "none",
            Squash::Root => "root",
            Squash::All => "all",
        }
    }
}

/// An address range allowed to mount: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientNet {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl ClientNet {
    /// `10.0.0.0/8`, `127.0.0.1`, `::1`, `fd00::/8`.
    pub fn parse(text: &str) -> Result<ClientNet, String> {
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (text, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{text:?} is not an address or an address/prefix"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{text:?}: the prefix length must be 0 to {max}"))?,
            None => max,
        };
        Ok(ClientNet { addr, prefix })
    }

    pub fn contains(&self, addr: IpAddr) -> bool {
        // An IPv4 client on an IPv6 socket arrives as ::ffff:a.b.c.d.
        let addr = match addr {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(addr),
            v4 => v4,
        };
        match (self.addr, addr) {
            (IpAddr::V4(net), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - self.prefix as u32).unwrap_or(0);
                u32::from(net) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(a)) => {
                let mask = u128::MAX.checked_shl(128 - self.prefix as u32).unwrap_or(0);
                u128::from(net) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for ClientNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// A dataset's export options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportOptions {
    /// Who may mount and use the export; empty = nobody.
    pub clients: Vec<ClientNet>,
    pub read_only: bool,
    pub squash: Squash,
    pub anon_uid: u32,
    pub anon_gid: u32,
    /// Whether requests from ports above 1023 are served (knfsd's
    /// `insecure`).
    pub insecure: bool,
}

impl Default for ExportOptions {
    /// Loopback only, read-write, root squashed to 65534, any source port.
    fn default() -> Self {
        ExportOptions {
            clients: vec![
                ClientNet::parse("127.0.0.0/8").expect("valid"),
                ClientNet::parse("::1").expect("valid"),
            ],
            read_only: false,
            squash: Squash::Root,
            anon_uid: 65534,
            anon_gid: 65534,
            insecure: true,
        }
    }
}

impl ExportOptions {
    /// Whether a client at `addr` (its source port `port`) may use the
    /// export.
    pub fn allows(&self, addr: IpAddr, port: u16) -> bool {
        (self.insecure || port < 1024) && self.clients.iter().any(|net| net.contains(addr))
    }

    /// The credentials a request is served with.
    pub fn squash(&self, cred: Cred) -> Cred {
        let anonymous = Cred {
            uid: self.anon_uid,
            gid: self.anon_gid,
            gids: Vec::new(),
        };
        match self.squash {
            Squash::All => anonymous,
            Squash::Root if cred.uid == 0 => anonymous,
            _ => cred,
        }
    }

    /// The anonymous user (AUTH_NONE callers).
    pub fn anonymous(&self) -> Cred {
        Cred {
            uid: self.anon_uid,
            gid: self.anon_gid,
            gids: Vec::new(),
        }
    }
}

/// An exported dataset.
#[derive(Clone)]
pub struct Export {
    /// `/POOL/NAME`.
    pub path: String,
    pub fs: Arc<FileSystem>,
    pub options: ExportOptions,
}

/// What the NFS frontend asks the daemon: the exports that exist now.
pub trait Exports: Send + Sync {
    /// The export mounted at `path` (MOUNT's MNT).
    fn by_path(&self, path: &str) -> Option<Export>;
    /// The export a file handle's dataset id in the pool of tag `pool`
    /// belongs to (`pool` 0, a handle of the first version: the dataset of
    /// that id if only one pool has one).
    fn by_dataset(&self, pool: u64, dataset: u32) -> Option<Export>;
    /// Every export (MOUNT's EXPORT).
    fn all(&self) -> Vec<Export>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ranges_match_and_squash_applies() {
        let net = ClientNet::parse("10.1.0.0/16").unwrap();
        assert!(net.contains("10.1.200.3".parse().unwrap()));
        assert!(!net.contains("10.2.0.1".parse().unwrap()));
        assert!(net.contains("::ffff:10.1.0.9".parse().unwrap()));
        assert!(ClientNet::parse("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
        assert!(ClientNet::parse("10.0.0.0/33").is_err());
        assert!(ClientNet::parse("host").is_err());
        let options = ExportOptions::default();
        assert!(options.allows("127.0.0.1".parse().unwrap(), 40000));
        assert!(!options.allows("192.168.1.1".parse().unwrap(), 700));
        let strict = ExportOptions {
            insecure: false,
            ..ExportOptions::default()
        };
        assert!(!strict.allows("127.0.0.1".parse().unwrap(), 40000));
        assert!(strict.allows("127.0.0.1".parse().unwrap(), 700));
        assert_eq!(options.squash(Cred::root()).uid, 65534);
        let user = Cred {
            uid: 1000,
            gid: 1000,
            gids: vec![27],
        };
        assert_eq!(options.squash(user.clone()), user);
        let all = ExportOptions {
            squash: Squash::All,
            ..ExportOptions::default()
        };
        assert_eq!(all.squash(user).uid, 65534);
    }
}
