//! The SCSI block command set (SBC-3) and primary commands (SPC-4) that the
//! iSCSI frontend serves: a pure CDB decoder ([`cdb`]), sense data
//! ([`sense`]), the pages a logical unit reports ([`pages`]), persistent
//! reservations ([`pr`]) and the logical unit that executes commands on a
//! volume ([`lu`]).

pub mod cdb;
pub mod lu;
pub mod opcodes;
pub mod pages;
pub mod pr;
pub mod sense;
