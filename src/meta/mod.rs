//! On-disk metadata of a pool: the metadata store (redb on a pool device),
//! the bounded page caches over it, the intent log, and file datasets'
//! namespaces (rows, log operations, the in-memory tables).

pub mod error;
pub mod fsrows;
pub mod geometry;
pub mod log;
pub mod namespace;
pub mod pages;
pub mod sealed;
pub mod store;

pub use error::MetaError;
