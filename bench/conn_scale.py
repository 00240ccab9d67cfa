#!/usr/bin/env python3
"""What NBD connections cost the daemon: RSS, threads and wake-ups of
`strata serve` with 1, 100 and 1,000 idle NBD connections (each past the
handshake, in transmission) and with 1 and then all 100 of 100 open ones
active (each doing 4 KiB random reads in a loop, one at a time; RSS per
connection is then per open connection, and includes the device file's
pages the reads mapped in). Wake-ups are the context
switches of all the daemon's threads (voluntary and not, from
/proc/PID/task/*/status): per second while idle, per read while active.
Not in CI. Usage:

    cargo build --release && python3 bench/conn_scale.py [--binary target/release/strata] [--json PATH]

--json also writes the table as JSON: a list of {state, rss_kib, threads,
rss_per_conn_kib, threads_per_conn, wakeups, wakeups_unit, reads_per_s}.

Connections come from 127.0.0.x (100 per address) so the per-client cap
(128 by default) is not what is measured; the listener cap is raised to
2048 for the run.
"""

import argparse
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

NBD_MAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
OPT_GO = 7
REQUEST_MAGIC = 0x25609513
CMD_READ = 0


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def nbd_connect(address, source):
    host, port = address
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.connect((host, port))
    greeting = recv_exact(sock, 18)
    assert struct.unpack(">QQ", greeting[:16]) == (NBD_MAGIC, IHAVEOPT), greeting
    sock.sendall(struct.pack(">I", 3))  # fixed newstyle, no zeroes
    name = b"default/vol0"
    data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    sock.sendall(struct.pack(">QII", IHAVEOPT, OPT_GO, len(data)) + data)
    while True:
        _magic, _option, reply, length = struct.unpack(">QIII", recv_exact(sock, 20))
        recv_exact(sock, length)
        if reply == 1:  # ACK: in transmission
            return sock
        if reply & 0x80000000:
            raise ConnectionError(f"NBD_OPT_GO refused: {reply:#x}")


def status(pid):
    text = open(f"/proc/{pid}/status").read()
    rss = int(re.search(r"VmRSS:\s+(\d+)", text).group(1))
    threads = int(re.search(r"Threads:\s+(\d+)", text).group(1))
    return rss, threads


def switches(pid):
    """Context switches of every thread of `pid` so far."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            text = open(f"/proc/{pid}/task/{task}/status").read()
        except FileNotFoundError:
            continue
        total += sum(int(n) for n in re.findall(r"ctxt_switches:\s+(\d+)", text))
    return total


def reader(sock, stop, counter):
    handle = 0
    while not stop.is_set():
        handle += 1
        offset = random.randrange(0, (1 << 30) // 4096) * 4096
        sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_READ, handle, offset, 4096))
        header = recv_exact(sock, 16)
        recv_exact(sock, 4096)
        counter[0] += 1
        del header


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default="target/release/strata")
    parser.add_argument("--json", default="", help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    data_dir = tempfile.mkdtemp(prefix="strata-conn-scale-")
    env = dict(os.environ, STRATA_RAM_DIR=data_dir, STRATA_LOG="warn")
    server = subprocess.Popen(
        [args.binary, "serve", "--nfs", "127.0.0.1:0", "--data-dir", data_dir, "--nbd", "127.0.0.1:0", "--iscsi", "127.0.0.1:0",
         "--api", "127.0.0.1:0", "--max-connections", "2048"],
        stdout=subprocess.PIPE, env=env, text=True)
    address = None
    for line in server.stdout:
        m = re.match(r"strata: nbd listening on 127.0.0.1:(\d+)", line)
        if m:
            address = ("127.0.0.1", int(m.group(1)))
        if line.startswith("strata: iscsi listening"):
            break
    threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
    pid = server.pid
    time.sleep(0.5)
    base_rss, base_threads = status(pid)
    print(f"{'state':<28} {'RSS MiB':>8} {'threads':>8} {'RSS/conn KiB':>13} {'threads/conn':>13} {'wake-ups':>16}")

    def idle_wakeups():
        before = switches(pid)
        time.sleep(2.0)
        return (switches(pid) - before) / 2

    def record(state, rss, threads, per_conn, wakeups, unit, reads_per_s=None):
        rows.append({"state": state, "rss_kib": rss, "threads": threads,
                     "rss_per_conn_kib": None if per_conn is None else (rss - base_rss) / per_conn,
                     "threads_per_conn": None if per_conn is None else (threads - base_threads) / per_conn,
                     "wakeups": wakeups, "wakeups_unit": unit, "reads_per_s": reads_per_s})

    wakeups = idle_wakeups()
    record("no connection", base_rss, base_threads, None, wakeups, "per s")
    print(f"{'no connection':<28} {base_rss / 1024:8.1f} {base_threads:8d} {'':>13} {'':>13} {f'{wakeups:10.0f} per s':>16}")
    sockets = []
    try:
        for target in (1, 100, 1000):
            while len(sockets) < target:
                source = f"127.0.0.{2 + len(sockets) // 100}"
                sockets.append(nbd_connect(address, source))
            time.sleep(1.0)
            rss, threads = status(pid)
            wakeups = idle_wakeups()
            record(f"{target} idle", rss, threads, target, wakeups, "per s")
            print(f"{f'{target} idle':<28} {rss / 1024:8.1f} {threads:8d} "
                  f"{(rss - base_rss) / target:13.0f} {(threads - base_threads) / target:13.2f} "
                  f"{f'{wakeups:10.0f} per s':>16}")
        for sock in sockets[100:]:
            sock.close()
        del sockets[100:]
        time.sleep(1.0)
        for active in (1, 100):
            stop = threading.Event()
            counter = [0]
            workers = [threading.Thread(target=reader, args=(s, stop, counter), daemon=True)
                       for s in sockets[:active]]
            for worker in workers:
                worker.start()
            time.sleep(1.0)
            before, started = switches(pid), counter[0]
            time.sleep(5.0)
            rss, threads = status(pid)
            done = counter[0] - started
            woken = switches(pid) - before
            stop.set()
            for worker in workers:
                worker.join()
            label = f"100 open, {active} reading"
            record(label, rss, threads, 100, woken / max(done, 1), "per read", done / 5)
            print(f"{label:<28} {rss / 1024:8.1f} {threads:8d} "
                  f"{(rss - base_rss) / 100:13.0f} {(threads - base_threads) / 100:13.2f} "
                  f"{woken / max(done, 1):8.2f} per read   ({done / 5:.0f} reads/s)")
    finally:
        for sock in sockets:
            sock.close()
        server.terminate()
        server.wait(timeout=30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
