//! strata: a storage server that serves thin block volumes over NBD and
//! iSCSI, and file datasets over NFSv3, from pooled, tiered devices. See
//! ARCHITECTURE.md for the layers.

// Every `unsafe` block says why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod admin;
pub mod analytics;
pub mod block;
pub mod bytes;
pub mod checksum;
pub mod control;
pub mod daemon;
pub mod device;
pub mod frontend;
pub mod fs;
pub mod meta;
pub mod pool;
pub mod private;
pub mod scsi;
pub mod sync;
pub mod tls;
pub mod units;
pub mod utc;
pub mod volume;
