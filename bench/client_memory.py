#!/usr/bin/env python3
"""What a client that never reads its replies costs the daemon: strata's
resident memory (RssAnon: heap and stacks, not the RAM tier's shared
mapping) with 1, 16 and 128 NBD connections from one address (127.0.0.1),
each sending four of the largest READs (32 MiB) and never reading a reply;
the same with the largest WRITEs (each connection sends until the daemon
stops reading); and 1,000 idle connections (handshake done, nothing
sent). Meanwhile another client (127.0.0.2) reads 4 KiB blocks: its reads
per second and worst latency show whether it is still served.

Usage: bench/client_memory.py [--binary target/release/strata]
       [--baseline OTHER_BINARY] [--client-memory 1G] [--seconds 5]
       [--json FILE]
Each case starts a fresh daemon (a temporary directory under /tmp, ports
ephemeral on 127.0.0.1, stopped by PID with SIGINT). --client-memory is
passed to the binary under test only (a baseline binary without the flag
runs unbounded).
"""

import argparse
import json
import os
import re
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

MIB = 1 << 20
BIG = 32 * MIB
PAYLOAD = bytes(BIG)
# Unbounded, a baseline would take 128 x 128 MiB: it runs up to this many.
BASELINE_MOST_CONNECTIONS = 16


def rss_anon(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def nbd_connect(port, source="127.0.0.1", export="default/vol0"):
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.settimeout(30)
    greeting = recv_exact(s, 18)
    assert greeting[:8] == b"NBDMAGIC"
    s.sendall(struct.pack(">I", 3))
    name = export.encode()
    data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    s.sendall(struct.pack(">QII", 0x49484156454F5054, 7, len(data)) + data)
    while True:
        header = recv_exact(s, 20)
        _, _, kind, length = struct.unpack(">QIII", header)
        recv_exact(s, length)
        if kind == 1:
            return s
        if kind != 3:
            raise RuntimeError(f"NBD_OPT_GO refused: {kind:#x}")


def recv_exact(s, n):
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise RuntimeError("connection closed")
        out += chunk
    return bytes(out)


def request(kind, cookie, offset, length):
    return struct.pack(">IHHQQI", 0x25609513, 0, kind, cookie, offset, length)


class Daemon:
    def __init__(self, binary, tmp, extra):
        self.data = tmp / "data"
        pool = self.data / "pools/default"
        pool.mkdir(parents=True)
        for name, size in [("fast.dev", 4 << 30), ("capacity.dev", 8 << 30)]:
            with open(pool / name, "wb") as f:
                f.truncate(size)
        self.out = tmp / "out.log"
        self.proc = subprocess.Popen(
            [binary, "serve", "--data-dir", str(self.data), "--nbd", "127.0.0.1:0", "--api", "127.0.0.1:0",
             "--iscsi", "127.0.0.1:0", "--nfs", "off", "--max-connections", "2048",
             "--max-connections-per-client", "2048"] + extra,
            stdout=open(self.out, "w"), stderr=open(tmp / "err.log", "w"),
            env={**os.environ, "STRATA_RAM_DIR": str(tmp)})
        deadline = time.monotonic() + 120
        text = ""
        while "nbd listening" not in text:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("strata did not start: " + (tmp / "err.log").read_text()[-2000:])
            time.sleep(0.05)
            text = self.out.read_text()
        self.port = int(re.search(r"nbd listening on 127\.0\.0\.1:(\d+)", text).group(1))

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def polite_reads(port, seconds, stop):
    """4 KiB reads from 127.0.0.2 for `seconds`: (reads per second, worst ms)."""
    s = nbd_connect(port, "127.0.0.2")
    done, worst = 0, 0.0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds and not stop.is_set():
        t = time.monotonic()
        try:
            s.sendall(request(0, done, (done % 1024) * 4096, 4096))
            header = recv_exact(s, 16)
            assert struct.unpack(">I", header[:4])[0] == 0x67446698
            recv_exact(s, 4096)
        except (OSError, RuntimeError):
            return done / seconds, float("inf")
        worst = max(worst, time.monotonic() - t)
        done += 1
    s.close()
    return done / max(1e-9, time.monotonic() - t0), worst * 1000


def case(binary, extra, kind, connections, seconds):
    with tempfile.TemporaryDirectory(prefix="strata-client-memory-") as tmp:
        daemon = Daemon(binary, Path(tmp), extra)
        try:
            time.sleep(1)
            baseline = rss_anon(daemon.proc.pid)
            socks = []
            stop = threading.Event()
            writers = []
            for _ in range(connections):
                s = nbd_connect(daemon.port)
                socks.append(s)
                if kind == "read":
                    s.sendall(b"".join(request(0, c, c * BIG, BIG) for c in range(4)))
                elif kind == "write":
                    def write(s=s):
                        try:
                            for c in range(4):
                                s.sendall(request(1, c, c * BIG, BIG))
                                s.sendall(PAYLOAD)
                        except OSError:
                            pass
                    t = threading.Thread(target=write, daemon=True)
                    t.start()
                    writers.append(t)
            peak = 0
            result = {}

            def sample():
                nonlocal peak
                while not stop.is_set():
                    peak = max(peak, rss_anon(daemon.proc.pid))
                    time.sleep(0.05)
            sampler = threading.Thread(target=sample)
            sampler.start()
            result["reads_per_s"], result["worst_ms"] = polite_reads(daemon.port, seconds, stop)
            stop.set()
            sampler.join()
            for s in socks:
                s.close()
            return baseline, peak, result
        finally:
            daemon.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", default="target/release/strata")
    parser.add_argument("--baseline")
    parser.add_argument("--client-memory", default="1G")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file (a list of objects)")
    args = parser.parse_args()
    results = []
    binaries = [("new", str(Path(args.binary).resolve()), ["--client-memory", args.client_memory])]
    if args.baseline:
        binaries.insert(0, ("baseline", str(Path(args.baseline).resolve()), []))
    cases = [("read", 1), ("read", 16), ("read", 128), ("write", 1), ("write", 16), ("write", 128), ("idle", 1000)]
    print(f"{'binary':<9} {'case':<6} {'conns':>5} {'base_MiB':>8} {'peak_MiB':>8} {'grown_MiB':>9}"
          f" {'other_reads/s':>13} {'other_worst_ms':>14}")
    for tag, binary, extra in binaries:
        for kind, connections in cases:
            if tag == "baseline" and kind != "idle" and connections > BASELINE_MOST_CONNECTIONS:
                continue
            baseline, peak, result = case(binary, extra, kind, connections, args.seconds)
            results.append({"binary": tag, "kind": kind, "connections": connections,
                            "client_memory": args.client_memory if tag == "new" else "",
                            "baseline_mib": baseline / MIB, "peak_mib": peak / MIB,
                            "grown_mib": (peak - baseline) / MIB, **result})
            print(f"{tag:<9} {kind:<6} {connections:>5} {baseline / MIB:>8.0f} {peak / MIB:>8.0f}"
                  f" {(peak - baseline) / MIB:>9.0f} {result['reads_per_s']:>13.0f} {result['worst_ms']:>14.1f}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
