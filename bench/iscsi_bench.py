#!/usr/bin/env python3
"""Side-by-side iSCSI benchmark: strata vs tgt (file backing, and null backing
as the client's ceiling), in one run on equal data.

strata serves a 1 GiB volume and tgt a 1 GiB file, both filled with the same
random bytes; tgt's null backing store has no data at all. Every server
listens on an ephemeral 127.0.0.1 port and is stopped by PID. tgtd gets a
private control port (its management socket /var/run/tgtd/socket.N), so it
never touches another tgtd on the machine.

Workloads:
  4K random read QD32:  iscsi-perf -t RUNTIME -m 32 -b 8 -r URL   (8 x 512-byte blocks)
  4K write QD32:        qemu-img bench -f raw -w -t none -d 32 -c COUNT -s 4k URL

Server CPU per operation is utime+stime of the server process (all threads,
from /proc/PID/stat) over the run, divided by the operations completed.

Usage: bench/iscsi_bench.py [--runtime S] [--count N] [--size-mib N] [--only strata,tgt-file,tgt-null]
                            [--json PATH] [--baseline PATH] [--matrix 1x32,16x4,64x2,128x1,256x1]
                            [--volumes N]
--baseline adds a second strata, "strata-base", run from another binary (an
older build) in the same run: before/after side by side.
--matrix (many clients) replaces the two workloads with, for
each JOBSxQD, JOBS sessions at once (one process each, its own initiator
name): 4K random reads with iscsi-perf -m QD for RUNTIME seconds (the
sum of the sessions' averages), and 4K writes with qemu-img bench -d QD,
COUNT requests split among them (COUNT / the wall time of them all).
--volumes N (with --matrix) splits the size into N volumes (strata: N
volumes of the pool; tgt: N targets, each on its own file), session i
using volume i mod N.
Before every measurement the servers settle: strata destages its RAM
write-back cache (`strata pool sync`), then `sync` writes back the page
cache, so no row pays for the fill's or an earlier row's writes.
Needs root (tgtd), libiscsi-bin (iscsi-perf), tgt, qemu-utils with iscsi://
support (qemu-block-extra) and libnbd-bin (nbdcopy, to fill the strata volume).
Prints a Markdown table.
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_DIR = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
STRATA = os.environ.get("STRATA_BIN", os.path.join(TARGET_DIR, "release", "strata"))
TICKS = os.sysconf("SC_CLK_TCK")
TGT_IPC_DIR = "/var/run/tgtd"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {port}")
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


def stop(proc, signals=(signal.SIGTERM,), wait=20):
    """Stops one process we started, by its PID: the given signals, then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    for sig in signals:
        proc.send_signal(sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait()


class Strata:
    name = "strata"

    def __init__(self, work, seed, size, binary=STRATA, data="strata-data", volumes=1):
        self.binary = binary
        self.data_dir = os.path.join(work, data)
        self.iscsi, self.nbd, self.api = free_port(), free_port(), free_port()
        # Hundreds of sessions from one address (--matrix): above the default cap.
        self.proc = subprocess.Popen(
            [binary, "serve", "--nfs", "127.0.0.1:0", "--data-dir", self.data_dir, "--nbd", f"127.0.0.1:{self.nbd}",
             "--api", f"127.0.0.1:{self.api}", "--iscsi", f"127.0.0.1:{self.iscsi}",
             "--max-connections-per-client", "1024"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, STRATA_LOG="warn"))
        names = ["bench"] if volumes == 1 else [f"bench{i}" for i in range(volumes)]
        try:
            for port in (self.api, self.nbd, self.iscsi):
                wait_port(port, self.proc)
            for name in names:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{self.api}/v1/volumes", method="POST",
                    data=json.dumps({"name": f"default/{name}", "size": size // volumes}).encode(),
                    headers={"Content-Type": "application/json", **self.auth()})
                urllib.request.urlopen(request, timeout=60).read()
                subprocess.run(["nbdcopy", "--flush", seed, f"nbd://127.0.0.1:{self.nbd}/default/{name}"],
                               check=True)
        except BaseException:
            # The caller never sees this object: stop the daemon here.
            stop(self.proc)
            raise
        self.urls = [f"iscsi://127.0.0.1:{self.iscsi}/iqn.2026-11.io.strata:default.{name}/0" for name in names]
        self.url = self.urls[0]
        self.pid = self.proc.pid

    def settle(self):
        """Destages the RAM write-back cache, then the kernel's page cache."""
        subprocess.run([self.binary, "pool", "sync", "default", "--data-dir", self.data_dir], check=True,
                       stdout=subprocess.DEVNULL)
        os.sync()

    def auth(self):
        """The API token header (DATA_DIR/api.token: the daemon may accept
        connections on its ports a moment before it has written it)."""
        path = os.path.join(self.data_dir, "api.token")
        for _ in range(100):
            if os.path.exists(path):
                break
            time.sleep(0.1)
        return {"Authorization": f"Bearer {open(path).read().strip()}"} if os.path.exists(path) else {}

    def stop(self):
        stop(self.proc)


class Tgt:
    """One tgtd with two targets: tid 1 on a file, tid 2 on bs-type null
    (and with volumes > 1, tids 3.. on files of their own)."""

    def __init__(self, work, seed, volumes=1):
        self.file = os.path.join(work, "tgt.img")
        shutil.copyfile(seed, self.file)
        self.volumes = volumes
        os.makedirs(TGT_IPC_DIR, exist_ok=True)
        # A control port no other tgtd uses (tgtd accepts 0..32767).
        self.control = next(c for c in range(20000 + os.getpid() % 10000, 32768)
                            if not os.path.exists(f"{TGT_IPC_DIR}/socket.{c}"))
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["tgtd", "-f", "-C", str(self.control), "--iscsi", f"portal=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, self.proc)
        for tid, name, backing in [(1, "file", ["-b", self.file]),
                                   (2, "null", ["--bstype", "null", "-b", "/dev/null"])]:
            self.adm("--op", "new", "--mode", "target", "--tid", str(tid), "-T", f"iqn.2026-11.bench:{name}")
            self.adm("--op", "new", "--mode", "logicalunit", "--tid", str(tid), "--lun", "1", *backing)
            self.adm("--op", "bind", "--mode", "target", "--tid", str(tid), "-I", "ALL")
        if volumes > 1:
            for i in range(volumes):
                path = os.path.join(work, f"tgt{i}.img")
                shutil.copyfile(seed, path)
                tid = 3 + i
                self.adm("--op", "new", "--mode", "target", "--tid", str(tid), "-T", f"iqn.2026-11.bench:file{i}")
                self.adm("--op", "new", "--mode", "logicalunit", "--tid", str(tid), "--lun", "1", "-b", path)
                self.adm("--op", "bind", "--mode", "target", "--tid", str(tid), "-I", "ALL")
        self.pid = self.proc.pid

    def file_urls(self):
        if self.volumes == 1:
            return [self.url("file")]
        return [self.url(f"file{i}") for i in range(self.volumes)]

    def settle(self):
        os.sync()

    def adm(self, *args):
        subprocess.run(["tgtadm", "-C", str(self.control), "--lld", "iscsi", *args], check=True,
                       capture_output=True)

    def url(self, name):
        # LUN 0 of a tgt target is its controller; the disk is LUN 1.
        return f"iscsi://127.0.0.1:{self.port}/iqn.2026-11.bench:{name}/1"

    def stop(self):
        # tgtd -f stops on SIGINT; it may ignore SIGTERM while targets exist.
        stop(self.proc, signals=(signal.SIGINT,), wait=10)
        for leftover in (f"{TGT_IPC_DIR}/socket.{self.control}", f"{TGT_IPC_DIR}/socket.{self.control}.lock"):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass


def random_read(url, runtime):
    out = subprocess.run(["iscsi-perf", "-t", str(runtime), "-m", "32", "-b", "8", "-r", url],
                         check=True, capture_output=True, text=True).stdout
    averages = re.findall(r"iops average (\d+)", out)
    if not averages:
        raise RuntimeError(f"no result from iscsi-perf:\n{out}")
    iops = float(averages[-1])
    return iops, iops * runtime


def write(url, count):
    out = subprocess.run(["qemu-img", "bench", "-f", "raw", "-w", "-t", "none", "-d", "32", "-c", str(count),
                          "-s", "4k", url], check=True, capture_output=True, text=True).stdout
    match = re.search(r"Run completed in ([0-9.]+) seconds", out)
    if not match:
        raise RuntimeError(f"no result from qemu-img bench:\n{out}")
    return count / float(match.group(1)), count


def sessions(commands):
    """Runs the commands at once; returns their outputs (each must succeed)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]
    outputs = [p.communicate()[0] for p in procs]
    for command, proc, out in zip(commands, procs, outputs):
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{out}")
    return outputs


def initiator(i):
    return f"iqn.2026-11.io.strata.bench:session{i}"


def matrix_read(urls, jobs, qd, runtime):
    outputs = sessions([["iscsi-perf", "-i", initiator(i), "-t", str(runtime), "-m", str(qd), "-b", "8", "-r",
                         urls[i % len(urls)]] for i in range(jobs)])
    iops = 0.0
    for out in outputs:
        averages = re.findall(r"iops average (\d+)", out)
        if not averages:
            raise RuntimeError(f"no result from iscsi-perf:\n{out}")
        iops += float(averages[-1])
    return iops, iops * runtime


def matrix_write(urls, size, jobs, qd, count):
    each = max(1, count // jobs)
    # Each session writes `each` blocks one after the other from its own
    # start, which must leave room for them all before its volume's end
    # (sessions sharing a volume start where the one before stopped, as
    # far as that goes).
    room = (size // len(urls)) - each * 4096 + 4096
    if room < 4096:
        raise RuntimeError(f"{each} writes of 4K do not fit a volume of {size // len(urls)} bytes: lower --count")
    started = time.time()
    sessions([["qemu-img", "bench", "-f", "raw", "-w", "-t", "none", "-d", str(qd), "-c", str(each), "-s", "4k",
               "-o", str((i // len(urls)) * each * 4096 % room // 4096 * 4096), urls[i % len(urls)]]
              for i in range(jobs)])
    return each * jobs / (time.time() - started), each * jobs


def measure(pid, run):
    before = cpu_seconds(pid)
    iops, ops = run()
    after = cpu_seconds(pid)
    return {"iops": iops, "ops": ops, "cpu_us_per_op": (after - before) * 1e6 / max(1, ops)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runtime", type=int, default=10, help="iscsi-perf seconds")
    parser.add_argument("--count", type=int, default=200000, help="qemu-img bench requests")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--only", default="", help="comma-separated: strata,tgt-file,tgt-null")
    parser.add_argument("--json", default="", help="also write the results as JSON here")
    parser.add_argument("--baseline", default="", help="another strata binary to run side by side (before/after)")
    parser.add_argument("--matrix", default="", help="JOBSxQD,... : many sessions at once (see above)")
    parser.add_argument("--volumes", type=int, default=1, help="with --matrix: split the size into N volumes")
    options = parser.parse_args()
    for tool in ["iscsi-perf", "qemu-img", "tgtd", "tgtadm", "nbdcopy"]:
        if not shutil.which(tool):
            sys.exit(f"missing {tool}: apt-get install -y libiscsi-bin tgt qemu-utils libnbd-bin")
    if "iscsi" not in subprocess.run(["qemu-img", "--help"], capture_output=True, text=True).stdout:
        sys.exit("qemu-img has no iscsi:// support: install qemu-block-extra matching qemu-utils")
    if not os.path.exists(STRATA):
        subprocess.run(["cargo", "build", "--release"], cwd=ROOT, check=True)

    work = tempfile.mkdtemp(prefix="strata-iscsi-bench-")
    if options.volumes > 1 and not options.matrix:
        sys.exit("--volumes needs --matrix")
    size = options.size_mib << 20
    seed = os.path.join(work, "seed.img")
    with open(seed, "wb") as f:
        for _ in range(options.size_mib // options.volumes):
            f.write(os.urandom(1 << 20))

    wanted = options.only.split(",") if options.only else ["strata", "tgt-file", "tgt-null"]
    workloads = [
        ("4K random read QD32 (iscsi-perf)", lambda url: random_read(url, options.runtime)),
        ("4K write QD32 (qemu-img bench)", lambda url: write(url, options.count)),
    ]
    if options.matrix:
        workloads = []
        for row in options.matrix.split(","):
            jobs, qd = (int(n) for n in row.split("x"))
            if jobs < options.volumes:
                continue  # a row with fewer sessions than volumes (as in many_clients.sh)
            workloads.append((f"4K random read {jobs}x{qd}",
                              lambda urls, j=jobs, q=qd: matrix_read(urls, j, q, options.runtime)))
            workloads.append((f"4K write {jobs}x{qd}",
                              lambda urls, j=jobs, q=qd: matrix_write(urls, size, j, q, options.count)))
    results = {}
    strata = base = tgt = None
    if options.baseline:
        wanted.append("strata-base")
    try:
        strata = Strata(work, seed, size, volumes=options.volumes)
        if options.baseline:
            base = Strata(work, seed, size, options.baseline, "strata-base", volumes=options.volumes)
        tgt = Tgt(work, seed, volumes=options.volumes)
        os.unlink(seed)
        # (name, pid, where the workload goes: one URL, or with --matrix the
        # list of volumes' URLs, and how the server settles)
        matrix = bool(options.matrix)
        peers = [("strata", strata.pid, strata.urls if matrix else strata.url, strata.settle)]
        if base:
            peers.append(("strata-base", base.pid, base.urls if matrix else base.url, base.settle))
        peers += [("tgt-file", tgt.pid, tgt.file_urls() if matrix else tgt.url("file"), tgt.settle),
                  ("tgt-null", tgt.pid, [tgt.url("null")] if matrix else tgt.url("null"), tgt.settle)]
        peers = [p for p in peers if p[0] in wanted]
        # Interleave servers within each workload, so a slow phase of a noisy
        # machine is shared rather than hitting one server only.
        for workload, run in workloads:
            for name, pid, url, settle in peers:
                settle()
                result = measure(pid, lambda: run(url))
                results.setdefault(workload, {})[name] = result
                print(f"{name:9} {workload:34} {result['iops']:9.0f} IOPS {result['cpu_us_per_op']:6.1f} us CPU/op",
                      file=sys.stderr)
    finally:
        if strata:
            strata.stop()
        if base:
            base.stop()
        if tgt:
            tgt.stop()
        shutil.rmtree(work, ignore_errors=True)

    names = [p[0] for p in peers]
    ratio = "strata/tgt-file" if {"strata", "tgt-file"} <= set(names) else None
    print("| workload | " + " | ".join(names) + (f" | {ratio} IOPS | {ratio} CPU/op" if ratio else "") + " |")
    print("|---|" + "---|" * (len(names) + (2 if ratio else 0)))
    for workload, _ in workloads:
        row = results[workload]
        cells = [f"{row[n]['iops'] / 1000:.1f}k IOPS, {row[n]['cpu_us_per_op']:.1f} µs CPU/op" for n in names]
        if ratio:
            cells.append(f"{row['strata']['iops'] / row['tgt-file']['iops']:.2f}x")
            cells.append(f"{row['strata']['cpu_us_per_op'] / row['tgt-file']['cpu_us_per_op']:.2f}x")
        print(f"| {workload} | " + " | ".join(cells) + " |")
    if options.json:
        with open(options.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
