//! Analytics: every request measured (operations, bytes, latency in
//! log-linear buckets, offsets) per second, by volume, protocol,
//! operation and client, and kept for an hour by second and a day by
//! minute; what the heat maps, `strata iostat` and the dashboard read.
//! See ARCHITECTURE.md, "Analytics".

pub mod hist;
pub mod phase;
pub mod query;
pub mod record;

pub use record::{Analytics, Recorder};
