//! The duplicate-request cache: the replies of recent non-idempotent NFS
//! calls, so that a call a client retransmits (same XID, usually on a new
//! connection after the old one broke before the reply arrived) gets the
//! reply of its first execution instead of running again. Without it a
//! resent REMOVE answers NFS3ERR_NOENT for the file it removed, a resent
//! CREATE GUARDED or MKDIR NFS3ERR_EXIST for what it made.
//!
//! As knfsd's `nfscache.c`: keyed by the client's address (not its port:
//! the retransmission comes from a new connection), the XID, the program,
//! version and procedure, and a checksum and length of the arguments (a
//! client that reuses an XID for another call is not answered from the
//! cache). One cache per daemon, shared by all connections, bounded in
//! entries and bytes, entries expire after [`EXPIRY`]. A call that arrives
//! while its first copy is still running is dropped unanswered (knfsd's
//! `RC_DROPIT` for `RC_INPROG`): the client retransmits again later and
//! then gets the cached reply.
//!
//! Only the procedures whose second execution answers differently are
//! cached ([`cached_procedure`]); WRITE is not, unlike knfsd: rewriting the
//! same bytes at the same offset is harmless, and at tens of thousands of
//! writes a second WRITE replies would push the entries that matter out of
//! a bounded cache within milliseconds (and cost a lock on the hot path).

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::nfs3::procedure as p;
use super::rpc::Call;
use super::{NFS_PROGRAM, NFS_VERSION};
use crate::sync::LockOrAbort;

/// Completed replies kept at most.
pub const MAX_ENTRIES: usize = 8192;
/// Bytes of completed replies kept at most (the replies cached are a few
/// hundred bytes each: entries are the bound that matters).
pub const MAX_BYTES: usize = 4 << 20;
/// How long a reply is kept: longer than a client's retransmission
/// timeouts (Linux: `timeo=600`, 60 s, then a reconnect).
pub const EXPIRY: Duration = Duration::from_secs(120);
/// Bytes of arguments checksummed (knfsd's `RC_CSUMLEN`).
const CHECKSUMMED_BYTES: usize = 256;

/// Whether an NFSv3 procedure's replies are cached.
pub fn cached_procedure(procedure: u32) -> bool {
    matches!(
        procedure,
        p::SETATTR | p::CREATE | p::MKDIR | p::SYMLINK | p::MKNOD | p::REMOVE | p::RMDIR | p::RENAME | p::LINK
    )
}

/// What identifies one call of one client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    client: IpAddr,
    xid: u32,
    prog: u32,
    vers: u32,
    procedure: u32,
    args_len: u32,
    args_checksum: u32,
}

impl Key {
    /// The key of `call` from `client`, if its reply is to be cached.
    pub fn of(client: IpAddr, call: &Call<'_>) -> Option<Key> {
        if (call.prog, call.vers) != (NFS_PROGRAM, NFS_VERSION) || !cached_procedure(call.procedure) {
            return None;
        }
        let checksummed = &call.args[..call.args.len().min(CHECKSUMMED_BYTES)];
        Some(Key {
            client,
            xid: call.xid,
            prog: call.prog,
            vers: call.vers,
            procedure: call.procedure,
            args_len: call.args.len() as u32,
            args_checksum: crc32c::crc32c(checksummed),
        })
    }
}

enum Slot {
    /// The call is running.
    Running,
    /// Its reply (record mark included), and when it was stored; `seq`
    /// names its place in [`Inner::order`].
    Done { reply: Arc<[u8]>, at: Instant, seq: u64 },
}

#[derive(Default)]
struct Inner {
    slots: HashMap<Key, Slot>,
    /// Completed entries, oldest first, with the `seq` they were stored
    /// with (an entry replaced or dropped since leaves a stale one here,
    /// skipped when it comes up).
    order: VecDeque<(Key, u64)>,
    next_seq: u64,
    /// Completed entries and their reply bytes.
    done: usize,
    bytes: usize,
    /// Counters since start (see [`DrcStats`]).
    replayed: u64,
    dropped: u64,
    evicted: u64,
}

/// What the cache did since the daemon started, and what it holds
/// (`GET /metrics`: `strata_nfs_drc_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrcStats {
    /// Retransmitted calls answered from the cache.
    pub replayed: u64,
    /// Retransmissions dropped because their first copy was still running.
    pub dropped: u64,
    /// Replies dropped to keep the bounds before they expired (many
    /// evictions mean a retransmission may find its reply gone).
    pub evicted: u64,
    /// Replies held, and their bytes.
    pub entries: u64,
    pub bytes: u64,
}

/// The daemon's cache, for `GET /metrics` (tests' servers keep theirs).
static DAEMON_CACHE: std::sync::OnceLock<Arc<ReplyCache>> = std::sync::OnceLock::new();

/// The daemon's cache: made by the first call, the same one afterwards.
pub fn daemon_cache() -> Arc<ReplyCache> {
    DAEMON_CACHE.get_or_init(ReplyCache::new).clone()
}

/// The counters of the daemon's cache, if its NFS server runs.
pub fn daemon_stats() -> Option<DrcStats> {
    DAEMON_CACHE.get().map(|cache| cache.stats())
}

impl Inner {
    fn remove_done(&mut self, key: &Key, seq: u64) {
        if let Some(Slot::Done { reply, seq: stored, .. }) = self.slots.get(key) {
            if *stored == seq {
                self.done -= 1;
                self.bytes -= reply.len();
                self.slots.remove(key);
            }
        }
    }

    /// Drops the oldest entries until the bounds hold and none is expired.
    fn evict(&mut self, now: Instant) {
        while let Some(&(key, seq)) = self.order.front() {
            let live = match self.slots.get(&key) {
                Some(Slot::Done { at, seq: stored, .. }) if *stored == seq => Some(*at),
                _ => None,
            };
            let (keep, early) = match live {
                None => (false, false),
                Some(at) => {
                    let fresh = now.duration_since(at) < EXPIRY;
                    (self.done <= MAX_ENTRIES && self.bytes <= MAX_BYTES && fresh, fresh)
                }
            };
            if keep {
                break;
            }
            self.order.pop_front();
            self.remove_done(&key, seq);
            self.evicted += u64::from(early);
        }
    }
}

/// The cache (one per daemon).
#[derive(Default)]
pub struct ReplyCache {
    inner: Mutex<Inner>,
}

/// What to do with a call whose key is cached.
pub enum Lookup {
    /// Run it, and store the reply through the [`Pending`].
    Run(Pending),
    /// Send this reply again, run nothing.
    Replay(Arc<[u8]>),
    /// Its first copy is still running: drop this one unanswered.
    InProgress,
}

impl ReplyCache {
    pub fn new() -> Arc<ReplyCache> {
        Arc::new(ReplyCache::default())
    }

    /// Looks `key` up; a miss marks it running.
    pub fn lookup(self: &Arc<Self>, key: Key) -> Lookup {
        let now = Instant::now();
        let mut inner = self.inner.lock_or_abort();
        inner.evict(now);
        match inner.slots.get(&key) {
            Some(Slot::Running) => {
                inner.dropped += 1;
                return Lookup::InProgress;
            }
            Some(Slot::Done { reply, at, .. }) if now.duration_since(*at) < EXPIRY => {
                let reply = reply.clone();
                inner.replayed += 1;
                return Lookup::Replay(reply);
            }
            Some(Slot::Done { seq, .. }) => {
                let seq = *seq;
                inner.remove_done(&key, seq);
            }
            None => {}
        }
        inner.slots.insert(key, Slot::Running);
        Lookup::Run(Pending {
            cache: self.clone(),
            key,
            finished: false,
        })
    }

    /// Completed replies held, and their bytes.
    pub fn len_and_bytes(&self) -> (usize, usize) {
        let inner = self.inner.lock_or_abort();
        (inner.done, inner.bytes)
    }

    pub fn stats(&self) -> DrcStats {
        let inner = self.inner.lock_or_abort();
        DrcStats {
            replayed: inner.replayed,
            dropped: inner.dropped,
            evicted: inner.evicted,
            entries: inner.done as u64,
            bytes: inner.bytes as u64,
        }
    }
}

/// A call marked running; dropped without [`Pending::finish`] (the call
/// got no reply), it forgets the call so a retransmission runs it.
pub struct Pending {
    cache: Arc<ReplyCache>,
    key: Key,
    finished: bool,
}

impl Pending {
    /// Stores the call's reply.
    pub fn finish(mut self, reply: &[u8]) {
        self.finished = true;
        let now = Instant::now();
        let mut inner = self.cache.inner.lock_or_abort();
        let seq = inner.next_seq;
        inner.next_seq += 1;
        inner.done += 1;
        inner.bytes += reply.len();
        inner.slots.insert(
            self.key,
            Slot::Done {
                reply: reply.into(),
                at: now,
                seq,
            },
        );
        inner.order.push_back((self.key, seq));
        inner.evict(now);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.finished {
            let mut inner = self.cache.inner.lock_or_abort();
            if matches!(inner.slots.get(&self.key), Some(Slot::Running)) {
                inner.slots.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::nfs::rpc::Auth;

    fn call(xid: u32, procedure: u32, args: &[u8]) -> Call<'_> {
        Call {
            xid,
            prog: NFS_PROGRAM,
            vers: NFS_VERSION,
            procedure,
            auth: Auth::None,
            args,
        }
    }

    fn key(xid: u32, args: &[u8]) -> Key {
        Key::of("10.0.0.1".parse().unwrap(), &call(xid, p::REMOVE, args)).unwrap()
    }

    #[test]
    fn only_non_idempotent_nfs_calls_have_keys() {
        let client: IpAddr = "10.0.0.1".parse().unwrap();
        for procedure in [p::GETATTR, p::LOOKUP, p::READ, p::WRITE, p::COMMIT, p::READDIRPLUS] {
            assert!(Key::of(client, &call(1, procedure, b"x")).is_none(), "{procedure}");
        }
        assert!(Key::of(client, &call(1, p::RENAME, b"x")).is_some());
        let mut mount = call(1, p::REMOVE, b"x");
        mount.prog = super::super::MOUNT_PROGRAM;
        assert!(Key::of(client, &mount).is_none());
        // Another address, or other arguments: another key.
        let other: IpAddr = "10.0.0.2".parse().unwrap();
        assert_ne!(
            Key::of(other, &call(1, p::REMOVE, b"x")),
            Key::of(client, &call(1, p::REMOVE, b"x"))
        );
        assert_ne!(key(1, b"x"), key(1, b"y"));
    }

    #[test]
    fn a_running_call_is_dropped_a_finished_one_replayed_an_abandoned_one_rerun() {
        let cache = ReplyCache::new();
        let Lookup::Run(pending) = cache.lookup(key(1, b"a")) else {
            panic!("a new call runs")
        };
        assert!(matches!(cache.lookup(key(1, b"a")), Lookup::InProgress));
        pending.finish(b"reply");
        match cache.lookup(key(1, b"a")) {
            Lookup::Replay(reply) => assert_eq!(&reply[..], b"reply"),
            _ => panic!("a finished call is replayed"),
        }
        let Lookup::Run(abandoned) = cache.lookup(key(2, b"a")) else {
            panic!("a new call runs")
        };
        drop(abandoned);
        assert!(matches!(cache.lookup(key(2, b"a")), Lookup::Run(_)));
        assert_eq!(cache.len_and_bytes(), (1, 5));
        assert_eq!(
            cache.stats(),
            DrcStats {
                replayed: 1,
                dropped: 1,
                evicted: 0,
                entries: 1,
                bytes: 5
            }
        );
    }

    #[test]
    fn bounded_in_entries_and_bytes_oldest_first() {
        let cache = ReplyCache::new();
        for xid in 0..(MAX_ENTRIES as u32 + 100) {
            let Lookup::Run(pending) = cache.lookup(key(xid, b"a")) else {
                panic!("a new call runs")
            };
            pending.finish(&[0; 100]);
        }
        assert_eq!(cache.len_and_bytes(), (MAX_ENTRIES, MAX_ENTRIES * 100));
        assert_eq!(cache.stats().evicted, 100, "the oldest 100 went early");
        assert!(matches!(cache.lookup(key(0, b"a")), Lookup::Run(_)));
        assert!(matches!(
            cache.lookup(key(MAX_ENTRIES as u32 + 99, b"a")),
            Lookup::Replay(_)
        ));
        // Large replies: the byte bound.
        for xid in 0..100 {
            let Lookup::Run(pending) = cache.lookup(key(1 << 20 | xid, b"a")) else {
                panic!("a new call runs")
            };
            pending.finish(&vec![0; 64 << 10]);
        }
        let (entries, bytes) = cache.len_and_bytes();
        assert!(bytes <= MAX_BYTES && entries < MAX_ENTRIES, "{entries} {bytes}");
        assert!(matches!(cache.lookup(key(1 << 20 | 99, b"a")), Lookup::Replay(_)));
    }
}
