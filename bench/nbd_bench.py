#!/usr/bin/env python3
"""Side-by-side NBD benchmark: strata vs nbdkit (file, null) and qemu-nbd.

Every server gets an equal 1 GiB backing file filled with the same random
data, written the same way, in 1 MiB writes (nbdkit null has none: it is
the client's ceiling), listens on an
ephemeral 127.0.0.1 port and is stopped by PID. fio's nbd engine drives each
workload; the server's CPU time (utime+stime from /proc/PID/stat) over the run
is divided by the operations fio completed.

Usage: bench/nbd_bench.py [--runtime SECONDS] [--size-mib N] [--repeat N] [--only NAME,...]
                          [--workloads SUBSTRING,...] [--baseline PATH] [--json PATH]
--baseline adds a second strata, "strata (base)", run from another binary
(an older build) in the same rounds: before/after in one run.
Every server runs at once; each workload goes round the servers --repeat
times (interleaved, so the shared machine's slow phases hit all alike) and
each cell is the median of its rounds. Before each run every server's dirty
data is written out (strata `pool sync`, then a system-wide sync).
Prints a Markdown table and writes the medians as JSON to --json (default
bench/last-nbd-results.json): {workload: {server: {iops, mib_s, p50_us,
p99_us, cpu_us_per_op}}}.
"""
import argparse, json, os, shutil, signal, socket, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# STRATA_BIN runs another strata binary (an old build, for before/after).
STRATA = os.environ.get("STRATA_BIN") or os.path.join(ROOT, "target", "release", "strata")
TICKS = os.sysconf("SC_CLK_TCK")

WORKLOADS = [
    # name, fio args, metric
    ("4K randread QD32", ["--rw=randread", "--bs=4k", "--iodepth=32"], "iops"),
    ("4K randwrite QD32", ["--rw=randwrite", "--bs=4k", "--iodepth=32"], "iops"),
    ("1M seqread QD4", ["--rw=read", "--bs=1m", "--iodepth=4"], "bw"),
    ("1M seqwrite QD4", ["--rw=write", "--bs=1m", "--iodepth=4"], "bw"),
    ("4K randread QD1", ["--rw=randread", "--bs=4k", "--iodepth=1"], "lat"),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Peer:
    def __init__(self, name, argv_for_port, uri_for_port, env=None):
        self.name, self.argv_for_port, self.uri_for_port, self.env = name, argv_for_port, uri_for_port, env
        self.proc = None

    def start(self):
        port = free_port()
        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(self.argv_for_port(port), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=env)
        wait_port(port)
        self.uri = self.uri_for_port(port)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_fio(uri, args, runtime, size_mib):
    cmd = ["fio", "--name=bench", "--ioengine=nbd", f"--uri={uri}", f"--size={size_mib}m",
           "--time_based", f"--runtime={runtime}", "--norandommap", "--randrepeat=0",
           "--output-format=json"] + args
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job


def measure(peer, workload, runtime, size_mib):
    name, args, metric = workload
    pid = peer.proc.pid
    before = cpu_seconds(pid)
    job = run_fio(peer.uri, args, runtime, size_mib)
    after = cpu_seconds(pid)
    side = job["read"] if job["read"]["total_ios"] > 0 else job["write"]
    # Server CPU over the whole fio run divided by all operations completed.
    ops = job["read"]["total_ios"] + job["write"]["total_ios"]
    result = {
        "iops": side["iops"],
        "mib_s": side["bw_bytes"] / (1 << 20),
        "p50_us": side["clat_ns"]["percentile"].get("50.000000", 0) / 1000,
        "p99_us": side["clat_ns"]["percentile"].get("99.000000", 0) / 1000,
        "cpu_us_per_op": (after - before) * 1e6 / max(1, ops),
    }
    return result


# The API's bearer token of each strata started here, by API port (read from
# its data directory; builds from before the token had none and need none).
AUTH = {}


def auth_args(api, data_dir):
    """curl arguments with strata's API token, remembered for `api`."""
    path = os.path.join(data_dir, "api.token")
    # The daemon writes its token at start; give it a moment.
    for _ in range(50):
        if os.path.exists(path):
            break
        time.sleep(0.1)
    AUTH[api] = ["-H", f"Authorization: Bearer {open(path).read().strip()}"] if os.path.exists(path) else []
    return AUTH[api]


def settle(api):
    """Writes out every server's dirty data before a measurement, so no run
    pays for the write-back of the one before it: strata's RAM tier (pool
    sync), then the page cache of every file (nbdkit's, qemu-nbd's and
    strata's device files) with a system-wide sync."""
    subprocess.run(["curl", "-sf", *AUTH.get(api, []), "-X", "POST", f"http://127.0.0.1:{api}/v1/pools/default/sync"],
                   check=True, capture_output=True)
    os.sync()


def median_of(runs):
    """Each field's median over the rounds (a field's own median: a round
    slow in IOPS is not always the one slow in CPU)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runtime", type=int, default=10)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--only", default="")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per workload (median reported)")
    parser.add_argument("--workloads", default="", help="comma-separated substrings: run only matching workloads")
    parser.add_argument("--baseline", default="", help="another strata binary to run side by side (before/after)")
    parser.add_argument("--json", default=os.path.join(ROOT, "bench", "last-nbd-results.json"),
                        help="where to write the medians as JSON")
    options = parser.parse_args()
    for tool in ["fio", "nbdkit", "qemu-nbd", "nbdcopy"]:
        if not shutil.which(tool):
            sys.exit(f"missing {tool}: apt-get install -y fio nbdkit qemu-utils libnbd-bin")
    if not os.path.exists(STRATA):
        subprocess.run(["cargo", "build", "--release"], cwd=ROOT, check=True)

    work = tempfile.mkdtemp(prefix="strata-bench-")
    size = options.size_mib << 20
    seed = os.path.join(work, "seed.img")
    with open(seed, "wb") as f:
        for _ in range(options.size_mib):
            f.write(os.urandom(1 << 20))

    # strata: a volume of the same size, filled with the same bytes.
    def start_strata(name, binary, data_dir):
        api = free_port()
        peer = Peer(name, lambda p: [binary, "serve", "--nfs", "127.0.0.1:0", "--data-dir", data_dir, "--nbd", f"127.0.0.1:{p}",
                                     "--api", f"127.0.0.1:{api}", "--iscsi", "127.0.0.1:0"],
                    lambda p: f"nbd://127.0.0.1:{p}/default/bench", env={"STRATA_LOG": "warn"})
        peer.api = api
        peer.start()
        wait_port(api)
        body = json.dumps({"name": "default/bench", "size": size})
        subprocess.run(["curl", "-sf", *auth_args(api, data_dir), "-X", "POST", "-H", "Content-Type: application/json",
                        "-d", body, f"http://127.0.0.1:{api}/v1/volumes"], check=True, capture_output=True)
        subprocess.run(["nbdcopy", "--flush", seed, peer.uri], check=True)
        return peer

    strata = start_strata("strata", STRATA, os.path.join(work, "strata-data"))
    stratas = [strata]
    if options.baseline:
        stratas.append(start_strata("strata (base)", options.baseline, os.path.join(work, "strata-base")))

    # Written with 1 MiB writes, as strata's device file is written while
    # nbdcopy fills its volume: a file system that caches files in large
    # folios (ext4 on Linux 6.16 and later) then caches both alike. A copy
    # (`shutil.copyfile`, copy_file_range) would leave the peers' file in
    # small folios, where a 4 KiB write costs a fraction of what it costs in
    # a large one (src/device/engine.rs, `write_in_pieces`, says why).
    peer_file = os.path.join(work, "peer.img")
    with open(seed, "rb") as src, open(peer_file, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    peers = stratas + [
        Peer("nbdkit file", lambda p: ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(p), "file", peer_file],
             lambda p: f"nbd://127.0.0.1:{p}/"),
        Peer("nbdkit null", lambda p: ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(p), "null", f"size={size}"],
             lambda p: f"nbd://127.0.0.1:{p}/"),
        Peer("qemu-nbd", lambda p: ["qemu-nbd", "-f", "raw", "-b", "127.0.0.1", "-p", str(p), "-t", "-e", "8",
                                    "--cache=writeback", "--aio=threads", "--discard=unmap", peer_file],
             lambda p: f"nbd://127.0.0.1:{p}/"),
    ]
    if options.only:
        wanted = options.only.split(",")
        peers = [p for p in peers if p.name in wanted]
    workloads = WORKLOADS
    if options.workloads:
        wanted = options.workloads.split(",")
        workloads = [w for w in WORKLOADS if any(part in w[0] for part in wanted)]
    results = {}
    try:
        for peer in peers:
            if peer.proc is None:
                peer.start()
        # Interleaved: every peer runs each workload once per round, so slow
        # phases of this shared machine hit all of them alike; each cell is
        # the median of its rounds.
        for workload in workloads:
            samples = {peer.name: [] for peer in peers}
            for _ in range(options.repeat):
                for peer in peers:
                    for each in stratas:
                        settle(each.api)
                    sample = measure(peer, workload, options.runtime, options.size_mib)
                    samples[peer.name].append(sample)
                    print(f"{peer.name:12} {workload[0]:18} {sample}", file=sys.stderr)
            results[workload[0]] = {name: median_of(runs) for name, runs in samples.items()}
    finally:
        # The strata servers run from the start, also those --only leaves out.
        for peer in peers + [each for each in stratas if each not in peers]:
            peer.stop()
        shutil.rmtree(work, ignore_errors=True)

    names = [p.name for p in peers]
    print("| workload | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for workload in workloads:
        name, _, metric = workload
        row = results[name]
        if metric == "iops":
            cells = [f"{row[n]['iops'] / 1000:.1f}k IOPS, {row[n]['cpu_us_per_op']:.1f} µs CPU/op" for n in names]
        elif metric == "bw":
            cells = [f"{row[n]['mib_s']:.0f} MiB/s, {row[n]['cpu_us_per_op']:.0f} µs CPU/op" for n in names]
        else:
            cells = [f"p50 {row[n]['p50_us']:.0f} µs / p99 {row[n]['p99_us']:.0f} µs, {row[n]['cpu_us_per_op']:.1f} µs CPU/op"
                     for n in names]
        print(f"| {name} | " + " | ".join(cells) + " |")
    with open(options.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
