//! Pool properties (`strata pool get|set`): the settings of automatic
//! tiering and how often the pool is scrubbed, kept in the catalog's
//! `PoolRecord::properties` (only what was set explicitly, like a
//! volume's) and applied to the running pool.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{internal, validate_component, AdminError, VolumeManager};
use crate::pool::migrate::{MigrationSettings, MigrationStatus, PassSummary, TierPin};
use crate::pool::{Pool, PoolError};
use crate::volume::props::{PropError, PropertyRow, StoredProps};

/// Every pool property, in the order `pool get` shows them.
pub const POOL_PROPERTY_NAMES: [&str; 5] = [
    "migration",
    "migration.high",
    "migration.low",
    "migration.window",
    "scrub.interval",
];

/// How often a pool is scrubbed when its `scrub.interval` is not set: every
/// 30 days, as distributions schedule ZFS's and TrueNAS does (35 days).
pub const DEFAULT_SCRUB_INTERVAL: u64 = 30 * 86_400;

fn unknown(key: &str) -> AdminError {
    AdminError::Invalid(format!(
        "unknown pool property '{key}' (known: {})",
        POOL_PROPERTY_NAMES.join(", ")
    ))
}

fn bad(property: &str, value: &str, expected: &str) -> AdminError {
    PropError::BadValue {
        property: property.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    }
    .into()
}

/// `HH:MM` as minutes since midnight.
fn parse_minute(text: &str) -> Option<u16> {
    let (hours, minutes) = text.trim().split_once(':')?;
    let digits = |s: &str| !s.is_empty() && s.len() <= 2 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(hours) || !digits(minutes) {
        return None;
    }
    let (hours, minutes): (u16, u16) = (hours.parse().ok()?, minutes.parse().ok()?);
    (hours < 24 && minutes < 60).then_some(hours * 60 + minutes)
}

/// `HH:MM-HH:MM` (UTC) as minutes since midnight, start and end.
pub fn parse_window(text: &str) -> Option<(u16, u16)> {
    let (start, end) = text.split_once('-')?;
    Some((parse_minute(start)?, parse_minute(end)?))
}

pub fn format_window(window: Option<(u16, u16)>) -> String {
    match window {
        None => "none".to_string(),
        Some((start, end)) => format!("{:02}:{:02}-{:02}:{:02}", start / 60, start % 60, end / 60, end % 60),
    }
}

/// Checks one pool property value and returns its canonical spelling;
/// `None` for a value that clears the property (back to its default).
pub fn canonical_pool_value(key: &str, value: &str) -> Result<Option<String>, AdminError> {
    let value = value.trim();
    match key {
        "migration" => match value {
            "on" | "off" => Ok(Some(value.to_string())),
            _ => Err(bad(key, value, "on or off")),
        },
        "migration.high" | "migration.low" => {
            let number = value.strip_suffix('%').unwrap_or(value);
            match number.parse::<u8>() {
                Ok(percent) if percent <= 100 => Ok(Some(percent.to_string())),
                _ => Err(bad(key, value, "a percentage of the fast tier, 0 to 100")),
            }
        }
        "migration.window" => match value {
            "" | "none" => Ok(None),
            _ => {
                let (start, end) = parse_window(value)
                    .ok_or_else(|| bad(key, value, "HH:MM-HH:MM (UTC; it may wrap past midnight), or none"))?;
                if start == end {
                    return Err(bad(key, value, "two different times (HH:MM-HH:MM, UTC), or none"));
                }
                Ok(Some(format_window(Some((start, end)))))
            }
        },
        "scrub.interval" => match value {
            "off" => Ok(Some("off".to_string())),
            _ => match crate::units::parse_span(value) {
                Ok(seconds) => Ok(Some(crate::units::format_span(seconds))),
                Err(_) => Err(bad(key, value, "a span such as 30d, 2w or 12h, or off")),
            },
        },
        other => Err(unknown(other)),
    }
}

/// The migration settings that stored pool properties give (defaults for
/// the ones not set), checked with [`MigrationSettings::validate`].
pub fn migration_settings(properties: &BTreeMap<String, String>) -> Result<MigrationSettings, String> {
    let mut settings = MigrationSettings::default();
    for (key, value) in properties {
        let invalid = || format!("bad stored value '{value}' for pool property '{key}'");
        match key.as_str() {
            "migration" => settings.enabled = value != "off",
            "migration.high" => settings.high_percent = value.parse().map_err(|_| invalid())?,
            "migration.low" => settings.low_percent = value.parse().map_err(|_| invalid())?,
            "migration.window" => settings.window = Some(parse_window(value).ok_or_else(invalid)?),
            "scrub.interval" => {}
            _ => return Err(format!("unknown pool property '{key}'")),
        }
    }
    settings.validate()?;
    Ok(settings)
}

/// Seconds between scrubs that stored pool properties ask for; `None` for
/// `scrub.interval=off` (a stored value that does not parse, from a
/// hand-edited catalog, counts as the default).
pub fn scrub_interval(properties: &BTreeMap<String, String>) -> Option<u64> {
    match properties.get("scrub.interval").map(String::as_str) {
        Some("off") => None,
        Some(value) => Some(crate::units::parse_span(value).unwrap_or(DEFAULT_SCRUB_INTERVAL)),
        None => Some(DEFAULT_SCRUB_INTERVAL),
    }
}

/// The rows of `pool get`: every property, its effective value, and
/// whether it was set (`local`) or not (`default`).
pub fn pool_rows(properties: &BTreeMap<String, String>) -> Vec<PropertyRow> {
    let defaults = MigrationSettings::default();
    let default_value = |key: &str| match key {
        "migration" => if defaults.enabled { "on" } else { "off" }.to_string(),
        "migration.high" => defaults.high_percent.to_string(),
        "migration.low" => defaults.low_percent.to_string(),
        "scrub.interval" => crate::units::format_span(DEFAULT_SCRUB_INTERVAL),
        _ => format_window(defaults.window),
    };
    POOL_PROPERTY_NAMES
        .iter()
        .map(|key| match properties.get(*key) {
            Some(value) => PropertyRow {
                property: key.to_string(),
                value: value.clone(),
                source: "local".into(),
            },
            None => PropertyRow {
                property: key.to_string(),
                value: default_value(key),
                source: "default".into(),
            },
        })
        .collect()
}

/// The tier pin a volume's stored properties ask for (`tier`).
pub fn tier_pin(props: &StoredProps) -> TierPin {
    match props.local.get("tier").map(String::as_str) {
        Some("fast") => TierPin::Fast,
        Some("capacity") => TierPin::Capacity,
        _ => TierPin::Auto,
    }
}

/// Applies a pool's stored properties to it as it opens (daemon start).
/// Settings that do not validate (a hand-edited catalog) are reported and
/// the defaults kept.
pub(super) fn apply_at_open(name: &str, pool: &Pool, properties: &BTreeMap<String, String>) {
    let applied =
        migration_settings(properties).and_then(|s| pool.set_migration_settings(s).map_err(|e| e.to_string()));
    if let Err(e) = applied {
        tracing::error!(
            "pool {name}: its migration properties in the catalog are not usable ({e}); using the defaults"
        );
    }
}

impl VolumeManager {
    fn open_pool_named(&self, pool_name: &str) -> Result<Arc<Pool>, AdminError> {
        validate_component("pool", pool_name)?;
        self.pool(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))
    }

    /// `pool get`: every pool property with its value and source.
    pub fn pool_properties(&self, pool_name: &str) -> Result<Vec<PropertyRow>, AdminError> {
        validate_component("pool", pool_name)?;
        let catalog = self.published();
        let record = catalog
            .pools
            .get(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        Ok(pool_rows(&record.properties))
    }

    /// `pool set`: every change is checked (each value, then the settings
    /// they make together) before any is saved or applied.
    pub fn set_pool_properties(
        &self,
        pool_name: &str,
        changes: &[(String, String)],
    ) -> Result<Vec<PropertyRow>, AdminError> {
        validate_component("pool", pool_name)?;
        if changes.is_empty() {
            return Err(AdminError::Invalid(format!(
                "no property to set (known: {})",
                POOL_PROPERTY_NAMES.join(", ")
            )));
        }
        let mut catalog = self.catalog();
        let record = catalog
            .pools
            .get(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        let mut validated = Vec::new();
        for (key, value) in changes {
            validated.push((key.clone(), canonical_pool_value(key, value)?));
        }
        let mut properties = record.properties.clone();
        for (key, value) in validated {
            match value {
                Some(value) => properties.insert(key, value),
                None => properties.remove(&key),
            };
        }
        let settings = migration_settings(&properties).map_err(AdminError::Invalid)?;
        let pool = self
            .pool(pool_name)
            .ok_or_else(|| AdminError::Internal(format!("pool '{pool_name}' is in the catalog but not open")))?;
        let mut updated = catalog.clone();
        if let Some(record) = updated.pools.get_mut(pool_name) {
            record.properties = properties.clone();
        }
        updated
            .save(&self.data_dir)
            .map_err(|e| internal("cannot save catalog", e))?;
        catalog.set(updated);
        pool.set_migration_settings(settings).map_err(|e| match e {
            PoolError::Invalid(message) => AdminError::Invalid(message),
            other => AdminError::Internal(format!("pool '{pool_name}': {other}")),
        })?;
        Ok(pool_rows(&properties))
    }

    /// The migrator's state in a pool.
    pub fn migration_status(&self, pool_name: &str) -> Result<MigrationStatus, AdminError> {
        Ok(self.open_pool_named(pool_name)?.migration_status())
    }

    /// `pool migrate --wait`: runs one pass now and returns what it did.
    pub async fn migrate_pool(&self, pool_name: &str) -> Result<PassSummary, AdminError> {
        let pool = self.open_pool_named(pool_name)?;
        pool.migrate_now()
            .await
            .map_err(|e| AdminError::Internal(format!("pool '{pool_name}': migration pass failed: {e}")))
    }

    /// `pool migrate`: starts one pass in the background; its result goes
    /// to the log (and to `pool status`).
    pub fn start_migration(&self, pool_name: &str) -> Result<MigrationStatus, AdminError> {
        let pool = self.open_pool_named(pool_name)?;
        let status = pool.migration_status();
        let name = pool_name.to_string();
        let running = pool.clone();
        self.runtime.spawn(async move {
            match running.migrate_now().await {
                Ok(summary) => tracing::info!(
                    "pool {name}: migration pass moved {} down and {} up in {:.1} s ({} errors)",
                    crate::units::format_size(summary.moved_down_bytes),
                    crate::units::format_size(summary.moved_up_bytes),
                    summary.seconds,
                    summary.errors
                ),
                Err(e) => tracing::error!("pool {name}: migration pass failed: {e}"),
            }
        });
        Ok(status)
    }

    /// Pins volume `id` of `pool_name` where its `tier` property says.
    pub(super) fn apply_tier_pin(&self, pool_name: &str, id: u32, props: &StoredProps) {
        if let Some(pool) = self.pool(pool_name) {
            pool.set_tier_pin(id, tier_pin(props));
        }
    }

    /// Bytes of a volume's blocks on the fast and capacity tiers (`volume
    /// get`'s `used.fast`, `used.capacity`); `None` when they cannot be
    /// counted.
    pub(super) fn tier_bytes(&self, pool_name: &str, id: u32) -> Option<(u64, u64)> {
        let pool = self.pool(pool_name)?;
        match pool.volume_tier_bytes(id) {
            Ok(tiers) => {
                let sum = |role| tiers.iter().filter(|(r, _)| *r == role).map(|(_, b)| *b).sum();
                Some((
                    sum(crate::pool::superblock::Role::Fast),
                    sum(crate::pool::superblock::Role::Capacity),
                ))
            }
            Err(e) => {
                tracing::error!("tiers of volume {pool_name}/#{id}: {e}");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_checked_and_canonical() {
        assert_eq!(
            canonical_pool_value("migration", "off").unwrap().as_deref(),
            Some("off")
        );
        assert!(canonical_pool_value("migration", "maybe").is_err());
        assert_eq!(
            canonical_pool_value("migration.high", "80%").unwrap().as_deref(),
            Some("80")
        );
        assert!(canonical_pool_value("migration.high", "101").is_err());
        assert!(canonical_pool_value("migration.low", "-1").is_err());
        assert_eq!(
            canonical_pool_value("migration.window", "1:00-6:30")
                .unwrap()
                .as_deref(),
            Some("01:00-06:30")
        );
        assert_eq!(canonical_pool_value("migration.window", "none").unwrap(), None);
        assert_eq!(canonical_pool_value("migration.window", "").unwrap(), None);
        for bad in ["25:00-03:00", "01:00", "01:00-01:00", "a-b", "01:60-02:00"] {
            assert!(canonical_pool_value("migration.window", bad).is_err(), "{bad}");
        }
        assert_eq!(
            canonical_pool_value("scrub.interval", "720h").unwrap().as_deref(),
            Some("30d")
        );
        assert_eq!(
            canonical_pool_value("scrub.interval", "off").unwrap().as_deref(),
            Some("off")
        );
        for bad in ["0d", "monthly", "30", ""] {
            assert!(canonical_pool_value("scrub.interval", bad).is_err(), "{bad}");
        }
        let error = canonical_pool_value("colour", "red").unwrap_err().to_string();
        assert!(
            error.contains("migration.window") && error.contains("scrub.interval"),
            "{error}"
        );
    }

    #[test]
    fn settings_from_properties() {
        let mut properties = BTreeMap::new();
        assert_eq!(migration_settings(&properties).unwrap(), MigrationSettings::default());
        properties.insert("migration".to_string(), "off".to_string());
        properties.insert("migration.window".to_string(), "22:00-06:00".to_string());
        let settings = migration_settings(&properties).unwrap();
        assert!(!settings.enabled);
        assert_eq!(settings.window, Some((22 * 60, 6 * 60)));
        properties.insert("migration.low".to_string(), "90".to_string());
        let error = migration_settings(&properties).unwrap_err();
        assert!(error.contains("must be below migration.high"), "{error}");
        let rows = pool_rows(&properties);
        let names: Vec<&str> = rows.iter().map(|r| r.property.as_str()).collect();
        assert_eq!(names, POOL_PROPERTY_NAMES);
        let interval = rows.iter().find(|r| r.property == "scrub.interval").unwrap();
        assert_eq!((interval.value.as_str(), interval.source.as_str()), ("30d", "default"));
        assert_eq!(scrub_interval(&properties), Some(DEFAULT_SCRUB_INTERVAL));
        properties.insert("scrub.interval".to_string(), "12h".to_string());
        assert_eq!(scrub_interval(&properties), Some(12 * 3_600));
        properties.insert("scrub.interval".to_string(), "off".to_string());
        assert_eq!(scrub_interval(&properties), None);
        assert_eq!(rows[1].value, "85");
        assert_eq!(rows[1].source, "default");
        assert_eq!(rows[3].value, "22:00-06:00");
        assert_eq!(rows[3].source, "local");
    }
}
