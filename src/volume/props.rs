//! Volume properties, named and valued as in ZFS where ZFS has the property.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::units::{format_size, parse_size};
use crate::volume::schedule::Schedule;

pub const DEFAULT_VOLBLOCKSIZE: u32 = 16 << 10;
pub const MIN_VOLBLOCKSIZE: u32 = 4 << 10;
pub const MAX_VOLBLOCKSIZE: u32 = 128 << 10;

/// `sync`: when writes must be durable before they are acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum SyncMode {
    /// Follow the client: FUA writes and flushes are honoured.
    Standard = 0,
    /// Every write is durable before it is acknowledged.
    Always = 1,
    /// FUA and flushes are ignored. Unsafe: a crash loses acknowledged writes.
    Disabled = 2,
}

impl SyncMode {
    pub fn from_u8(value: u8) -> Self {
        match value {
            1 => SyncMode::Always,
            2 => SyncMode::Disabled,
            _ => SyncMode::Standard,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SyncMode::Standard => "standard",
            SyncMode::Always => "always",
            SyncMode::Disabled => "disabled",
        }
    }
}

/// `logbias`: where synchronous writes go first (used by the intent log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogBias {
    Latency,
    Throughput,
}

impl LogBias {
    pub fn as_str(self) -> &'static str {
        match self {
            LogBias::Latency => "latency",
            LogBias::Throughput => "throughput",
        }
    }
}

/// The effective properties of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeProps {
    pub volsize: u64,
    pub volblocksize: u32,
    pub sync: SyncMode,
    pub logbias: LogBias,
    pub wce: bool,
}

/// Properties as stored in the catalog: only what was set explicitly, so a
/// later change of a default reaches volumes that never overrode it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredProps {
    pub volsize: u64,
    pub volblocksize: u32,
    #[serde(default)]
    pub local: BTreeMap<String, String>,
}

/// One row of `strata volume get`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PropertyRow {
    pub property: String,
    pub value: String,
    /// `local` when set explicitly, `default` otherwise, `-` for read-only facts.
    pub source: String,
}

/// Every property name `volume create -o` and `volume set` understand.
pub const PROPERTY_NAMES: [&str; 15] = [
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
];

/// How a secret is shown by `strata volume get` and in error messages.
pub const MASKED_SECRET: &str = "********";
/// Shortest CHAP secret accepted (RFC 7143 12.1.3 wants at least 96 bits).
pub const MIN_CHAP_SECRET_BYTES: usize = 12;
/// Longest CHAP secret or user name accepted.
pub const MAX_CHAP_TEXT_BYTES: usize = 255;
/// Longest iSCSI name (RFC 7143 4.2.7.1).
pub const MAX_ISCSI_NAME_BYTES: usize = 223;
/// Most initiator names in one `iscsi.initiators` list.
pub const MAX_ALLOWED_INITIATORS: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PropError {
    #[error(
        "unknown property '{0}' (known: volsize, volblocksize, sync, logbias, wce, compression, iscsi.auth, \
         iscsi.chap_user, iscsi.chap_secret, iscsi.mutual_user, iscsi.mutual_secret, iscsi.initiators, \
         nbd.tls_identities, snapshot.schedule, tier)"
    )]
    Unknown(String),
    #[error("bad value '{value}' for property '{property}': {expected}")]
    BadValue {
        property: String,
        value: String,
        expected: String,
    },
    #[error("property '{0}' can only be set when the volume is created")]
    ReadOnly(String),
    #[error("expected property=value, got '{0}'")]
    Syntax(String),
}

fn bad(property: &str, value: &str, expected: &str) -> PropError {
    PropError::BadValue {
        property: property.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

/// Splits `key=value`.
pub fn split_assignment(text: &str) -> Result<(String, String), PropError> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.trim().to_string(), value.trim().to_string())),
        _ => Err(PropError::Syntax(text.to_string())),
    }
}

/// Checks one property value and returns its canonical spelling.
pub fn canonical_value(property: &str, value: &str) -> Result<String, PropError> {
    match property {
        "volsize" => {
            let bytes = parse_size(value).map_err(|_| bad(property, value, "a size such as 10G"))?;
            Ok(bytes.to_string())
        }
        "volblocksize" => {
            let bytes = parse_size(value).map_err(|_| bad(property, value, "a size such as 16K"))?;
            if !(MIN_VOLBLOCKSIZE as u64..=MAX_VOLBLOCKSIZE as u64).contains(&bytes) || !bytes.is_power_of_two() {
                return Err(bad(property, value, "a power of two from 4K to 128K"));
            }
            Ok(bytes.to_string())
        }
        "sync" => match value {
            "standard" | "always" | "disabled" => Ok(value.to_string()),
            _ => Err(bad(property, value, "standard, always or disabled")),
        },
        "logbias" => match value {
            "latency" | "throughput" => Ok(value.to_string()),
            _ => Err(bad(property, value, "latency or throughput")),
        },
        "wce" => match value {
            "on" | "off" => Ok(value.to_string()),
            _ => Err(bad(property, value, "on or off")),
        },
        "compression" => match value {
            "off" => Ok(value.to_string()),
            _ => Err(bad(
                property,
                value,
                "off (compression is not implemented yet; no other value is accepted)",
            )),
        },
        "iscsi.auth" => match value {
            "none" | "chap" | "mutual" => Ok(value.to_string()),
            _ => Err(bad(property, value, "none, chap or mutual")),
        },
        "iscsi.chap_user" | "iscsi.mutual_user" => {
            // Empty clears the property.
            if value.len() > MAX_CHAP_TEXT_BYTES || value.chars().any(char::is_control) {
                return Err(bad(
                    property,
                    value,
                    "a CHAP user name of at most 255 bytes, no control characters",
                ));
            }
            Ok(value.to_string())
        }
        "iscsi.chap_secret" | "iscsi.mutual_secret" => {
            // Never echo a secret, not even a rejected one. Empty clears it.
            if !value.is_empty()
                && (value.len() < MIN_CHAP_SECRET_BYTES
                    || value.len() > MAX_CHAP_TEXT_BYTES
                    || value.chars().any(char::is_control))
            {
                return Err(bad(
                    property,
                    MASKED_SECRET,
                    "a CHAP secret of 12 to 255 bytes without control characters (RFC 7143 12.1.3)",
                ));
            }
            Ok(value.to_string())
        }
        "iscsi.initiators" => canonical_initiators(value).ok_or_else(|| {
            bad(
                property,
                value,
                "'*' or a comma-separated list of iSCSI names (iqn.…, eui.…, naa.…)",
            )
        }),
        "nbd.tls_identities" => canonical_identities(value).ok_or_else(|| {
            bad(
                property,
                value,
                "'*' or a comma-separated list of TLS identities (PSK user names or certificate CNs)",
            )
        }),
        "snapshot.schedule" => Schedule::parse(value)
            .map(|schedule| schedule.to_string())
            .map_err(|why| bad(property, value, &why)),
        // Where the volume's blocks belong (automatic tiering).
        "tier" => match value {
            "auto" | "fast" | "capacity" => Ok(value.to_string()),
            _ => Err(bad(property, value, "auto, fast or capacity")),
        },
        other => Err(PropError::Unknown(other.to_string())),
    }
}

/// Longest TLS identity (PSK user name or certificate CN) in
/// `nbd.tls_identities`.
pub const MAX_TLS_IDENTITY_BYTES: usize = 255;

/// `*`, or the identities of a comma-separated list trimmed and
/// deduplicated (they compare exactly: PSK user names are case-sensitive).
fn canonical_identities(value: &str) -> Option<String> {
    if value.trim() == "*" {
        return Some("*".to_string());
    }
    let mut names: Vec<&str> = Vec::new();
    for name in value.split(',') {
        let name = name.trim();
        let valid = !name.is_empty()
            && name.len() <= MAX_TLS_IDENTITY_BYTES
            && !name.chars().any(|c| c.is_control() || c == '*');
        if !valid {
            return None;
        }
        if !names.contains(&name) {
            names.push(name);
        }
    }
    if names.len() > MAX_ALLOWED_INITIATORS {
        return None;
    }
    Some(names.join(","))
}

/// `*`, or the names of a comma-separated list lowercased (iSCSI names
/// compare case-insensitively, RFC 7143 4.2.7.1), trimmed and deduplicated.
fn canonical_initiators(value: &str) -> Option<String> {
    if value.trim() == "*" {
        return Some("*".to_string());
    }
    let mut names: Vec<String> = Vec::new();
    for name in value.split(',') {
        let name = name.trim().to_ascii_lowercase();
        let prefixed = ["iqn.", "eui.", "naa."].iter().any(|p| name.starts_with(p));
        let valid = prefixed
            && name.len() <= MAX_ISCSI_NAME_BYTES
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.:".contains(&b));
        if !valid {
            return None;
        }
        if !names.contains(&name) {
            names.push(name);
        }
    }
    if names.is_empty() || names.len() > MAX_ALLOWED_INITIATORS {
        return None;
    }
    Some(names.join(","))
}

/// `iscsi.auth`: how initiators must authenticate to a volume's target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IscsiAuthMode {
    /// No authentication (`AuthMethod=None`).
    None,
    /// The initiator authenticates with CHAP; the target authenticates back
    /// only when the initiator asks and mutual credentials are set.
    Chap,
    /// CHAP both ways: the initiator must challenge the target too.
    Mutual,
}

/// The iSCSI access rules of a volume's target. `Debug` masks the secrets.
#[derive(Clone, PartialEq, Eq)]
pub struct IscsiAccess {
    pub auth: IscsiAuthMode,
    pub chap_user: Option<String>,
    pub chap_secret: Option<String>,
    pub mutual_user: Option<String>,
    pub mutual_secret: Option<String>,
    /// Lowercased initiator names allowed to log in; `None` admits any.
    pub initiators: Option<Vec<String>>,
}

impl IscsiAccess {
    /// Whether `initiator` may log in (names compare case-insensitively).
    pub fn initiator_allowed(&self, initiator: &str) -> bool {
        match &self.initiators {
            None => true,
            Some(list) => list.iter().any(|allowed| allowed.eq_ignore_ascii_case(initiator)),
        }
    }
}

impl std::fmt::Debug for IscsiAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mask = |secret: &Option<String>| secret.as_ref().map(|_| MASKED_SECRET);
        f.debug_struct("IscsiAccess")
            .field("auth", &self.auth)
            .field("chap_user", &self.chap_user)
            .field("chap_secret", &mask(&self.chap_secret))
            .field("mutual_user", &self.mutual_user)
            .field("mutual_secret", &mask(&self.mutual_secret))
            .field("initiators", &self.initiators)
            .finish()
    }
}

impl StoredProps {
    /// The effective properties: stored values over defaults.
    pub fn effective(&self) -> VolumeProps {
        let local = |key: &str| self.local.get(key).map(String::as_str);
        VolumeProps {
            volsize: self.volsize,
            volblocksize: self.volblocksize,
            sync: match local("sync") {
                Some("always") => SyncMode::Always,
                Some("disabled") => SyncMode::Disabled,
                _ => SyncMode::Standard,
            },
            logbias: match local("logbias") {
                Some("throughput") => LogBias::Throughput,
                _ => LogBias::Latency,
            },
            wce: local("wce") != Some("off"),
        }
    }

    /// The iSCSI access rules: `iscsi.*` properties over their defaults.
    pub fn iscsi_access(&self) -> IscsiAccess {
        let text = |key: &str| self.local.get(key).filter(|v| !v.is_empty()).cloned();
        IscsiAccess {
            auth: match self.local.get("iscsi.auth").map(String::as_str) {
                Some("chap") => IscsiAuthMode::Chap,
                Some("mutual") => IscsiAuthMode::Mutual,
                _ => IscsiAuthMode::None,
            },
            chap_user: text("iscsi.chap_user"),
            chap_secret: text("iscsi.chap_secret"),
            mutual_user: text("iscsi.mutual_user"),
            mutual_secret: text("iscsi.mutual_secret"),
            initiators: text("iscsi.initiators")
                .filter(|v| v != "*")
                .map(|v| v.split(',').map(str::to_string).collect()),
        }
    }

    /// `nbd.tls_identities`: the TLS identities allowed to open the volume
    /// over NBD (`None` or `*`: anyone).
    pub fn nbd_tls_identities(&self) -> Option<&str> {
        self.local.get("nbd.tls_identities").map(String::as_str)
    }

    /// All properties with their values and where each came from, in
    /// [`PROPERTY_NAMES`] order.
    pub fn rows(&self) -> Vec<PropertyRow> {
        let props = self.effective();
        let source = |key: &str| {
            if self.local.contains_key(key) {
                "local"
            } else {
                "default"
            }
        };
        // Users as set, `-` when unset; secrets only ever as a mask.
        let shown = |key: &str, secret: bool| match self.local.get(key).filter(|v| !v.is_empty()) {
            None => "-".to_string(),
            Some(_) if secret => MASKED_SECRET.to_string(),
            Some(value) => value.clone(),
        };
        let row = |property: &str, value: String, source: &str| PropertyRow {
            property: property.to_string(),
            value,
            source: source.to_string(),
        };
        vec![
            row("volsize", format_size(props.volsize), "local"),
            row(
                "volblocksize",
                format_size(props.volblocksize as u64),
                if self.volblocksize == DEFAULT_VOLBLOCKSIZE {
                    "default"
                } else {
                    "local"
                },
            ),
            row("sync", props.sync.as_str().to_string(), source("sync")),
            row("logbias", props.logbias.as_str().to_string(), source("logbias")),
            row("wce", if props.wce { "on" } else { "off" }.to_string(), source("wce")),
            row(
                "compression",
                self.local
                    .get("compression")
                    .cloned()
                    .unwrap_or_else(|| "off".to_string()),
                source("compression"),
            ),
            row(
                "iscsi.auth",
                self.local
                    .get("iscsi.auth")
                    .cloned()
                    .unwrap_or_else(|| "none".to_string()),
                source("iscsi.auth"),
            ),
            row(
                "iscsi.chap_user",
                shown("iscsi.chap_user", false),
                source("iscsi.chap_user"),
            ),
            row(
                "iscsi.chap_secret",
                shown("iscsi.chap_secret", true),
                source("iscsi.chap_secret"),
            ),
            row(
                "iscsi.mutual_user",
                shown("iscsi.mutual_user", false),
                source("iscsi.mutual_user"),
            ),
            row(
                "iscsi.mutual_secret",
                shown("iscsi.mutual_secret", true),
                source("iscsi.mutual_secret"),
            ),
            row(
                "iscsi.initiators",
                self.local
                    .get("iscsi.initiators")
                    .cloned()
                    .unwrap_or_else(|| "*".to_string()),
                source("iscsi.initiators"),
            ),
            row(
                "nbd.tls_identities",
                self.local
                    .get("nbd.tls_identities")
                    .cloned()
                    .unwrap_or_else(|| "*".to_string()),
                source("nbd.tls_identities"),
            ),
            row(
                "snapshot.schedule",
                self.local
                    .get("snapshot.schedule")
                    .cloned()
                    .unwrap_or_else(|| "off".to_string()),
                source("snapshot.schedule"),
            ),
            row(
                "tier",
                self.local.get("tier").cloned().unwrap_or_else(|| "auto".to_string()),
                source("tier"),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_values() {
        assert_eq!(canonical_value("sync", "always").unwrap(), "always");
        assert!(canonical_value("sync", "sometimes").is_err());
        assert_eq!(canonical_value("volblocksize", "64K").unwrap(), "65536");
        assert!(canonical_value("volblocksize", "3K").is_err());
        assert!(canonical_value("volblocksize", "256K").is_err());
        assert!(matches!(canonical_value("colour", "red"), Err(PropError::Unknown(_))));
        assert!(canonical_value("compression", "lz4").is_err());
        assert_eq!(
            canonical_value("snapshot.schedule", "daily:7, hourly:24").unwrap(),
            "hourly:24,daily:7"
        );
        assert_eq!(canonical_value("snapshot.schedule", "").unwrap(), "off");
        let error = canonical_value("snapshot.schedule", "hourly:0")
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with("bad value 'hourly:0' for property 'snapshot.schedule'"),
            "{error}"
        );
    }

    #[test]
    fn iscsi_properties_validate_and_mask_secrets() {
        assert_eq!(canonical_value("iscsi.auth", "mutual").unwrap(), "mutual");
        assert!(canonical_value("iscsi.auth", "kerberos").is_err());
        assert_eq!(canonical_value("iscsi.chap_user", "alice").unwrap(), "alice");
        assert!(canonical_value("iscsi.chap_user", &"u".repeat(256)).is_err());
        assert_eq!(
            canonical_value("iscsi.chap_secret", "twelve-bytes").unwrap(),
            "twelve-bytes"
        );
        assert_eq!(canonical_value("iscsi.chap_secret", "").unwrap(), "");
        // Too short or too long, and the error never contains the secret.
        for secret in ["short-pw", &"s".repeat(256)] {
            let error = canonical_value("iscsi.mutual_secret", secret).unwrap_err().to_string();
            assert!(!error.contains(secret), "{error}");
            assert!(error.contains(MASKED_SECRET), "{error}");
        }
        assert_eq!(canonical_value("iscsi.initiators", " * ").unwrap(), "*");
        assert_eq!(
            canonical_value("iscsi.initiators", "iqn.2000-01.a:B, iqn.2000-01.c:d,iqn.2000-01.a:b").unwrap(),
            "iqn.2000-01.a:b,iqn.2000-01.c:d"
        );
        assert!(canonical_value("iscsi.initiators", "host1").is_err());
        assert!(canonical_value("iscsi.initiators", "iqn.a,,iqn.b").is_err());
        assert!(canonical_value("iscsi.initiators", "iqn.a b").is_err());
        assert_eq!(canonical_value("nbd.tls_identities", " * ").unwrap(), "*");
        assert_eq!(
            canonical_value("nbd.tls_identities", "alice, Bob,alice").unwrap(),
            "alice,Bob"
        );
        assert!(canonical_value("nbd.tls_identities", "alice,,bob").is_err());
        assert!(canonical_value("nbd.tls_identities", "a*").is_err());

        let mut stored = StoredProps {
            volsize: 1 << 30,
            volblocksize: DEFAULT_VOLBLOCKSIZE,
            local: BTreeMap::new(),
        };
        for (key, value) in [
            ("iscsi.auth", "mutual"),
            ("iscsi.chap_user", "alice"),
            ("iscsi.chap_secret", "alice-secret-1"),
            ("iscsi.mutual_user", "target"),
            ("iscsi.mutual_secret", "target-secret-2"),
            ("iscsi.initiators", "iqn.2000-01.a:b"),
        ] {
            stored.local.insert(key.into(), canonical_value(key, value).unwrap());
        }
        let rows = stored.rows();
        let names: Vec<&str> = rows.iter().map(|r| r.property.as_str()).collect();
        assert_eq!(names, PROPERTY_NAMES);
        let value = |name: &str| rows.iter().find(|r| r.property == name).unwrap().value.clone();
        assert_eq!(value("iscsi.chap_secret"), MASKED_SECRET);
        assert_eq!(value("iscsi.mutual_secret"), MASKED_SECRET);
        assert_eq!(value("iscsi.chap_user"), "alice");
        assert!(!format!("{rows:?}").contains("secret-"));
        let access = stored.iscsi_access();
        assert_eq!(access.auth, IscsiAuthMode::Mutual);
        assert_eq!(access.chap_secret.as_deref(), Some("alice-secret-1"));
        assert!(access.initiator_allowed("IQN.2000-01.A:B"));
        assert!(!access.initiator_allowed("iqn.2000-01.a:c"));
        assert!(!format!("{access:?}").contains("secret-"));
    }

    #[test]
    fn effective_defaults() {
        let stored = StoredProps {
            volsize: 1 << 30,
            volblocksize: DEFAULT_VOLBLOCKSIZE,
            local: BTreeMap::new(),
        };
        let props = stored.effective();
        assert_eq!(props.sync, SyncMode::Standard);
        assert!(props.wce);
        assert_eq!(props.logbias, LogBias::Latency);
        assert!(stored
            .rows()
            .iter()
            .all(|r| r.source != "local" || r.property == "volsize"));
        let access = stored.iscsi_access();
        assert_eq!(access.auth, IscsiAuthMode::None);
        assert!(access.initiator_allowed("iqn.anyone"));
        let rows = stored.rows();
        let value = |name: &str| rows.iter().find(|r| r.property == name).unwrap().value.clone();
        assert_eq!(value("iscsi.auth"), "none");
        assert_eq!(value("iscsi.chap_secret"), "-");
        assert_eq!(value("iscsi.initiators"), "*");
        assert_eq!(value("snapshot.schedule"), "off");
    }
}
