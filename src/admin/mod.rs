//! Administration: the REST API the daemon serves, the CLI client that talks
//! to it, and the metrics both expose.

pub mod api;
pub mod auth;
pub mod cli;
pub mod client;
pub mod iostat;
pub mod metrics;
pub mod ram_cli;
pub mod send;
pub mod send_cli;
pub mod server;

/// A byte stream HTTP runs over: a Unix socket, TCP, or TLS on TCP.
pub(crate) trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Io for T {}
