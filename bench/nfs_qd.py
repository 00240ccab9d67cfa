#!/usr/bin/env python3
"""NFSv3 at QD32: strata's file service against nfs-ganesha (VFS backend) on
an equal directory of the same file system, the QD32 rows, with the
same client for both: bench/nfs_load.c (libnfs's asynchronous API, QD
requests in flight on one connection), compiled here with `cc -O2 -lnfs`.

Rows (file 1 GiB, QD 32 unless told):
  1M sequential write (UNSTABLE, one COMMIT at the end) and read (every 4K
  block's offset stamp checked);
  4K random write UNSTABLE with a COMMIT after every 1 MiB, 4K random
  write FILE_SYNC (libnfs opens with O_SYNC), 4K random read (stamps
  checked), for --seconds each;
  strata's own NBD 4K random write-back rate at the same QD on the same
  daemon's default/vol0 (fio's nbd engine, first 1 GiB written once), run
  in the same rounds as the UNSTABLE row;
  metadata on --files files in the export's root: create (+ close), lookup
  (one LOOKUP each), getattr (one GETATTR each), stat (libnfs's path stat:
  LOOKUP + GETATTR), list (READDIRPLUS of the whole directory, one stream),
  remove.
Before the reads: nfs_load's verify mode writes 64 blocks with a full
pattern (UNSTABLE + COMMIT, then FILE_SYNC) and reads them back, on both.

Servers run side by side; each metadata round starts both afresh (fresh
directories). Each row runs strata then
ganesha (A B A B ...) for --rounds rounds; the table gives medians, the
min-max over rounds, the ratio of the medians and the min-max of the
per-round ratios, and server CPU µs per operation (per MiB for the 1M rows)
from /proc/PID/stat utime+stime. The 1-minute load average is sampled
before every run.

Usage: bench/nfs_qd.py [--binary target/release/strata] [--rounds 3]
       [--seconds 10] [--file-mib 1024] [--files 100000] [--qd 32]
       [--skip-data] [--skip-meta] [--out bench/last-nfs-qd.json]
A temporary directory under /tmp; strata on ephemeral 127.0.0.1 ports,
stopped by PID; ganesha on 127.0.0.1:12049/12048 through
../shared/tools/nfs-ganesha/start.sh (stopped by its stop.sh).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import nfs_peers  # noqa: E402
from nfs_peers import Ganesha, Strata, compile_load, cpu_seconds  # noqa: E402

MIB = 1 << 20


def load_avg():
    return os.getloadavg()[0]


def run_load(exe, server, args, loads, timeout=1800):
    """One nfs_load run (nfs_peers.run_load), the load average noted first."""
    loads.append(load_avg())
    return nfs_peers.run_load(exe, server, args, timeout)


def run_fio_nbd(uri, pid, args, loads):
    loads.append(load_avg())
    cmd = ["fio", "--name=nbd", "--ioengine=nbd", f"--uri={uri}", "--output-format=json"] + args
    cpu = cpu_seconds(pid)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    cpu = cpu_seconds(pid) - cpu
    job = json.loads(out[out.index("{"):])["jobs"][0]
    w = job["write"]
    ops = job["read"]["total_ios"] + w["total_ios"]
    return {"ops_per_s": w["iops"], "mib_per_s": w["bw_bytes"] / MIB, "ops": ops,
            "p50_us": w["clat_ns"]["percentile"].get("50.000000", 0) / 1000,
            "p99_us": w["clat_ns"]["percentile"].get("99.000000", 0) / 1000,
            "cpu_us_per_op": cpu * 1e6 / max(1, ops)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default=str(HERE.parent / "target/release/strata"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--file-mib", type=int, default=1024)
    parser.add_argument("--files", type=int, default=100000)
    parser.add_argument("--qd", type=int, default=32)
    parser.add_argument("--skip-data", action="store_true")
    parser.add_argument("--skip-meta", action="store_true")
    parser.add_argument("--out", default=str(HERE / "last-nfs-qd.json"))
    args = parser.parse_args()

    common = ["-q", str(args.qd), "-s", str(args.file_mib), "-f", "/bench.bin"]
    secs = ["-t", str(args.seconds)]
    gib = f"{args.file_mib / 1024:g} GiB" if args.file_mib >= 1024 else f"{args.file_mib} MiB"
    data_rows = [
        ("seqwrite", f"1M seq write, {gib} (UNSTABLE, COMMIT at the end)", "MiB/s", 1.0,
         ["seqwrite", "-b", str(MIB), "-c", "0"]),
        ("seqread", f"1M seq read, {gib}", "MiB/s", 1.0, ["seqread", "-b", str(MIB), "-V"]),
        ("randwrite_unstable", "4K random write (UNSTABLE, COMMIT every 1 MiB)", "IOPS", 2.0,
         ["randwrite", "-c", str(MIB)] + secs),
        ("randwrite_filesync", "4K random write (FILE_SYNC)", "IOPS", 2.0, ["randwrite", "-S"] + secs),
        ("randread", "4K random read", "IOPS", 2.0, ["randread", "-V"] + secs),
    ]
    n = args.files
    meta_rows = [
        ("create", f"create {n:,} files (CREATE + close)", "ops/s", 2.0, ["create", "-n", str(n)]),
        ("lookup", f"lookup {n:,} names (LOOKUP)", "ops/s", 2.0, ["lookup", "-n", str(n)]),
        ("getattr", f"getattr {n:,} files (GETATTR)", "ops/s", 2.0, ["getattr", "-n", str(n)]),
        ("stat", f"stat {n:,} paths (libnfs: LOOKUP + GETATTR)", "ops/s", 2.0, ["stat", "-n", str(n)]),
        ("list", f"list {n:,} entries (READDIRPLUS, one stream)", "entries/s", 2.0, ["list", "-n", str(n)]),
        ("remove", f"remove {n:,} files (REMOVE)", "ops/s", 2.0, ["remove", "-n", str(n)]),
    ]

    tmp = Path(tempfile.mkdtemp(prefix="strata-nfs-qd-", dir="/tmp"))
    results = {}  # row key -> server name -> [result per round]
    loads = []
    servers = []
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        exe = compile_load(tmp)
        strata = Strata(args.binary, tmp)
        servers.append(strata)
        ganesha = Ganesha(tmp)
        servers.append(ganesha)
        print(f"uptime at start: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}",
              flush=True)

        def record(key, server_name, res):
            results.setdefault(key, {}).setdefault(server_name, []).append(res)
            print(f"  {key} {server_name}: {res['ops_per_s']:,.1f}/s "
                  f"(CPU {res['cpu_us_per_op']:.1f} µs/op, p50 {res['p50_us']:.0f} µs, "
                  f"p99 {res['p99_us']:.0f} µs, load {loads[-1]:.2f})", flush=True)

        if not args.skip_data:
            # Strata's volume: the same 1 GiB written once, so that the NBD
            # random writes overwrite, as the NFS ones do.
            run_fio_nbd(strata.nbd_uri, strata.pid,
                        ["--rw=write", "--bs=1M", "--iodepth=8", f"--size={args.file_mib}m"], [])
            for key, label, unit, target, load_args in data_rows:
                print(f"{label}:", flush=True)
                for r in range(args.rounds):
                    for s in servers:
                        record(key, s.name, run_load(exe, s, load_args + common, loads))
                    if key == "randwrite_unstable":
                        record("nbd_randwrite", "strata", run_fio_nbd(
                            strata.nbd_uri, strata.pid,
                            ["--rw=randwrite", "--bs=4k", f"--iodepth={args.qd}", f"--size={args.file_mib}m",
                             "--time_based", f"--runtime={args.seconds:g}", "--norandommap",
                             "--randrepeat=0"], loads))
                if key == "seqwrite":
                    for s in servers:
                        for extra in ([], ["-S"]):
                            res = run_load(exe, s, ["verify"] + extra + common, [])
                            assert res["checked_blocks"] == 64, res
                            print(f"  verify{' FILE_SYNC' if extra else ' UNSTABLE'} {s.name}: "
                                  f"64 blocks read back equal", flush=True)
        if not args.skip_meta:
            print("metadata:", flush=True)
            for r in range(args.rounds):
                # Fresh servers each round: a directory that held 100,000
                # names stays large on ext4 after they are removed, and
                # ganesha's next round in it ran 2.7x slower.
                for s in reversed(servers):
                    s.stop()
                servers.clear()
                servers.append(Strata(args.binary, tmp, f"-meta{r}"))
                servers.append(Ganesha(tmp, f"-meta{r}"))
                for s in servers:
                    for key, label, unit, target, load_args in meta_rows:
                        record(key, s.name, run_load(exe, s, load_args + ["-q", str(args.qd)], loads))
        print(f"uptime at end: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}",
              flush=True)
    finally:
        for s in reversed(servers):
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        Path(args.out).write_text(json.dumps({"started": started, "args": vars(args), "loads": loads,
                                              "results": results}, indent=1))

    def med(key, name, field="ops_per_s"):
        vals = [r[field] for r in results[key][name]]
        return statistics.median(vals), min(vals), max(vals)

    print(f"\nQD {args.qd}, {args.rounds} rounds, medians (min-max); 1-min load average during the runs: "
          f"median {statistics.median(loads):.2f}, {min(loads):.2f}-{max(loads):.2f}\n")
    print("| row | strata | ganesha | strata / ganesha (per round) | server CPU µs/op strata / ganesha "
          "| p50 / p99 µs strata; ganesha | target | met |")
    print("|---|---|---|---|---|---|---|---|")
    rows = (data_rows if not args.skip_data else []) + (meta_rows if not args.skip_meta else [])
    for key, label, unit, target, _ in rows:
        sm, slo, shi = med(key, "strata")
        gm, glo, ghi = med(key, "ganesha")
        ratios = [a["ops_per_s"] / b["ops_per_s"] for a, b in zip(results[key]["strata"], results[key]["ganesha"])]
        sc, gc = med(key, "strata", "cpu_us_per_op")[0], med(key, "ganesha", "cpu_us_per_op")[0]
        lat = (f"{med(key, 'strata', 'p50_us')[0]:,.0f} / {med(key, 'strata', 'p99_us')[0]:,.0f}; "
               f"{med(key, 'ganesha', 'p50_us')[0]:,.0f} / {med(key, 'ganesha', 'p99_us')[0]:,.0f}")
        ratio = sm / gm
        print(f"| {label} | {sm:,.0f} {unit} ({slo:,.0f}-{shi:,.0f}) | {gm:,.0f} {unit} ({glo:,.0f}-{ghi:,.0f}) "
              f"| {ratio:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {sc:,.1f} / {gc:,.1f} | {lat} "
              f"| ≥ {target:g}x | {'yes' if ratio >= target else 'no'} |")
    if not args.skip_data:
        nm, nlo, nhi = med("nbd_randwrite", "strata")
        um = med("randwrite_unstable", "strata")[0]
        per = [a["ops_per_s"] / b["ops_per_s"]
               for a, b in zip(results["randwrite_unstable"]["strata"], results["nbd_randwrite"]["strata"])]
        nc = med("nbd_randwrite", "strata", "cpu_us_per_op")[0]
        lat = (f"{med('nbd_randwrite', 'strata', 'p50_us')[0]:,.0f} / "
               f"{med('nbd_randwrite', 'strata', 'p99_us')[0]:,.0f}")
        print(f"| strata NBD 4K random write (fio nbd, write-back), same rounds | {nm:,.0f} IOPS ({nlo:,.0f}-{nhi:,.0f}) "
              f"| — | NFS UNSTABLE / NBD {um / nm:.2f}x ({min(per):.2f}-{max(per):.2f}) | {nc:,.1f} / — | {lat} "
              f"| ≥ 0.80x | {'yes' if um / nm >= 0.8 else 'no'} |")


if __name__ == "__main__":
    sys.exit(main())
