//! strata: a storage server that serves thin block volumes over NBD (and,
//! later, iSCSI and NFSv3). See ARCHITECTURE.md for the layers.

pub mod admin;
pub mod checksum;
pub mod daemon;
pub mod device;
pub mod frontend;
pub mod meta;
pub mod pool;
pub mod private;
pub mod scsi;
pub mod tls;
pub mod units;
pub mod volume;
