//! Caps on open connections, per listener and per client address, so that
//! one client opening connections in a loop cannot take every file
//! descriptor, thread or byte of memory the daemon has, and other clients
//! keep being served.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Connections one listener serves at once, by default: far above what a
/// real deployment opens, low enough to stay inside the file descriptors
/// and threads of one process.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Connections one client address may hold on one listener, by default.
pub const DEFAULT_MAX_PER_CLIENT: usize = 128;
/// A refusal is logged at most this often per listener (a client in a loop
/// must not flood the log either); the lines in between are counted.
const WARN_INTERVAL: Duration = Duration::from_secs(10);

/// The caps of one listener and who holds its connections.
pub struct ConnectionLimits {
    protocol: &'static str,
    max_total: usize,
    max_per_client: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    total: usize,
    per_client: HashMap<IpAddr, usize>,
    last_warning: Option<Instant>,
    unlogged: u64,
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The listener serves its maximum already.
    Listener(usize),
    /// This client address holds its maximum already.
    Client(usize),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Listener(cap) => write!(f, "{cap} connections already open (--max-connections)"),
            Refusal::Client(cap) => write!(
                f,
                "this address already holds {cap} connections (--max-connections-per-client)"
            ),
        }
    }
}

/// One admitted connection; gives its place back when dropped.
pub struct ConnectionSlot {
    limits: Arc<ConnectionLimits>,
    client: IpAddr,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut state = self.limits.state.lock().unwrap_or_else(|e| e.into_inner());
        state.total -= 1;
        if let Some(count) = state.per_client.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                state.per_client.remove(&self.client);
            }
        }
    }
}

impl ConnectionLimits {
    pub fn new(protocol: &'static str, max_total: usize, max_per_client: usize) -> Arc<ConnectionLimits> {
        Arc::new(ConnectionLimits {
            protocol,
            max_total: max_total.max(1),
            max_per_client: max_per_client.max(1),
            state: Mutex::new(State::default()),
        })
    }

    /// Admits a connection from `client`, or says why not (and logs the
    /// refusal, rate-limited).
    pub fn admit(self: &Arc<Self>, client: IpAddr) -> Result<ConnectionSlot, Refusal> {
        // An IPv4 client of a dual-stack listener is one address either way.
        let client = match client {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(client, IpAddr::V4),
            v4 => v4,
        };
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let held = state.per_client.get(&client).copied().unwrap_or(0);
        let refusal = if state.total >= self.max_total {
            Some(Refusal::Listener(self.max_total))
        } else if held >= self.max_per_client {
            Some(Refusal::Client(self.max_per_client))
        } else {
            None
        };
        if let Some(refusal) = refusal {
            let now = Instant::now();
            if state
                .last_warning
                .is_none_or(|last| now.duration_since(last) >= WARN_INTERVAL)
            {
                let unlogged = std::mem::take(&mut state.unlogged);
                let more = if unlogged > 0 {
                    format!(" ({unlogged} more refusals since the last line)")
                } else {
                    String::new()
                };
                tracing::warn!(
                    "{}: refusing a connection from {client}: {refusal}{more}",
                    self.protocol
                );
                state.last_warning = Some(now);
            } else {
                state.unlogged += 1;
            }
            return Err(refusal);
        }
        state.total += 1;
        *state.per_client.entry(client).or_insert(0) += 1;
        Ok(ConnectionSlot {
            limits: self.clone(),
            client,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_per_client_and_per_listener_and_places_come_back() {
        let limits = ConnectionLimits::new("test", 4, 2);
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let b: IpAddr = "127.0.0.2".parse().unwrap();
        let c: IpAddr = "127.0.0.3".parse().unwrap();
        let a1 = limits.admit(a).unwrap();
        let _a2 = limits.admit(a).unwrap();
        assert_eq!(limits.admit(a).err(), Some(Refusal::Client(2)));
        let _b1 = limits.admit(b).unwrap();
        let _b2 = limits.admit(b).unwrap();
        assert_eq!(limits.admit(c).err(), Some(Refusal::Listener(4)));
        assert_eq!(limits.open(), 4);
        drop(a1);
        assert_eq!(limits.open(), 3);
        let _c1 = limits.admit(c).unwrap();
        assert_eq!(limits.admit(a).err(), Some(Refusal::Listener(4)));
    }
}
