#!/usr/bin/env python3
"""NFSv3: strata's file service against nfs-ganesha (VFS backend) on an equal
directory of the same file system, the same client for both: libnfs's
synchronous API (Debian's libnfs13, through ctypes), one request at a time.

Rows: a 1M sequential write of a file (UNSTABLE writes, one COMMIT at the
end) and its sequential read; 4K random writes (UNSTABLE, COMMIT every
1 MiB) and 4K random reads over that file, for a fixed time; metadata:
create + close, stat, a listing, remove of N files in one directory.
Server CPU (utime + stime from /proc) per operation for each row.

What it is not: the QD32 rows (libnfs's synchronous API has one
request in flight): those are bench/nfs_qd.py with bench/nfs_load.c.

Usage: bench/nfs_bench.py [--binary target/release/strata] [--file-mib 256]
       [--seconds 10] [--files 2000] [--only strata,ganesha]
A temporary directory under /tmp, strata on ephemeral 127.0.0.1 ports and
stopped by PID; ganesha on 127.0.0.1:12049/12048 through
../shared/tools/nfs-ganesha/start.sh (stopped by its stop.sh).
"""

import argparse
import ctypes
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GANESHA_TOOLS = Path(os.environ.get("GANESHA_TOOLS", HERE.parent.parent / "shared/tools/nfs-ganesha"))

lib = ctypes.CDLL("libnfs.so.13")


class NfsUrl(ctypes.Structure):
    _fields_ = [("server", ctypes.c_char_p), ("path", ctypes.c_char_p), ("file", ctypes.c_char_p)]


class Stat64(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "dev", "ino", "mode", "nlink", "uid", "gid", "rdev", "size", "blksize", "blocks",
        "atime", "mtime", "ctime", "atime_nsec", "mtime_nsec", "ctime_nsec", "used")]


lib.nfs_init_context.restype = ctypes.c_void_p
lib.nfs_parse_url_dir.restype = ctypes.POINTER(NfsUrl)
lib.nfs_parse_url_dir.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
lib.nfs_get_error.restype = ctypes.c_char_p
lib.nfs_get_error.argtypes = [ctypes.c_void_p]
for name, args in {
    "nfs_mount": [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p],
    "nfs_creat": [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)],
    "nfs_open": [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)],
    "nfs_close": [ctypes.c_void_p, ctypes.c_void_p],
    "nfs_pwrite": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p],
    "nfs_pread": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p],
    "nfs_fsync": [ctypes.c_void_p, ctypes.c_void_p],
    "nfs_stat64": [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(Stat64)],
    "nfs_unlink": [ctypes.c_void_p, ctypes.c_char_p],
    "nfs_mkdir": [ctypes.c_void_p, ctypes.c_char_p],
    "nfs_opendir": [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)],
    "nfs_readdir": [ctypes.c_void_p, ctypes.c_void_p],
    "nfs_closedir": [ctypes.c_void_p, ctypes.c_void_p],
}.items():
    getattr(lib, name).argtypes = args
lib.nfs_readdir.restype = ctypes.c_void_p


class Client:
    """One libnfs context, mounted."""

    def __init__(self, url):
        self.nfs = lib.nfs_init_context()
        parsed = lib.nfs_parse_url_dir(self.nfs, url.encode())
        if not parsed:
            raise RuntimeError(f"bad url {url}: {lib.nfs_get_error(self.nfs)}")
        self.check(lib.nfs_mount(self.nfs, parsed.contents.server, parsed.contents.path), "mount")

    def check(self, rc, what):
        if rc < 0:
            raise RuntimeError(f"{what}: {lib.nfs_get_error(self.nfs).decode()}")
        return rc

    def creat(self, path):
        fh = ctypes.c_void_p()
        self.check(lib.nfs_creat(self.nfs, path.encode(), 0o644, ctypes.byref(fh)), f"creat {path}")
        return fh

    def open(self, path, flags=os.O_RDWR):
        fh = ctypes.c_void_p()
        self.check(lib.nfs_open(self.nfs, path.encode(), flags, ctypes.byref(fh)), f"open {path}")
        return fh


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(pid, work):
    """Runs work() -> operations; returns (ops, seconds, server CPU s)."""
    cpu = cpu_seconds(pid)
    start = time.perf_counter()
    ops = work()
    return ops, time.perf_counter() - start, cpu_seconds(pid) - cpu


def run_rows(url, pid, args):
    c = Client(url)
    rows = []
    one_mib = ctypes.create_string_buffer(os.urandom(1 << 20), 1 << 20)
    mib = args.file_mib

    def seq_write():
        fh = c.creat("/bench.bin")
        for i in range(mib):
            c.check(lib.nfs_pwrite(c.nfs, fh, i << 20, 1 << 20, one_mib), "pwrite")
        c.check(lib.nfs_fsync(c.nfs, fh), "fsync")
        c.check(lib.nfs_close(c.nfs, fh), "close")
        return mib

    def seq_read():
        fh = c.open("/bench.bin", os.O_RDONLY)
        buf = ctypes.create_string_buffer(1 << 20)
        for i in range(mib):
            c.check(lib.nfs_pread(c.nfs, fh, i << 20, 1 << 20, buf), "pread")
        c.check(lib.nfs_close(c.nfs, fh), "close")
        return mib

    blocks = (mib << 20) // 4096
    four_k = ctypes.create_string_buffer(os.urandom(4096), 4096)
    rng = random.Random(7)

    def rand_write():
        fh = c.open("/bench.bin")
        ops, end = 0, time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            for _ in range(256):
                c.check(lib.nfs_pwrite(c.nfs, fh, rng.randrange(blocks) * 4096, 4096, four_k), "pwrite")
            c.check(lib.nfs_fsync(c.nfs, fh), "fsync")
            ops += 256
        c.check(lib.nfs_close(c.nfs, fh), "close")
        return ops

    def rand_read():
        fh = c.open("/bench.bin", os.O_RDONLY)
        buf = ctypes.create_string_buffer(4096)
        ops, end = 0, time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            for _ in range(256):
                c.check(lib.nfs_pread(c.nfs, fh, rng.randrange(blocks) * 4096, 4096, buf), "pread")
            ops += 256
        c.check(lib.nfs_close(c.nfs, fh), "close")
        return ops

    names = [f"/meta/f{i:06d}" for i in range(args.files)]

    def create():
        c.check(lib.nfs_mkdir(c.nfs, b"/meta"), "mkdir")
        for name in names:
            c.check(lib.nfs_close(c.nfs, c.creat(name)), "close")
        return len(names)

    def stat():
        st = Stat64()
        for name in names:
            c.check(lib.nfs_stat64(c.nfs, name.encode(), ctypes.byref(st)), "stat")
        return len(names)

    def listing():
        d = ctypes.c_void_p()
        c.check(lib.nfs_opendir(c.nfs, b"/meta", ctypes.byref(d)), "opendir")
        count = 0
        while lib.nfs_readdir(c.nfs, d):
            count += 1
        lib.nfs_closedir(c.nfs, d)
        assert count >= len(names), f"listed {count} of {len(names)}"
        return count

    def remove():
        for name in names:
            c.check(lib.nfs_unlink(c.nfs, name.encode()), "unlink")
        return len(names)

    for label, unit, work in [
        ("1M seq write (UNSTABLE, COMMIT at end)", "MiB/s", seq_write),
        ("1M seq read", "MiB/s", seq_read),
        ("4K rand write QD1 (UNSTABLE, COMMIT per MiB)", "IOPS", rand_write),
        ("4K rand read QD1", "IOPS", rand_read),
        (f"create {args.files} files", "ops/s", create),
        (f"stat {args.files} files", "ops/s", stat),
        (f"list {args.files} entries (READDIRPLUS)", "entries/s", listing),
        (f"remove {args.files} files", "ops/s", remove),
    ]:
        ops, seconds, cpu = measure(pid, work)
        rows.append((label, unit, ops / seconds, cpu / ops * 1e6))
    return rows


def start_strata(binary, tmp):
    data = tmp / "strata"
    proc = subprocess.Popen(
        [binary, "serve", "--data-dir", str(data), "--nbd", "127.0.0.1:0", "--api", "127.0.0.1:0",
         "--iscsi", "127.0.0.1:0", "--nfs", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=open(tmp / "strata.err", "w"), text=True,
        env={**os.environ, "STRATA_RAM_DIR": str(tmp)})
    port = None
    for line in proc.stdout:
        m = re.match(r"strata: nfs listening on 127\.0\.0\.1:(\d+)", line)
        if m:
            port = m.group(1)
        if line.startswith("strata: iscsi listening"):
            break
    subprocess.run([binary, "fs", "set", "default/files", "nfs.squash=none", "--data-dir", str(data)],
                   check=True, stdout=subprocess.DEVNULL)
    return proc, f"nfs://127.0.0.1/default/files?nfsport={port}&mountport={port}&version=3"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default=str(HERE.parent / "target/release/strata"))
    parser.add_argument("--file-mib", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--only", default="strata,ganesha")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="strata-nfs-bench-", dir="/tmp"))
    results = {}
    try:
        for name in args.only.split(","):
            if name == "strata":
                proc, url = start_strata(args.binary, tmp)
                try:
                    results[name] = run_rows(url, proc.pid, args)
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
            elif name == "ganesha":
                export = tmp / "ganesha-export"
                export.mkdir()
                subprocess.run([str(GANESHA_TOOLS / "start.sh"), str(export)], check=True)
                try:
                    pid = int(open("/tmp/ganesha-peer/ganesha.pid").read())
                    url = f"nfs://127.0.0.1{export}?nfsport=12049&mountport=12048&version=3"
                    results[name] = run_rows(url, pid, args)
                finally:
                    subprocess.run([str(GANESHA_TOOLS / "stop.sh")], check=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    names = list(results)
    print("| row | " + " | ".join(f"{n} (CPU µs/op)" for n in names) +
          (" | strata / ganesha |" if len(names) == 2 else " |"))
    print("|---" * (len(names) + 1 + (len(names) == 2)) + "|")
    for i, (label, unit, _, _) in enumerate(results[names[0]]):
        cells = [f"{results[n][i][2]:,.0f} {unit} ({results[n][i][3]:,.1f})" for n in names]
        ratio = ""
        if len(names) == 2:
            ratio = f" {results[names[0]][i][2] / results[names[1]][i][2]:.2f}x |"
        print(f"| {label} | " + " | ".join(cells) + " |" + ratio)


if __name__ == "__main__":
    sys.exit(main())
