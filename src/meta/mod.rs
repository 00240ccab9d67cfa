//! Metadata: the catalog of pools and volumes, the metadata store (redb on a
//! pool device), the bounded page caches over it, and the log.

pub mod catalog;
pub mod fuzzing;
pub mod log;
pub mod pages;
pub mod store;
