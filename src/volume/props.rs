//! Volume properties, named and valued as in ZFS where ZFS has the property.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::units::{format_size, parse_size};

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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PropertyRow {
    pub property: String,
    pub value: String,
    /// `local` when set explicitly, `default` otherwise, `-` for read-only facts.
    pub source: String,
}

/// Every property name `volume create -o` and `volume set` understand.
pub const PROPERTY_NAMES: [&str; 6] = ["volsize", "volblocksize", "sync", "logbias", "wce", "compression"];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PropError {
    #[error("unknown property '{0}' (known: volsize, volblocksize, sync, logbias, wce, compression)")]
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
        other => Err(PropError::Unknown(other.to_string())),
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
    }
}
