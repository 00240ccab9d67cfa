#!/usr/bin/env python3
"""Write-path benchmark: group commit, synchronous write latency against the
device's own write+flush floor, and the write-back cache against nbdkit-file.

One strata daemon gets a pool `wp` on two files in the same filesystem: a
fast device and a dedicated log device, with --ram 2G. Three 1 GiB volumes,
filled with the same random data: `wp/sync` (sync=always, logbias=latency:
every write goes through the intent log), `wp/inplace` (sync=always,
logbias=throughput: written in place, then committed) and `wp/wb` (the
defaults: wce=on, write-back). The floor is fio writing 4K blocks to a file
in the same filesystem with fdatasync after each write. nbdkit-file serves an
equal file. Servers listen on ephemeral 127.0.0.1 ports and are stopped by
PID.

Usage: bench/writepath_bench.py [--runtime SECONDS] [--size-mib N]
Prints a Markdown table (for BENCHMARKS.md) and writes JSON next to it.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nbd_bench import STRATA, ROOT, Peer, free_port, wait_port, measure  # noqa: E402


def cli(api, *args):
    done = subprocess.run([STRATA, *args, "--api", f"127.0.0.1:{api}"], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"strata {' '.join(args)} failed: {done.stderr}")
    return done.stdout


def fio_pass(uri, offset_mib, size_mib, bs):
    """One sequential read pass over [offset, offset + size) of an NBD export."""
    subprocess.run(["fio", "--name=pass", "--ioengine=nbd", f"--uri={uri}", "--rw=read", f"--bs={bs}",
                    f"--offset={offset_mib}m", f"--size={size_mib}m", "--iodepth=8"],
                   check=True, capture_output=True)


def scan_resistance(api, base, work, seed):
    """Hit ratio of a hot set re-read after a sequential scan of 4x the read
    cache (pool `scan`, --ram 256M: a 128 MiB read cache)."""
    dev = os.path.join(work, "scan.img")
    with open(dev, "wb") as f:
        f.truncate(4 << 30)
    cli(api, "pool", "create", "scan", "--fast", dev, "--ram", "256M")
    cli(api, "volume", "create", "scan/v", "--size", "1G")
    uri = base + "scan/v"
    subprocess.run(["nbdcopy", "--flush", seed, uri], check=True)
    cli(api, "pool", "sync", "scan")

    def counters():
        cache = json.loads(cli(api, "pool", "status", "scan", "--json"))["cache"]
        return cache["read_hits"], cache["read_misses"]

    hot_mib = 32
    for _ in range(3):
        fio_pass(uri, 0, hot_mib, "64k")       # the working set, read repeatedly
    fio_pass(uri, 64, 512, "1m")               # the scan: 4x the read cache
    hits0, misses0 = counters()
    fio_pass(uri, 0, hot_mib, "64k")           # the working set again
    hits1, misses1 = counters()
    hits, misses = hits1 - hits0, misses1 - misses0
    return {"hot_mib": hot_mib, "scan_mib": 512, "read_cache_mib": 128, "hits": hits, "misses": misses,
            "hit_ratio": hits / max(1, hits + misses)}


def fio_floor(path, runtime, size_mib):
    cmd = ["fio", "--name=floor", f"--filename={path}", f"--size={size_mib}m", "--rw=randwrite", "--bs=4k",
           "--iodepth=1", "--ioengine=psync", "--fdatasync=1", "--time_based", f"--runtime={runtime}",
           "--norandommap", "--randrepeat=0", "--output-format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]["write"]
    # With fdatasync=1 a write's latency is only the write; add the sync's.
    sync = json.loads(out[out.index("{"):])["jobs"][0].get("sync", {})
    lat = job["clat_ns"]["percentile"]
    slat = sync.get("lat_ns", {}).get("percentile", {})
    return {
        "iops": job["iops"],
        "p50_us": (lat.get("50.000000", 0) + slat.get("50.000000", 0)) / 1000,
        "p99_us": (lat.get("99.000000", 0) + slat.get("99.000000", 0)) / 1000,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runtime", type=int, default=10)
    parser.add_argument("--size-mib", type=int, default=1024)
    options = parser.parse_args()
    if not os.path.exists(STRATA):
        subprocess.run(["cargo", "build", "--release"], cwd=ROOT, check=True)
    work = tempfile.mkdtemp(prefix="strata-wpbench-")
    size = options.size_mib << 20
    seed = os.path.join(work, "seed.img")
    with open(seed, "wb") as f:
        for _ in range(options.size_mib):
            f.write(os.urandom(1 << 20))
    data_dir = os.path.join(work, "strata-data")
    # The CLI (--api) finds the API token in the data directory.
    os.environ["STRATA_DATA_DIR"] = data_dir
    fast, log = os.path.join(work, "fast.img"), os.path.join(work, "log.img")
    for path, gib in [(fast, 8), (log, 2)]:
        with open(path, "wb") as f:
            f.truncate(gib << 30)
    api = free_port()
    strata = Peer("strata", lambda p: [STRATA, "serve", "--nfs", "127.0.0.1:0", "--data-dir", data_dir, "--nbd", f"127.0.0.1:{p}",
                                        "--api", f"127.0.0.1:{api}", "--iscsi", "127.0.0.1:0"],
                  lambda p: f"nbd://127.0.0.1:{p}/", env={"STRATA_LOG": "warn"})
    peer_file = os.path.join(work, "peer.img")
    shutil.copyfile(seed, peer_file)
    nbdkit = Peer("nbdkit file", lambda p: ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(p), "file", peer_file],
                  lambda p: f"nbd://127.0.0.1:{p}/")
    results = {}
    try:
        strata.start()
        wait_port(api)
        cli(api, "pool", "create", "wp", "--fast", fast, "--log", log, "--ram", "2G")
        base = strata.uri
        for name, props in [("sync", ["sync=always"]), ("inplace", ["sync=always", "logbias=throughput"]),
                            ("wb", [])]:
            cli(api, "volume", "create", f"wp/{name}", "--size", f"{options.size_mib}M")
            subprocess.run(["nbdcopy", "--flush", seed, base + f"wp/{name}"], check=True)
            if props:
                cli(api, "volume", "set", f"wp/{name}", *props)

        def run(label, volume, args):
            strata.uri = base + volume
            results[label] = measure(strata, (label, args, "iops"), options.runtime, options.size_mib)
            print(f"{label:40} {results[label]}", file=sys.stderr)

        qd1 = ["--rw=randwrite", "--bs=4k", "--iodepth=1"]
        qd32 = ["--rw=randwrite", "--bs=4k", "--iodepth=32"]
        run("sync=always logbias=latency QD1", "wp/sync", qd1)
        run("sync=always logbias=latency QD32", "wp/sync", qd32)
        run("sync=always logbias=throughput QD1", "wp/inplace", qd1)
        run("sync=always logbias=throughput QD32", "wp/inplace", qd32)
        run("wce=on write-back QD32", "wp/wb", qd32)
        results["scan resistance"] = scan_resistance(api, base, work, seed)
        print(f"scan {results['scan resistance']}", file=sys.stderr)
        strata.stop()
        nbdkit.start()
        results["nbdkit-file QD32"] = measure(nbdkit, ("n", qd32, "iops"), options.runtime, options.size_mib)
        print(f"{'nbdkit-file QD32':40} {results['nbdkit-file QD32']}", file=sys.stderr)
        nbdkit.stop()
        results["floor: file write+fdatasync QD1"] = fio_floor(os.path.join(work, "floor.img"), options.runtime,
                                                               options.size_mib)
        print(f"floor {results['floor: file write+fdatasync QD1']}", file=sys.stderr)
    finally:
        strata.stop()
        nbdkit.stop()
        shutil.rmtree(work, ignore_errors=True)

    r = results
    print("| row | result |")
    print("|---|---|")
    for label, row in r.items():
        if "iops" not in row:
            continue
        cpu = f", {row['cpu_us_per_op']:.1f} µs CPU/op" if "cpu_us_per_op" in row else ""
        print(f"| {label} | {row['iops'] / 1000:.1f}k IOPS, p50 {row['p50_us']:.0f} µs / p99 {row['p99_us']:.0f} µs{cpu} |")
    g = r["sync=always logbias=latency QD32"]["iops"] / r["sync=always logbias=latency QD1"]["iops"]
    floor = r["floor: file write+fdatasync QD1"]
    lat = r["sync=always logbias=latency QD1"]
    wb = r["wce=on write-back QD32"]["iops"] / r["nbdkit-file QD32"]["iops"]
    print(f"\ngroup commit QD32/QD1: {g:.1f}x; sync QD1 p50 vs floor: {lat['p50_us'] / floor['p50_us']:.2f}x, "
          f"p99 {lat['p99_us'] / floor['p99_us']:.2f}x; write-back vs nbdkit-file: {wb:.2f}x")
    scan = r["scan resistance"]
    print(f"read cache: {scan['hot_mib']} MiB hot set re-read after a {scan['scan_mib']} MiB scan "
          f"({scan['read_cache_mib']} MiB cache): hit ratio {scan['hit_ratio']:.3f}")
    with open(os.path.join(ROOT, "bench", "last-writepath-results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
