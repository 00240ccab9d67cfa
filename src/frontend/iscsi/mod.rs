//! The iSCSI target (RFC 7143): every volume `POOL/NAME` is the target
//! `<prefix>:POOL.NAME` with the volume at LUN 0.
//!
//! - [`pdu`]: PDU framing, digests (pure functions over bytes).
//! - [`text`]: text keys and operational parameter negotiation.
//! - [`login`]: the login state machine.
//! - [`chap`]: CHAP (MD5) for the login's security stage.
//! - [`connection`]: one TCP connection: login, then the full feature phase
//!   with commands executed concurrently and completed out of order.
//! - [`server`]: the listener and the registry of targets.
//! - [`fuzzing`]: entry points shared by the fuzz targets and the seed replay test.

pub mod chap;
pub mod connection;
pub mod fuzzing;
pub mod login;
pub mod pdu;
pub mod server;
pub mod text;
