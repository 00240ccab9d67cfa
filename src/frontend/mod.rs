//! Protocol frontends. Each speaks a wire protocol and turns requests into
//! calls on a [`crate::volume::Volume`]; none touches storage directly.

pub mod iscsi;
pub mod nbd;
