#!/usr/bin/env python3
"""One NFSv3 directory of --files entries (1,000,000 by default) on strata's
file service, and optionally on nfs-ganesha (VFS backend, a directory of the
same file system), with bench/nfs_load.c (libnfs async API, QD requests in
flight on one connection), compiled here with `cc -O2 -lnfs`.

Sequence, all in the export's root, QD --qd:
  create    --files files in chunks of --chunk (names cK0000000.., one
            nfs_load run per chunk, so the rate is seen as the directory
            grows);
  list      READDIRPLUS of the whole directory (one stream);
  lookup, getattr, stat of every name, chunk by chunk;
  restart   (strata only) SIGINT, start again on the same data directory:
            seconds from exec to "iscsi listening", then list and lookup
            again (cold);
  remove    every name, chunk by chunk (rate as the directory shrinks).
With --ganesha-files G (a multiple of --chunk, 0 = no ganesha) both servers
run side by side and every chunk alternates strata then ganesha; ganesha
does only its first G / --chunk chunks.

Recorded per run: nfs_load's RESULT (ops/s, p50/p99), server CPU µs/op
(utime+stime from /proc/PID/stat over the run / ops), the 1-minute load
average before the run; strata's VmRSS at start, after the creates, after
the reads, after the restart, after the removes (VmRSS, RssAnon,
RssFile). Every record is appended
to --out (JSON lines) as it is made, and a summary printed at the end.

Usage: bench/nfs_bigdir.py [--binary target/release/strata] [--files 1000000]
       [--chunk 100000] [--qd 32] [--ganesha-files 0] [--no-restart]
       [--out bench/last-nfs-bigdir.jsonl]
A temporary directory under /tmp (removed at the end); strata on ephemeral
127.0.0.1 ports, stopped by PID (SIGINT); ganesha on 127.0.0.1:12049/12048
through ../shared/tools/nfs-ganesha/start.sh (stopped by its stop.sh).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from nfs_peers import Ganesha, Strata, compile_load, run_load  # noqa: E402


def rss_kib(pid):
    """VmRSS, and its parts RssAnon (heap: the namespace) and RssFile
    (mapped files: strata's RAM tier file in STRATA_RAM_DIR, the binary),
    KiB."""
    rss = {}
    for line in open(f"/proc/{pid}/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile"):
            rss[key] = int(line.split()[1])
    return rss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default=str(HERE.parent / "target/release/strata"))
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=100_000)
    parser.add_argument("--qd", type=int, default=32)
    parser.add_argument("--ganesha-files", type=int, default=0)
    parser.add_argument("--no-restart", action="store_true")
    parser.add_argument("--out", default=str(HERE / "last-nfs-bigdir.jsonl"))
    args = parser.parse_args()
    assert args.files % args.chunk == 0 and args.ganesha_files % args.chunk == 0
    chunks = args.files // args.chunk
    gchunks = min(chunks, args.ganesha_files // args.chunk)

    out = open(args.out, "w")
    summary = []

    def emit(rec):
        rec["time"] = time.strftime("%H:%M:%S")
        out.write(json.dumps(rec) + "\n")
        out.flush()
        summary.append(rec)
        if "ops_per_s" in rec:
            print(f"{rec['time']} {rec['server']:7} {rec['step']:8} {rec.get('chunk', '-')!s:>2} "
                  f"{rec['ops_per_s']:>10,.0f}/s  {rec['seconds']:7.1f} s  CPU {rec['cpu_us_per_op']:6.1f} µs/op  "
                  f"p50 {rec['p50_us']:>6,.0f} p99 {rec['p99_us']:>7,.0f} µs  load {rec['load1']:.2f}", flush=True)
        else:
            print(f"{rec['time']} {json.dumps(rec)}", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="strata-nfs-bigdir-", dir="/tmp"))
    exe = compile_load(tmp)
    servers = []
    try:
        strata = Strata(args.binary, tmp)
        servers.append(strata)
        emit({"server": "strata", "step": "start", "start_seconds": strata.start_seconds,
              "rss_kib": rss_kib(strata.pid), "entries": 0})
        if gchunks:
            servers.append(Ganesha(tmp))
            emit({"server": "ganesha", "step": "start", "rss_kib": rss_kib(servers[1].pid), "entries": 0})
        emit({"step": "uptime", "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()})

        def run(server, step, load_args, chunk=None):
            res = {"server": server.name, "step": step, "chunk": chunk, "load1": os.getloadavg()[0]}
            try:
                res.update(run_load(exe, server, load_args + ["-q", str(args.qd)], timeout=7200))
            except RuntimeError as e:
                emit({"server": server.name, "step": step, "chunk": chunk, "error": str(e)})
                raise
            res["rss_kib"] = rss_kib(server.pid)
            emit(res)

        def per_chunk(step, mode):
            for c in range(chunks):
                for s in servers:
                    if s.name == "ganesha" and c >= gchunks:
                        continue
                    run(s, step, [mode, "-n", str(args.chunk), "-p", f"c{c}"], c)

        def listing(step):
            for s in servers:
                n = args.files if s.name == "strata" else gchunks * args.chunk
                run(s, step, ["list", "-n", str(n)])

        per_chunk("create", "create")
        listing("list")
        per_chunk("lookup", "lookup")
        per_chunk("getattr", "getattr")
        per_chunk("stat", "stat")
        if not args.no_restart:
            rss_before = rss_kib(strata.pid)
            stop_s = strata.stop()
            strata.start()
            emit({"server": "strata", "step": "restart", "stop_seconds": stop_s,
                  "start_seconds": strata.start_seconds, "rss_kib_before": rss_before,
                  "rss_kib": rss_kib(strata.pid), "entries": args.files})
            run(strata, "list-cold", ["list", "-n", str(args.files)])
            emit({"server": "strata", "step": "rss-after-list", "rss_kib": rss_kib(strata.pid)})
            run(strata, "lookup-cold", ["lookup", "-n", str(args.chunk), "-p", "c0"], 0)
        per_chunk("remove", "remove")
        for s in servers:
            emit({"server": s.name, "step": "end", "rss_kib": rss_kib(s.pid), "entries": 0})
        emit({"step": "uptime", "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()})
    finally:
        for s in reversed(servers):
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        out.close()

    # Summary: per step and server, the first and last chunk's rate, the
    # total ops over total seconds, and CPU µs/op over all chunks.
    print("\n| step | server | runs | ops/s overall | first chunk | last chunk | last / first | CPU µs/op "
          "| p50 / p99 µs (median chunk) | load1 range |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    steps = []
    for r in summary:
        if "ops_per_s" in r and (r["step"], r["server"]) not in steps:
            steps.append((r["step"], r["server"]))
    for step, name in steps:
        rs = [r for r in summary if r.get("step") == step and r.get("server") == name and "ops_per_s" in r]
        ops = sum(r["ops"] for r in rs)
        secs = sum(r["seconds"] for r in rs)
        cpu = sum(r["cpu_us_per_op"] * r["ops"] for r in rs) / ops
        mid = sorted(rs, key=lambda r: r["ops_per_s"])[len(rs) // 2]
        loads = [r["load1"] for r in rs]
        print(f"| {step} | {name} | {len(rs)} | {ops / secs:,.0f} | {rs[0]['ops_per_s']:,.0f} | "
              f"{rs[-1]['ops_per_s']:,.0f} | {rs[-1]['ops_per_s'] / rs[0]['ops_per_s']:.2f} | {cpu:.1f} | "
              f"{mid['p50_us']:,.0f} / {mid['p99_us']:,.0f} | {min(loads):.1f}-{max(loads):.1f} |")
    print("\nRSS, KiB (VmRSS = RssAnon + RssFile):")
    for r in summary:
        last_create = r.get("step") == "create" and r.get("chunk") == chunks - 1
        if "rss_kib" in r and (r.get("step") in ("start", "restart", "rss-after-list", "end") or last_create):
            extra = f", start {r['start_seconds']:.2f} s" if "start_seconds" in r else ""
            print(f"  {r['server']} {r['step']}{' (all created)' if last_create else ''}: {r['rss_kib']}{extra}")


if __name__ == "__main__":
    sys.exit(main())
