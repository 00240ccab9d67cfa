//! The process-wide budget of client data in flight (`--client-memory`):
//! a client that sends the largest READs on many connections and never
//! reads a reply grows the daemon by no more than the budget, and another
//! client (another address) is served meanwhile.

mod common;

use common::nbd::Raw;
use common::{small_default_pool, Server};
use std::net::IpAddr;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const BUDGET_MIB: u64 = 128;
/// Connections of the greedy client, each with four 32 MiB READs (2 GiB
/// of replies in all, when nothing bounds them).
const GREEDY_CONNECTIONS: usize = 16;

/// The daemon's anonymous resident memory (heap and stacks; the RAM tier
/// is a shared mapping and not counted here), in bytes.
fn rss_anon(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("RssAnon:"))
        .expect("RssAnon in /proc/PID/status");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() << 10
}

#[test]
fn a_client_that_never_reads_its_replies_holds_at_most_the_budget_and_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    small_default_pool(&data);
    let budget = format!("{BUDGET_MIB}M");
    let server = Server::start_with_args(&data, Some(&data), &["--client-memory", &budget]);
    // A few reads first, so that what any connection keeps is in the baseline.
    let other: IpAddr = [127, 0, 0, 2].into();
    let mut polite = Raw::go_from(&server.nbd, "default/vol0", other);
    for i in 0..16u64 {
        polite.request(0, 0, i, i * 4096, 4096, &[]);
        assert_eq!(polite.simple_reply(), (0, i));
        polite.read(4096);
    }
    let baseline = rss_anon(server.pid());

    let mut greedy = Vec::new();
    for _ in 0..GREEDY_CONNECTIONS {
        let mut raw = Raw::go_from(&server.nbd, "default/vol0", [127, 0, 0, 1].into());
        for cookie in 0..4u64 {
            raw.request(0, 0, cookie, cookie * 32 * MIB, 32 << 20, &[]);
        }
        greedy.push(raw);
    }
    // Let the daemon take all it will take.
    let mut peak = 0;
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_secs(3) {
        peak = peak.max(rss_anon(server.pid()));
        std::thread::sleep(Duration::from_millis(50));
    }
    // The other client's 4K reads go on meanwhile (each within the
    // socket's 10 s read timeout, or the read panics).
    let started = Instant::now();
    for i in 0..64u64 {
        polite.request(0, 0, 100 + i, i * 4096, 4096, &[]);
        assert_eq!(polite.simple_reply(), (0, 100 + i));
        polite.read(4096);
        peak = peak.max(rss_anon(server.pid()));
    }
    let served = started.elapsed();
    let grown = peak.saturating_sub(baseline);
    eprintln!(
        "baseline {} MiB, peak {} MiB (grown {} MiB, budget {BUDGET_MIB} MiB); 64 reads of the other client in {served:?}",
        baseline / MIB,
        peak / MIB,
        grown / MIB
    );
    // The budget, and 64 MiB for what the allocator and the connections'
    // threads keep: far below the 2 GiB unbounded.
    assert!(
        grown <= (BUDGET_MIB + 64) * MIB,
        "the daemon grew by {} MiB with a budget of {BUDGET_MIB} MiB",
        grown / MIB
    );
    drop(greedy);
    // Once the greedy client is gone, the other one is still served.
    polite.request(0, 0, 999, 0, 4096, &[]);
    assert_eq!(polite.simple_reply(), (0, 999));
}
