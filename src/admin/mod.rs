//! Administration: the REST API the daemon serves, the CLI client that talks
//! to it, and the metrics both expose.

pub mod api;
pub mod auth;
pub mod cli;
pub mod client;
pub mod metrics;
pub mod server;
