#!/usr/bin/env python3
"""Mirror of two files against one file, side by side in one strata daemon.

Two pools: `single` on one device file, `mirror` on a mirror of two files
(`--fast mirror:A,B`), each with a volume of --size-mib filled with the same
random bytes. fio's nbd engine drives each workload on both volumes in turn
(interleaved rounds, median of --repeat), and the daemon's CPU time over a
run is divided by the operations fio completed (only one volume is busy at
a time, so that is the CPU of the one measured).

Two device models:
- "files": the files as they are (buffered, in the page cache): what the
  mirror costs in CPU (every write copied to two files).
- "devices at N IOPS": every device file behind `--wrap
  FILE=throttle:iops=N`, a disk-like device whose operations are the
  limit: reads spread over the copies show as IOPS.

Usage: bench/mirror_bench.py [--runtime S] [--size-mib N] [--repeat N] [--iops N] [--binary PATH]
Prints a Markdown table (ratios mirror/single) and writes JSON to --json.
"""
import argparse, json, os, shutil, signal, socket, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATA = os.environ.get("STRATA_BIN") or os.path.join(ROOT, "target", "release", "strata")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nbd_bench import cpu_seconds, free_port, run_fio, wait_port  # noqa: E402

WORKLOADS = [
    ("4K randwrite QD32", ["--rw=randwrite", "--bs=4k", "--iodepth=32"]),
    ("4K randread QD32", ["--rw=randread", "--bs=4k", "--iodepth=32"]),
    ("4K randread QD1", ["--rw=randread", "--bs=4k", "--iodepth=1"]),
]


class Daemon:
    def __init__(self, work, wraps, log=None):
        self.data = os.path.join(work, "data")
        self.api, self.nbd = free_port(), free_port()
        argv = [STRATA, "serve", "--data-dir", self.data, "--nbd", f"127.0.0.1:{self.nbd}",
                "--api", f"127.0.0.1:{self.api}", "--iscsi", "127.0.0.1:0", "--nfs", "127.0.0.1:0"]
        for path, spec in wraps:
            argv += ["--wrap", f"{path}={spec}"]
        # With `log`, the daemon's info lines are appended to that file.
        stderr = open(log, "a") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr,
                                     env=dict(os.environ, STRATA_LOG="info" if log else "warn"))
        wait_port(self.api)
        wait_port(self.nbd)
        token = os.path.join(self.data, "api.token")
        for _ in range(50):
            if os.path.exists(token):
                break
            time.sleep(0.1)
        self.auth = ["-H", f"Authorization: Bearer {open(token).read().strip()}"]

    def call(self, method, path, body=None):
        cmd = ["curl", "-sf", *self.auth, "-X", method, f"http://127.0.0.1:{self.api}{path}"]
        if body is not None:
            cmd[2:2] = ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def model(name, work, size_mib, iops, seed, options):
    files = {n: os.path.join(work, f"{n}.img") for n in ("one", "a", "b")}
    device_bytes = (size_mib << 20) + (256 << 20)
    for path in files.values():
        with open(path, "wb") as f:
            f.truncate(device_bytes)
    wraps = [(p, f"throttle:iops={iops}") for p in files.values()] if iops else []
    data = os.path.join(work, name.replace(" ", "-"))
    # Pools made and filled unthrottled (`--wrap` names devices of existing
    # pools), then the daemon restarted with the wraps.
    daemon = Daemon(data, [])
    try:
        # Small caches (64M of RAM): reads are meant to reach the devices.
        for pool in ("single", "mirror"):
            devices = ([{"path": files["one"], "role": "fast"}] if pool == "single" else
                       [{"path": files["a"], "role": "fast", "mirror": 0},
                        {"path": files["b"], "role": "fast", "mirror": 0}])
            daemon.call("POST", "/v1/pools", {"name": pool, "devices": devices, "ram_bytes": 64 << 20})
            daemon.call("POST", "/v1/volumes", {"name": f"{pool}/bench", "size": size_mib << 20})
            subprocess.run(["nbdcopy", "--flush", seed, f"nbd://127.0.0.1:{daemon.nbd}/{pool}/bench"], check=True)
            daemon.call("POST", f"/v1/pools/{pool}/sync")
        if wraps:
            daemon.stop()
            daemon = Daemon(data, wraps)
        results = {}
        for workload, args in WORKLOADS:
            samples = {"single": [], "mirror": []}
            for _ in range(options.repeat):
                for pool in ("single", "mirror"):
                    daemon.call("POST", f"/v1/pools/{pool}/sync")
                    os.sync()
                    before = cpu_seconds(daemon.proc.pid)
                    job = run_fio(f"nbd://127.0.0.1:{daemon.nbd}/{pool}/bench", args, options.runtime, size_mib)
                    after = cpu_seconds(daemon.proc.pid)
                    side = job["read"] if job["read"]["total_ios"] > 0 else job["write"]
                    ops = job["read"]["total_ios"] + job["write"]["total_ios"]
                    sample = {"iops": side["iops"],
                              "p50_us": side["clat_ns"]["percentile"].get("50.000000", 0) / 1000,
                              "p99_us": side["clat_ns"]["percentile"].get("99.000000", 0) / 1000,
                              "cpu_us_per_op": (after - before) * 1e6 / max(1, ops)}
                    samples[pool].append(sample)
                    print(f"{name:22} {pool:7} {workload:18} {sample}", file=sys.stderr)
            results[workload] = {pool: {k: statistics.median(s[k] for s in runs) for k in runs[0]}
                                 for pool, runs in samples.items()}
        status = json.loads(daemon.call("GET", "/v1/pools/mirror"))
        errors = [c for d in status["devices"] for c in d.get("children", []) if c["state"] != "ONLINE"]
        if errors:
            sys.exit(f"the mirror is not whole after the run: {errors}")
        return results
    finally:
        daemon.stop()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runtime", type=int, default=10)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--iops", type=int, default=2000, help="the throttled model's IOPS per device")
    parser.add_argument("--json", default=os.path.join(ROOT, "bench", "last-mirror-results.json"))
    parser.add_argument("--binary", default="", help="the strata binary (default: STRATA_BIN or target/release)")
    options = parser.parse_args()
    global STRATA
    STRATA = options.binary or STRATA
    for tool in ("fio", "nbdcopy", "curl"):
        if shutil.which(tool) is None:
            sys.exit(f"missing {tool}: apt-get install -y fio libnbd-bin curl")
    work = tempfile.mkdtemp(prefix="strata-mirror-bench-")
    try:
        seed = os.path.join(work, "seed.img")
        with open(seed, "wb") as f:
            for _ in range(options.size_mib):
                f.write(os.urandom(1 << 20))
        results = {}
        for name, iops in (("files", 0), (f"devices at {options.iops} IOPS", options.iops)):
            os.makedirs(os.path.join(work, f"m{iops}"))
            results[name] = model(name, os.path.join(work, f"m{iops}"), options.size_mib, iops, seed, options)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| devices | workload | one file | mirror of two | mirror / one |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        for workload, row in rows.items():
            one, two = row["single"], row["mirror"]
            cell = lambda r: f"{r['iops'] / 1000:.1f}k IOPS, p99 {r['p99_us']:.0f} µs, {r['cpu_us_per_op']:.1f} µs CPU/op"
            ratio = f"{two['iops'] / max(one['iops'], 1e-9):.2f}x IOPS, {two['cpu_us_per_op'] / max(one['cpu_us_per_op'], 1e-9):.2f}x CPU/op"
            print(f"| {name} | {workload} | {cell(one)} | {cell(two)} | {ratio} |")
    with open(options.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
