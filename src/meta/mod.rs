//! Metadata: the catalog of pools and volumes (later also the block map and
//! allocation state of the storage engine).

pub mod catalog;
