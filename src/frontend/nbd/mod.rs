//! The NBD server (fixed newstyle handshake, structured replies, base:allocation,
//! TLS through STARTTLS).

pub mod fuzzing;
pub mod proto;
pub mod server;
pub mod tls;
