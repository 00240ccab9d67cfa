//! On-disk metadata of a pool: the metadata store (redb on a pool device),
//! the bounded page caches over it, and the intent log.

pub mod error;
pub mod log;
pub mod pages;
pub mod store;

pub use error::MetaError;
