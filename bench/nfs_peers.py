"""The two NFS servers the NFS benchmarks run side by side (imported by
bench/nfs_qd.py and bench/nfs_bigdir.py), the server CPU they read from
/proc, and bench/nfs_load.c compiled (`cc -O2 -lnfs`).

strata runs on ephemeral 127.0.0.1 ports with its RAM tier in the run's
temporary directory, stopped by PID (SIGINT: a clean stop); nfs-ganesha
(VFS backend) on 127.0.0.1:12049/12048 through
../shared/tools/nfs-ganesha/start.sh, exporting a directory of the same
file system, stopped by its stop.sh.
"""

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GANESHA_TOOLS = Path(os.environ.get("GANESHA_TOOLS", HERE.parent.parent / "shared/tools/nfs-ganesha"))
GANESHA_STATE = Path(os.environ.get("GANESHA_STATE", "/tmp/ganesha-peer"))


def cpu_seconds(pid):
    """utime + stime of process `pid`, in seconds."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compile_load(tmp):
    exe = tmp / "nfs_load"
    subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-o", str(exe), str(HERE / "nfs_load.c"), "-lnfs"],
                   check=True)
    return exe


def run_load(exe, server, args, timeout=1800):
    """One nfs_load run against `server`: its RESULT fields (numbers as
    floats) and the server's CPU µs per operation; RuntimeError with the
    end of its stderr if it fails."""
    cpu = cpu_seconds(server.pid)
    out = subprocess.run([str(exe), server.url] + args, capture_output=True, text=True, timeout=timeout)
    cpu = cpu_seconds(server.pid) - cpu
    if out.returncode != 0:
        raise RuntimeError(f"nfs_load {' '.join(args)} on {server.name} failed: {out.stderr.strip()[-2000:]}")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    res = {}
    for kv in line.split()[1:]:
        k, v = kv.split("=", 1)
        try:
            res[k] = float(v)
        except ValueError:
            res[k] = v
    res["cpu_us_per_op"] = cpu * 1e6 / max(1, res["ops"])
    return res


class Strata:
    """A strata daemon serving default/files with root not squashed; `tag`
    tells apart several in one temporary directory."""
    name = "strata"

    def __init__(self, binary, tmp, tag=""):
        self.binary, self.tmp, self.tag = binary, tmp, tag
        self.data = tmp / f"strata{tag}"
        self.starts = 0
        self.start()
        subprocess.run([binary, "fs", "set", "default/files", "nfs.squash=none", "--data-dir", str(self.data)],
                       check=True, stdout=subprocess.DEVNULL)

    def start(self):
        """Starts the daemon (again, on the same data directory) and waits
        until it listens; `start_seconds` is how long that took."""
        self.starts += 1
        suffix = f"{self.tag}" if self.starts == 1 else f"{self.tag}-{self.starts}"
        self.out = self.tmp / f"strata{suffix}.out"
        err = self.tmp / f"strata{suffix}.err"
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [self.binary, "serve", "--data-dir", str(self.data), "--nbd", "127.0.0.1:0", "--api", "127.0.0.1:0",
             "--iscsi", "127.0.0.1:0", "--nfs", "127.0.0.1:0"],
            stdout=open(self.out, "w"), stderr=open(err, "w"), env={**os.environ, "STRATA_RAM_DIR": str(self.tmp)})
        self.pid = self.proc.pid
        text = ""
        while "strata: iscsi listening" not in text:
            if time.monotonic() - t0 > 600 or self.proc.poll() is not None:
                raise RuntimeError(f"strata did not start: {err.read_text()[-2000:]}")
            time.sleep(0.02)
            text = self.out.read_text()
        self.start_seconds = time.monotonic() - t0
        nfs = re.search(r"strata: nfs listening on 127\.0\.0\.1:(\d+)", text).group(1)
        nbd = re.search(r"strata: nbd listening on 127\.0\.0\.1:(\d+)", text).group(1)
        self.url = f"nfs://127.0.0.1/default/files?nfsport={nfs}&mountport={nfs}&version=3"
        self.nbd_uri = f"nbd://127.0.0.1:{nbd}/default/vol0"

    def stop(self):
        """A clean stop; returns how many seconds it took."""
        self.proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - t0


class Ganesha:
    name = "ganesha"

    def __init__(self, tmp, tag=""):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", 12049)) == 0:
                raise RuntimeError("something already listens on 127.0.0.1:12049 (another ganesha?)")
        export = tmp / f"ganesha-export{tag}"
        export.mkdir()
        subprocess.run([str(GANESHA_TOOLS / "start.sh"), str(export)], check=True)
        self.pid = int((GANESHA_STATE / "ganesha.pid").read_text())
        self.url = f"nfs://127.0.0.1{export}?nfsport=12049&mountport=12048&version=3"

    def stop(self):
        subprocess.run([str(GANESHA_TOOLS / "stop.sh")], check=False)
        for _ in range(100):  # its ports must be free for the next start
            if not Path(f"/proc/{self.pid}").exists():
                break
            time.sleep(0.1)
        return 0.0
