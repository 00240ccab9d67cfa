//! One byte budget for the request and reply payloads every frontend holds
//! in flight (NBD, iSCSI and NFS alike), shared by the whole process.
//!
//! A connection takes its share before it reads a request's payload or
//! runs a read, and gives it back once the reply is written: when the
//! budget is spent, connections stop reading from their sockets until
//! replies go out (backpressure, never a failed request). No client
//! address may hold more than a quarter of it, so one client that sends
//! large requests and never reads its replies stalls itself, not the
//! others: their requests find the rest of the budget free.
//!
//! Each connection keeps its own smaller bound as well (NBD's in-flight
//! budget, iSCSI's command window, NFS's calls in flight); this one bounds
//! their sum, which with a thousand connections would otherwise be far
//! more than the machine's RAM.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::Notify;

use crate::sync::LockOrAbort;

/// The largest request's data.
const LARGEST: u64 = crate::block::MAX_REQUEST_BYTES as u64;
/// The smallest budget `--client-memory` takes: four of the largest
/// requests (a client's share is one of them).
pub const MIN_BYTES: u64 = 4 * LARGEST;

/// The budget: what is held, in all and per client address.
pub struct ClientMemory {
    total: u64,
    per_client: u64,
    held: Mutex<Held>,
    freed: Notify,
}

#[derive(Default)]
struct Held {
    bytes: u64,
    by_client: HashMap<IpAddr, u64>,
}

/// Bytes of the budget held for one request; given back when dropped.
pub struct MemoryPermit {
    budget: Arc<ClientMemory>,
    client: IpAddr,
    bytes: u64,
}

impl std::fmt::Debug for MemoryPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemoryPermit({} bytes for {})", self.bytes, self.client)
    }
}

impl ClientMemory {
    /// A budget of `total` bytes (at least [`MIN_BYTES`]); one client
    /// address holds at most a quarter of it (at least one of the largest
    /// requests).
    pub fn new(total: u64) -> Arc<ClientMemory> {
        let total = total.max(MIN_BYTES);
        Arc::new(ClientMemory {
            total,
            per_client: (total / 4).max(LARGEST),
            held: Mutex::new(Held::default()),
            freed: Notify::new(),
        })
    }

    /// The budget's size in bytes.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes held now, in all.
    pub fn held(&self) -> u64 {
        self.held.lock_or_abort().bytes
    }

    /// Takes `bytes` for `client` if the budget and the client's share
    /// have room. A request larger than a share is let through when its
    /// client holds nothing, and one larger than the budget when nothing
    /// is held at all: every request can run, one at a time if need be.
    pub fn try_acquire(self: &Arc<Self>, client: IpAddr, bytes: u64) -> Option<MemoryPermit> {
        let mut held = self.held.lock_or_abort();
        let mine = held.by_client.get(&client).copied().unwrap_or(0);
        let fits_client = mine == 0 || mine + bytes <= self.per_client;
        let fits_total = held.bytes == 0 || held.bytes + bytes <= self.total;
        if !(fits_client && fits_total) {
            return None;
        }
        held.bytes += bytes;
        *held.by_client.entry(client).or_default() += bytes;
        Some(MemoryPermit {
            budget: self.clone(),
            client,
            bytes,
        })
    }

    /// Waits until `bytes` can be taken for `client`, and takes them.
    pub async fn acquire(self: &Arc<Self>, client: IpAddr, bytes: u64) -> MemoryPermit {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before the check: a release between the check and
            // the wait still wakes this one.
            freed.as_mut().enable();
            if let Some(permit) = self.try_acquire(client, bytes) {
                return permit;
            }
            freed.await;
        }
    }
}

impl Drop for MemoryPermit {
    fn drop(&mut self) {
        {
            let mut held = self.budget.held.lock_or_abort();
            held.bytes -= self.bytes;
            if let Some(mine) = held.by_client.get_mut(&self.client) {
                *mine -= self.bytes;
                if *mine == 0 {
                    held.by_client.remove(&self.client);
                }
            }
        }
        self.budget.freed.notify_waiters();
    }
}

static BUDGET: OnceLock<Arc<ClientMemory>> = OnceLock::new();

/// The default budget: an eighth of the machine's RAM (at least
/// [`MIN_BYTES`]; 1 GiB when the RAM size cannot be read).
pub fn default_bytes() -> u64 {
    let ram = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| {
        text.lines()
            .find_map(|line| line.strip_prefix("MemTotal:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib << 10)
    });
    ram.map_or(1 << 30, |ram| ram / 8).max(MIN_BYTES)
}

/// Sets the process's budget (`strata serve --client-memory`); the first
/// call wins. Without one, the first use takes [`default_bytes`].
pub fn install(total: u64) -> Arc<ClientMemory> {
    BUDGET.get_or_init(|| ClientMemory::new(total)).clone()
}

/// The process's budget.
pub fn global() -> &'static Arc<ClientMemory> {
    BUDGET.get_or_init(|| ClientMemory::new(default_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn a_client_holds_at_most_a_quarter_and_others_still_get_theirs() {
        let budget = ClientMemory::new(256 * MIB);
        let greedy: Vec<MemoryPermit> = (0..2).map(|_| budget.try_acquire(ip(1), 32 * MIB).unwrap()).collect();
        assert!(
            budget.try_acquire(ip(1), 32 * MIB).is_none(),
            "past its quarter (64 MiB)"
        );
        let other = budget.try_acquire(ip(2), 4096).expect("another client is served");
        assert_eq!(budget.held(), 64 * MIB + 4096);
        drop(greedy);
        drop(other);
        assert_eq!(budget.held(), 0);
        assert!(budget.held.lock_or_abort().by_client.is_empty());
    }

    #[test]
    fn the_total_bounds_every_client_together() {
        let budget = ClientMemory::new(256 * MIB);
        let held: Vec<MemoryPermit> = (1..=4).map(|c| budget.try_acquire(ip(c), 64 * MIB).unwrap()).collect();
        assert!(budget.try_acquire(ip(5), 4096).is_none(), "the budget is spent");
        drop(held);
        assert!(budget.try_acquire(ip(5), 4096).is_some());
    }

    #[test]
    fn a_request_larger_than_a_share_runs_alone() {
        let budget = ClientMemory::new(MIN_BYTES);
        let big = budget.try_acquire(ip(1), 4 * MIN_BYTES).expect("alone, it runs");
        assert!(budget.try_acquire(ip(2), 4096).is_none());
        drop(big);
    }

    #[test]
    fn a_waiter_is_woken_when_bytes_are_given_back() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let budget = ClientMemory::new(MIN_BYTES);
            let first = budget.try_acquire(ip(1), budget.per_client).unwrap();
            let waiting = {
                let budget = budget.clone();
                tokio::spawn(async move { budget.acquire(ip(1), MIB).await })
            };
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            assert!(!waiting.is_finished(), "it waits while the share is held");
            drop(first);
            let permit = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
                .await
                .expect("woken")
                .unwrap();
            assert_eq!(permit.bytes, MIB);
        });
    }
}
