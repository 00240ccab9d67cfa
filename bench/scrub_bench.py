#!/usr/bin/env python3
"""What a scrub reads, and what it costs the clients meanwhile.

One strata daemon, a pool on a mirror of two device files and a volume of
--size-mib filled with random bytes (then destaged to its place).

- Idle pace: `pool scrub` of the pool with no client, its bytes per second
  (from the scrub's own status) and the daemon's CPU per GiB checked, side
  by side with a client reading the whole volume sequentially through NBD
  (fio, 1 MiB reads, QD4): the pace the same devices give a reader.
- Resilver: a third device attached to the mirror is copied (every chunk
  in use: a new device has no dirty record) at the resilver's own pace,
  against the same sequential read and against dd copying a child's file
  to a new file (the page cache's own pace for that copy: writing pages of
  a new file costs far more than reading cached ones); then that device is
  taken away, the
  client writes --changed-mib (1 MiB writes from a quarter of the volume
  on), and the device comes back:
  the bytes the resilver copies against the bytes written meanwhile.
- Under load, on disk-like devices (each device file behind `--wrap
  FILE=delay:4ms+throttle:iops=200`): a client's 4K random reads at QD1
  (fio over NBD, --runtime s) alone, then with a scrub running the whole
  time; the client's IOPS and p99, and how far the scrub got meanwhile.
- Resilver on disk-like devices (another daemon; every device behind
  `delay:4ms+throttle:bw=100M`): a mirror of two whose second device was
  away while the client rewrote the whole volume of --disk-mib; the
  resilver's pace when it is back, against fio's sequential read (1 MiB,
  QD4) of a pool on one such device.

Usage: bench/scrub_bench.py [--runtime S] [--size-mib N] [--disk-mib N] [--binary PATH] [--json FILE]
Prints a Markdown table and writes JSON to --json.
"""
import argparse, json, os, re, shutil, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mirror_bench  # noqa: E402
from nbd_bench import cpu_seconds, run_fio  # noqa: E402

SLOW = "delay:4ms+throttle:iops=200"
# A disk that streams: a seek's worth of latency per request, 100 MiB/s.
DISK = "delay:4ms+throttle:bw=100M"


def scrub_status(daemon):
    return json.loads(daemon.call("GET", "/v1/pools/m/scrub"))


def wait_scrub(daemon, timeout=3600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = scrub_status(daemon)
        if status and status["state"] != "scanning":
            return status
        time.sleep(0.1)
    sys.exit("the scrub did not end")


SUFFIX = {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def resilvers(log):
    """(bytes copied, seconds) of every resilver the daemon's log reports."""
    found = []
    for line in open(log, errors="replace"):
        m = re.search(r"resilvered .* \(([\d.]+)([BKMGT]) copied in ([\d.]+) s\)", line)
        if m:
            found.append((float(m.group(1)) * SUFFIX[m.group(2)], float(m.group(3))))
    return found


def wait_resilvers(log, count, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = resilvers(log)
        if len(found) >= count:
            return found[count - 1]
        time.sleep(0.05)
    sys.exit(f"no resilver {count} in {log}")


def client(daemon, args, runtime, size_mib):
    job = run_fio(f"nbd://127.0.0.1:{daemon.nbd}/m/bench", args, runtime, size_mib)
    side = job["read"]
    return {"iops": side["iops"], "mib_s": side["bw_bytes"] / (1 << 20),
            "p99_us": side["clat_ns"]["percentile"].get("99.000000", 0) / 1000}


def disk_resilver(work, size_mib):
    """The resilver on disk-like devices: a mirror of two, one away while
    the client rewrites the whole volume, then back with every device behind
    DISK; its pace against a sequential read of one such device (a pool
    "one" on a single device, its volume filled the same way)."""
    files = {n: os.path.join(work, f"disk-{n}.img") for n in ("x", "y", "one")}
    for path in files.values():
        with open(path, "wb") as f:
            f.truncate((size_mib << 20) + (256 << 20))
    seed = os.path.join(work, "disk-seed.img")
    with open(seed, "wb") as f:
        for _ in range(size_mib):
            f.write(os.urandom(1 << 20))
    data = os.path.join(work, "disk")
    daemon = mirror_bench.Daemon(data, [])
    try:
        mirror = [{"path": files[n], "role": "fast", "mirror": 0} for n in ("x", "y")]
        daemon.call("POST", "/v1/pools", {"name": "m", "devices": mirror, "ram_bytes": 64 << 20})
        daemon.call("POST", "/v1/pools", {"name": "one", "devices": [{"path": files["one"], "role": "fast"}],
                                          "ram_bytes": 64 << 20})
        for pool in ("m", "one"):
            daemon.call("POST", "/v1/volumes", {"name": f"{pool}/bench", "size": size_mib << 20})
            subprocess.run(["nbdcopy", "--flush", seed, f"nbd://127.0.0.1:{daemon.nbd}/{pool}/bench"], check=True)
            daemon.call("POST", f"/v1/pools/{pool}/sync")
        daemon.stop()
        os.rename(files["y"], files["y"] + ".away")
        daemon = mirror_bench.Daemon(data, [])
        subprocess.run(["nbdcopy", "--flush", seed, f"nbd://127.0.0.1:{daemon.nbd}/m/bench"], check=True)
        daemon.call("POST", "/v1/pools/m/sync")
        daemon.stop()
        os.rename(files["y"] + ".away", files["y"])
        log = os.path.join(work, "disk.log")
        daemon = mirror_bench.Daemon(data, [(p, DISK) for p in files.values()], log=log)
        copied, seconds = wait_resilvers(log, 1)
        job = run_fio(f"nbd://127.0.0.1:{daemon.nbd}/one/bench", ["--rw=read", "--bs=1M", "--iodepth=4"], 10,
                      size_mib)
        return {"resilver_mib_s": copied / (1 << 20) / max(seconds, 1e-9), "copied_bytes": copied,
                "read_mib_s": job["read"]["bw_bytes"] / (1 << 20)}
    finally:
        daemon.stop()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runtime", type=int, default=20)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--changed-mib", type=int, default=64)
    parser.add_argument("--disk-mib", type=int, default=512)
    parser.add_argument("--json", default=os.path.join(ROOT, "bench", "last-scrub-results.json"))
    parser.add_argument("--binary", default="")
    options = parser.parse_args()
    if options.binary:
        mirror_bench.STRATA = options.binary
    for tool in ("fio", "nbdcopy", "curl"):
        if shutil.which(tool) is None:
            sys.exit(f"missing {tool}: apt-get install -y fio libnbd-bin curl")
    work = tempfile.mkdtemp(prefix="strata-scrub-bench-")
    results = {}
    daemon = None
    try:
        files = [os.path.join(work, f"{n}.img") for n in ("a", "b")]
        for path in files:
            with open(path, "wb") as f:
                f.truncate((options.size_mib << 20) + (256 << 20))
        seed = os.path.join(work, "seed.img")
        with open(seed, "wb") as f:
            for _ in range(options.size_mib):
                f.write(os.urandom(1 << 20))
        data = os.path.join(work, "d")
        daemon = mirror_bench.Daemon(data, [])
        devices = [{"path": p, "role": "fast", "mirror": 0} for p in files]
        daemon.call("POST", "/v1/pools", {"name": "m", "devices": devices, "ram_bytes": 64 << 20})
        daemon.call("POST", "/v1/volumes", {"name": "m/bench", "size": options.size_mib << 20})
        subprocess.run(["nbdcopy", "--flush", seed, f"nbd://127.0.0.1:{daemon.nbd}/m/bench"], check=True)
        daemon.call("POST", "/v1/pools/m/sync")
        os.sync()

        # Idle pace against a client's sequential read of the same volume.
        before = cpu_seconds(daemon.proc.pid)
        daemon.call("POST", "/v1/pools/m/scrub", {"action": "start"})
        done = wait_scrub(daemon)
        cpu = cpu_seconds(daemon.proc.pid) - before
        gib = done["issued_bytes"] / (1 << 30)
        if done["state"] != "finished" or done["errors"]:
            sys.exit(f"the scrub did not finish clean: {done}")
        before = cpu_seconds(daemon.proc.pid)
        read = client(daemon, ["--rw=read", "--bs=1M", "--iodepth=4"], options.runtime, options.size_mib)
        read_cpu = cpu_seconds(daemon.proc.pid) - before
        read_gib = read["mib_s"] * options.runtime / 1024
        results["idle"] = {"scrub_mib_s": done["bytes_per_second"] / (1 << 20),
                           "scrub_cpu_s_per_gib": cpu / max(gib, 1e-9),
                           "read_mib_s": read["mib_s"], "read_cpu_s_per_gib": read_cpu / max(read_gib, 1e-9)}
        print(f"idle: {results['idle']}", file=sys.stderr)

        # Resilver of a new copy, then after an absence.
        daemon.stop()
        log = os.path.join(work, "daemon.log")
        daemon = mirror_bench.Daemon(data, [], log=log)
        third = os.path.join(work, "c.img")
        with open(third, "wb") as f:
            f.truncate((options.size_mib << 20) + (256 << 20))
        before = cpu_seconds(daemon.proc.pid)
        daemon.call("POST", "/v1/pools/m/attach", {"device": files[0], "new": third})
        full_bytes, full_s = wait_resilvers(log, 1)
        full_cpu = cpu_seconds(daemon.proc.pid) - before
        daemon.stop()
        # The same copy without strata: a child's file to a new sparse file
        # with dd (1 MiB reads and writes), the page cache's own pace for it.
        copy = os.path.join(work, "copy.img")
        with open(copy, "wb") as f:
            f.truncate(os.path.getsize(files[0]))
        began = time.time()
        subprocess.run(["dd", f"if={files[0]}", f"of={copy}", "bs=1M", "conv=notrunc",
                        f"count={int(full_bytes) >> 20}", "status=none"], check=True)
        copy_mib_s = (int(full_bytes) >> 20) / (time.time() - began)
        os.unlink(copy)
        os.rename(third, third + ".away")
        daemon = mirror_bench.Daemon(data, [], log=log)
        run_fio(f"nbd://127.0.0.1:{daemon.nbd}/m/bench", ["--rw=write", "--bs=1M", "--iodepth=4",
                f"--offset={options.size_mib // 4}m", "--time_based=0"], 0, options.changed_mib)
        daemon.call("POST", "/v1/pools/m/sync")
        daemon.stop()
        os.rename(third + ".away", third)
        daemon = mirror_bench.Daemon(data, [], log=log)
        back_bytes, back_s = wait_resilvers(log, 2)
        results["resilver"] = {"full_mib_s": full_bytes / (1 << 20) / max(full_s, 1e-9), "full_bytes": full_bytes,
                               "dd_copy_mib_s": copy_mib_s,
                               "full_cpu_s_per_gib": full_cpu / max(full_bytes / (1 << 30), 1e-9),
                               "changed_bytes": options.changed_mib << 20, "back_bytes": back_bytes,
                               "back_s": back_s}
        print(f"resilver: {results['resilver']}", file=sys.stderr)

        # Disk-like devices: a client alone, then beside a scrub.
        daemon.stop()
        daemon = mirror_bench.Daemon(data, [(p, SLOW) for p in files])
        randread = ["--rw=randread", "--bs=4k", "--iodepth=1"]
        alone = client(daemon, randread, options.runtime, options.size_mib)
        print(f"alone: {alone}", file=sys.stderr)
        daemon.call("POST", "/v1/pools/m/scrub", {"action": "start"})
        beside = client(daemon, randread, options.runtime, options.size_mib)
        during = scrub_status(daemon)
        if during["state"] == "scanning":
            daemon.call("POST", "/v1/pools/m/scrub", {"action": "stop"})
        print(f"beside a scrub: {beside}; scrub {during}", file=sys.stderr)
        if during["state"] not in ("scanning", "finished"):
            sys.exit(f"the scrub did not run through the client's run: {during}")
        results["slow"] = {"alone": alone, "beside": beside,
                           "scrub_mib_s": during["issued_bytes"] / (1 << 20) / options.runtime,
                           "scrub_state": during["state"]}
        daemon.stop()
        daemon = None
        results["disk"] = disk_resilver(work, options.disk_mib)
        print(f"disk-like resilver: {results['disk']}", file=sys.stderr)
    finally:
        if daemon:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    idle, slow = results["idle"], results["slow"]
    print("| measure | strata's scrub | reference | ratio |")
    print("|---|---|---|---|")
    print(f"| idle pace (files) | {idle['scrub_mib_s']:.0f} MiB/s, {idle['scrub_cpu_s_per_gib']:.2f} s CPU/GiB | "
          f"client sequential read {idle['read_mib_s']:.0f} MiB/s, {idle['read_cpu_s_per_gib']:.2f} s CPU/GiB | "
          f"{idle['scrub_mib_s'] / max(idle['read_mib_s'], 1e-9):.2f}x |")
    a, b = slow["alone"], slow["beside"]
    print(f"| 4K randread QD1 on {SLOW} | beside a scrub: {b['iops']:.0f} IOPS, p99 {b['p99_us']:.0f} µs "
          f"(scrub {slow['scrub_mib_s']:.1f} MiB/s) | alone: {a['iops']:.0f} IOPS, p99 {a['p99_us']:.0f} µs | "
          f"{b['iops'] / max(a['iops'], 1e-9):.2f}x IOPS, {b['p99_us'] / max(a['p99_us'], 1e-9):.2f}x p99 |")
    r = results["resilver"]
    print(f"| resilver of a new copy (files) | {r['full_mib_s']:.0f} MiB/s, {r['full_cpu_s_per_gib']:.2f} s CPU/GiB | "
          f"client sequential read {idle['read_mib_s']:.0f} MiB/s | {r['full_mib_s'] / max(idle['read_mib_s'], 1e-9):.2f}x |")
    print(f"| resilver of a new copy against dd's copy of a child's file | {r['full_mib_s']:.0f} MiB/s | "
          f"dd {r['dd_copy_mib_s']:.0f} MiB/s | {r['full_mib_s'] / max(r['dd_copy_mib_s'], 1e-9):.2f}x |")
    k = results["disk"]
    print(f"| resilver on {DISK} devices | {k['resilver_mib_s']:.0f} MiB/s | "
          f"one device's sequential read {k['read_mib_s']:.0f} MiB/s | "
          f"{k['resilver_mib_s'] / max(k['read_mib_s'], 1e-9):.2f}x |")
    print(f"| resilver after an absence | {r['back_bytes'] / (1 << 20):.1f} MiB copied | "
          f"{r['changed_bytes'] >> 20} MiB written meanwhile | {r['back_bytes'] / r['changed_bytes']:.2f}x |")
    with open(options.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
