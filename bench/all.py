#!/usr/bin/env python3
"""Runs strata's benchmarks and writes BENCHMARKS.md from their results.

    python3 bench/all.py run FAMILY...   run these families (or `all`), rewrite
                                         bench/results/FAMILY.csv, then render
    python3 bench/all.py render          write BENCHMARKS.md from the template
                                         bench/BENCHMARKS.md.in and the CSVs
    python3 bench/all.py check           exit 1 if BENCHMARKS.md is not what
                                         render writes (see "check" below)
    python3 bench/all.py list            the families, their producers and
                                         how long each takes to run
    python3 bench/all.py try FAMILY...   run them with the shortest settings
                                         (a minute or two each) to see that
                                         every step works; prints the rows,
                                         writes nothing

Python 3.11, standard library only. `run` uses target/release/strata (build
it first: `cargo build --release`; STRATA_BIN=PATH runs another binary, and
STRATA_COMMIT=HASH names the commit it was built from), the
peers' packages (`apt-get install -y fio nbdkit qemu-utils libnbd-bin tgt
libiscsi-bin gnutls-bin bc`, nfs-ganesha through
../shared/tools/nfs-ganesha) and a quiet machine: every row of a family is
measured in one run, and only ratios within one run mean anything.

Families and what one `run` of each takes on a 2-core machine (`run all`,
every family but tiering and migrator planning: about 40 minutes; tiering
alone: about 40 more; migrator planning builds the lib's test binary and
needs ~8 GiB of RAM at its largest size):

FAMILIES_HELP

Each family's rows come from the existing scripts in bench/ (its
"producers", called with their machine-readable output: `--json FILE`,
`--out FILE`, or BENCH_CSV=FILE for the shell scripts; tls is measured
here, with nbdcopy, so this file is the tls family's producer and a change
to it marks the tls rows). The command in each row is what reproduces it.

bench/results/FAMILY.csv: one line a row, columns

    row, command, date, cpu, commit, strata, peer_name, peer, unit, ratio,
    strata_cpu_us, peer_cpu_us, strata_p99_us, peer_p99_us, note, load

`date` (UTC day), `cpu` (the model in /proc/cpuinfo), `commit` (HEAD when
the run began, abbreviated) and `load` (the lowest and highest 1-minute
load average sampled while the family ran; empty where not recorded) say
where a figure comes from; `ratio` is
strata / peer (for a unit marked "lower is better", below 1 is strata
ahead); the CPU columns are the server process's utime+stime over the run
divided by the operations completed; an empty cell is a figure that was not
measured. A CSV is only ever written whole by `run` (or by hand when
figures are transcribed from an earlier run, with that run's date, CPU and
commit).

"Not rerun since COMMIT". At render time each row's commit is compared with
HEAD: if `git diff --quiet COMMIT HEAD -- src Cargo.toml Cargo.lock
<the family's producers>` reports a difference (or the commit is not in
this clone), the row's run cell ends with " — **not rerun since
`COMMIT`**". The note thus depends only on the CSV and on git's history,
never on the working tree, so two renders at the same HEAD are identical.

check. The note above changes whenever a later commit touches src, which
would make any committed BENCHMARKS.md go stale with every code change. So
`check` renders with the notes left out and compares with BENCHMARKS.md
with its notes removed (the exact text " — **not rerun since `HEX`**"):
everything else — the template's prose, every table's figures, commands,
dates and commits — must match byte for byte. It needs no git, and it
fails when the doc was edited by hand, when a CSV changed without a render,
or when the template changed without a render. tests/benchmarks_doc.rs
runs it in CI.
"""

import csv
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
TEMPLATE = BENCH / "BENCHMARKS.md.in"
DOC = ROOT / "BENCHMARKS.md"
COLUMNS = ["row", "command", "date", "cpu", "commit", "strata", "peer_name", "peer", "unit", "ratio",
           "strata_cpu_us", "peer_cpu_us", "strata_p99_us", "peer_p99_us", "note", "load"]
CODE = ["src", "Cargo.toml", "Cargo.lock"]
NOTE = " — **not rerun since `{}`**"
NOTE_RE = re.compile(r" — \*\*not rerun since `[0-9a-f]+`\*\*")
LOWER = "lower is better"


def number(value):
    """value as a float, or None when it is not one (a range such as
    "146–206" transcribed from a run that gave only that)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def num(value, digits=None):
    """A figure as the CSV holds it: '' for none, else a short decimal."""
    if value is None or value == "":
        return ""
    if number(value) is None:
        return str(value)
    value = float(value)
    if digits is None:
        digits = 0 if abs(value) >= 1000 else 1 if abs(value) >= 10 else 2 if abs(value) >= 1 else 3
    text = f"{value:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def row(name, command, strata, unit, peer_name="", peer=None, strata_cpu=None, peer_cpu=None,
        strata_p99=None, peer_p99=None, note=""):
    ratio = ""
    if number(strata) is not None and number(peer):
        value = float(strata) / float(peer)
        ratio = f"{value:.0f}" if value >= 100 else f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"
    return {"row": name, "command": command, "strata": num(strata), "peer_name": peer_name if peer is not None else "",
            "peer": num(peer), "unit": unit, "ratio": ratio, "strata_cpu_us": num(strata_cpu),
            "peer_cpu_us": num(peer_cpu), "strata_p99_us": num(strata_p99), "peer_p99_us": num(peer_p99),
            "note": note}


def sh(command, env=None, cwd=ROOT, timeout=3600):
    """Runs a producer; its output goes to our stderr (progress), failure raises."""
    print(f"+ {command if isinstance(command, str) else ' '.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, shell=isinstance(command, str), cwd=cwd, check=True, timeout=timeout,
                   env=dict(os.environ, **(env or {})), stdout=sys.stderr)


def read_bench_csv(path):
    return [line.split(",") for line in Path(path).read_text().splitlines() if line.strip()] if Path(path).exists() else []


# --- producers: each returns the family's rows --------------------------------------------------

def nbd(ctx):
    runtime, repeat = ctx.pick((5, 2), (1, 1))
    size = ctx.pick([], ["--size-mib", "64"])
    out = ctx.tmp / "nbd.json"
    shown = f'python3 bench/nbd_bench.py --only "strata,nbdkit file,qemu-nbd" --runtime {runtime} --repeat {repeat}'
    sh(["python3", "bench/nbd_bench.py", "--only", "strata,nbdkit file,qemu-nbd", "--runtime", str(runtime),
        "--repeat", str(repeat), "--json", str(out), *size], env={"STRATA_BIN": ctx.binary})
    results = json.loads(out.read_text())
    rows = []
    for workload, metric, unit in [("4K randread QD32", "iops", "IOPS"), ("4K randwrite QD32", "iops", "IOPS"),
                                   ("1M seqread QD4", "mib_s", "MiB/s"), ("1M seqwrite QD4", "mib_s", "MiB/s"),
                                   ("4K randread QD1", "p50_us", f"µs p50 ({LOWER})")]:
        cells = results[workload]
        s = cells["strata"]
        for peer in ("nbdkit file", "qemu-nbd"):
            p = cells[peer]
            rows.append(row(f"{workload}, {ctx.pick('1 GiB', '64 MiB')}", shown, s[metric], unit, peer, p[metric], s["cpu_us_per_op"],
                            p["cpu_us_per_op"], s["p99_us"], p["p99_us"]))
    return rows


def iscsi(ctx):
    runtime, count = ctx.pick((10, 200000), (1, 2000))
    size = ctx.pick([], ["--size-mib", "64"])
    out = ctx.tmp / "iscsi.json"
    shown = f"python3 bench/iscsi_bench.py --only strata,tgt-file --runtime {runtime} --count {count}"
    sh(["python3", "bench/iscsi_bench.py", "--only", "strata,tgt-file", "--runtime", str(runtime), "--count",
        str(count), "--json", str(out), *size], env={"STRATA_BIN": ctx.binary})
    results = json.loads(out.read_text())
    rows = []
    for workload, cells in results.items():
        s, p = cells["strata"], cells["tgt-file"]
        rows.append(row(f"{workload}, {ctx.pick('1 GiB', '64 MiB')}", shown, s["iops"], "IOPS", "tgt (file)", p["iops"], s["cpu_us_per_op"],
                        p["cpu_us_per_op"]))
    return rows


NFS_ROWS = [
    ("seqwrite", "1M sequential write, {size} file (UNSTABLE, COMMIT at the end)", "MiB/s"),
    ("seqread", "1M sequential read, {size} file", "MiB/s"),
    ("randwrite_unstable", "4K random write, UNSTABLE + COMMIT every 1 MiB", "IOPS"),
    ("randwrite_filesync", "4K random write, FILE_SYNC", "IOPS"),
    ("randread", "4K random read", "IOPS"),
    ("create", "create (CREATE + close), {files} files", "ops/s"),
    ("lookup", "lookup (LOOKUP), {files} names", "ops/s"),
    ("getattr", "getattr (GETATTR), {files} files", "ops/s"),
    ("stat", "stat (LOOKUP + GETATTR), {files} paths", "ops/s"),
    ("list", "list (READDIRPLUS, one stream), {files} entries", "entries/s"),
    ("remove", "remove (REMOVE), {files} files", "ops/s"),
]


def nfs(ctx):
    rounds, seconds, files = ctx.pick((2, 5, 20000), (1, 1, 200))
    size = ctx.pick([], ["--file-mib", "64"])
    out = ctx.tmp / "nfs.json"
    shown = f"python3 bench/nfs_qd.py --rounds {rounds} --seconds {seconds} --files {files}"
    sh(["python3", "bench/nfs_qd.py", "--binary", ctx.binary, "--rounds", str(rounds), "--seconds", str(seconds),
        "--files", str(files), "--out", str(out), *size])
    results = json.loads(out.read_text())["results"]

    def med(key, server, field):
        return statistics.median(r[field] for r in results[key][server])

    rows = []
    for key, label, unit in NFS_ROWS:
        if key not in results:
            continue
        cpu_note = "server CPU per MiB" if unit == "MiB/s" else ""
        rows.append(row(f"{label.format(files=f'{files:,}', size=ctx.pick('1 GiB', '64 MiB'))}, QD32", shown, med(key, "strata", "ops_per_s"), unit,
                        "nfs-ganesha", med(key, "ganesha", "ops_per_s"), med(key, "strata", "cpu_us_per_op"),
                        med(key, "ganesha", "cpu_us_per_op"), med(key, "strata", "p99_us"),
                        med(key, "ganesha", "p99_us"), cpu_note))
    if "nbd_randwrite" in results:
        rows.append(row("4K random write QD32: NFS UNSTABLE + COMMIT every 1 MiB against NBD write-back, same daemon",
                        shown, med("randwrite_unstable", "strata", "ops_per_s"), "IOPS", "strata NBD (fio)",
                        med("nbd_randwrite", "strata", "ops_per_s"), med("randwrite_unstable", "strata", "cpu_us_per_op"),
                        med("nbd_randwrite", "strata", "cpu_us_per_op"), med("randwrite_unstable", "strata", "p99_us"),
                        med("nbd_randwrite", "strata", "p99_us")))
    return rows


def clients(ctx):
    seconds, runtime, count = ctx.pick((5, 5, 100000), (1, 1, 2000))
    matrix = ctx.pick("1x32,16x4,64x2,128x1,256x1", "1x32,16x4")
    rows = []
    for volumes in (1, 16):
        out = ctx.tmp / f"nbd-{volumes}.csv"
        env = {"BENCH_CSV": str(out), "VOLUMES": str(volumes), **ctx.pick({}, {"ROWS": "1x32 16x4"})}
        prefix = "" if volumes == 1 else f"VOLUMES={volumes} "
        shown = f"{prefix}bash bench/many_clients.sh target/release/strata {seconds}"
        sh(["bash", "bench/many_clients.sh", ctx.binary, str(seconds)], env=env)
        got = {(r[0], r[1], r[2]): r for r in read_bench_csv(out)}
        where = "one 1 GiB volume" if volumes == 1 else f"{volumes} volumes of {1024 // volumes} MiB"
        for rw in ("randread", "randwrite"):
            for jobs in ("1x32", "16x4", "64x2", "128x1", "256x1"):
                s, p = got.get(("strata", rw, jobs)), got.get(("nbdkit", rw, jobs))
                if not s or not p:
                    continue
                rows.append(row(f"NBD 4K {rw}, {where}, {jobs} (connections x QD)", shown, s[5], "IOPS",
                                "nbdkit file", p[5], s[8], p[8], s[6], p[6],
                                f"fairness (slowest job's p99 / median job's) {s[7]} / {p[7]}"))
    for volumes in (1, 16):
        out = ctx.tmp / f"iscsi-{volumes}.json"
        extra = [] if volumes == 1 else ["--volumes", str(volumes)]
        shown = (f"python3 bench/iscsi_bench.py --matrix {matrix} --runtime {runtime} --count {count} "
                 f"--only strata,tgt-file" + (f" --volumes {volumes}" if volumes > 1 else ""))
        sh(["python3", "bench/iscsi_bench.py", "--matrix", matrix, "--runtime", str(runtime), "--count", str(count),
            "--only", "strata,tgt-file", "--json", str(out), *extra], env={"STRATA_BIN": ctx.binary})
        results = json.loads(out.read_text())
        where = "one 1 GiB volume" if volumes == 1 else f"{volumes} volumes of {1024 // volumes} MiB"
        for workload, cells in results.items():
            what, jobs = workload.rsplit(" ", 1)
            s, p = cells["strata"], cells["tgt-file"]
            rows.append(row(f"iSCSI {what}, {where}, {jobs} (sessions x QD)", shown, s["iops"], "IOPS", "tgt (file)",
                            p["iops"], s["cpu_us_per_op"], p["cpu_us_per_op"]))
    return rows


def sync(ctx):
    seconds, which = ctx.pick((10, "fresh filled 16vols 256"), (1, "fresh 256"))
    out = ctx.tmp / "sync.csv"
    shown = f'ROWS="{which}" bash bench/sync_scale.sh target/release/strata {seconds}'
    sh(["bash", "bench/sync_scale.sh", ctx.binary, str(seconds)], env={"BENCH_CSV": str(out), "ROWS": which})
    got = {r[0]: r for r in read_bench_csv(out)}
    rows = []
    for many, one, name in [("fresh-qd32", "fresh-qd1", "fresh 1 GiB volume (writes allocate), 32 connections x QD1"),
                            ("filled-qd32", "filled-qd1", "filled 1 GiB volume, 32 connections x QD1"),
                            ("16-vols-qd4", "one-of-16-qd1", "16 filled volumes of 256 MiB, 4 connections x QD1 each")]:
        if many in got and one in got:
            m, o = got[many], got[one]
            rows.append(row(f"sync=always 4K random writes: {name}", shown, m[1], "writes/s",
                            "one connection, QD1" if one != "one-of-16-qd1" else "one of the volumes alone, QD1",
                            o[1], m[3], o[3], m[2], o[2],
                            f"log-room waits {m[4]} ({m[5]} writer-s); jobs with errors {m[6]}"))
    if "256-connections" in got:
        m = got["256-connections"]
        rows.append(row("sync=always 4K random writes: 256 connections x QD1, one fresh 1 GiB volume", shown, m[1],
                        "writes/s", strata_cpu=m[3], strata_p99=m[2],
                        note=f"log-room waits {m[4]} ({m[5]} writer-s); jobs with errors {m[6]}"))
    return rows


def snapshots(ctx):
    seconds = ctx.pick(10, 2)
    out = ctx.tmp / "snap.csv"
    shown = f"bash bench/snapshot_load.sh target/release/strata {seconds}"
    sh(["bash", "bench/snapshot_load.sh", ctx.binary, str(seconds)], env={"BENCH_CSV": str(out)})
    got = read_bench_csv(out)
    phases = {r[1]: r for r in got if r[0] == "phase"}
    other = {r[0]: r for r in got if r[0] != "phase"}
    base = phases.get("no snapshot")
    rows = []
    for label, name in [("100 snapshots taken during the run", "while 100 snapshots are taken, one every 200 ms"),
                        ("steady state with 100 snapshots", "with 100 snapshots, after them")]:
        s = phases.get(label)
        if s and base:
            rows.append(row(f"4K random write QD32, filled 1 GiB volume, {name}", shown, s[2], "IOPS", "no snapshot",
                            base[2], s[3], base[3], s[5], base[5], f"clat max {s[7]} / {base[7]} µs"))
    if "create_cli_ms" in other:
        c = other["create_cli_ms"]
        rows.append(row("snapshot create at the CLI under that write load", shown, c[1], f"ms p50 ({LOWER})",
                        note=f"p99 {c[2]} ms, max {c[3]} ms (100 creates)"))
    if "delete_4g_ms" in other:
        rows.append(row("snapshot delete of 4 GiB only it holds, at the CLI", shown, other["delete_4g_ms"][1],
                        f"ms ({LOWER})", note="its space is freed in the background"))
    if "freed_ms" in other:
        rows.append(row("the same 4 GiB freed, from the delete's start", shown, other["freed_ms"][1], f"ms ({LOWER})"))
    if "read_p99_us" in other:
        r = other["read_p99_us"]
        rows.append(row("4K random read QD1 on another volume while those 4 GiB are freed", shown, r[2],
                        f"µs p99 ({LOWER})", "the same reads, idle", r[1]))
    return rows


def tiering_rows(runs, command, note=""):
    """The tiering rows from tiering.sh's per-configuration CSVs: runs is
    {"randread"|"hotzone": {"ideal"|"on"|"off": [row dicts]}}, command
    {"randread"|"hotzone": the command shown}. A window is the 10 s
    segments that end after START seconds and before the run's half, where
    the 4 GiB scan starts."""

    def window(rs, start=0):
        half = rs[-1]["seconds"] / 2
        return [r for r in rs if start < r["seconds"] < half]

    def med(rs, key):
        return statistics.median(r[key] for r in rs) if rs else None

    rows = []
    zipf, shown = runs.get("randread", {}), command.get("randread", "")
    if "on" in zipf and "off" in zipf:
        on, off = window(zipf["on"]), window(zipf["off"])
        rows.append(row("zipf 1.1 random reads QD16, median of the segments before the scan: migration on against off",
                        shown, med(on, "iops"), "IOPS", "migration off", med(off, "iops"),
                        strata_p99=med(on, "p99_us"), peer_p99=med(off, "p99_us"), note=note))
    if "on" in zipf and "ideal" in zipf:
        on, ideal = window(zipf["on"]), window(zipf["ideal"])
        rows.append(row("zipf 1.1 random reads QD16, the same against everything on one fast device", shown,
                        med(on, "iops"), "IOPS", "ideal (one 9 GiB fast device)", med(ideal, "iops"),
                        strata_p99=med(on, "p99_us"), peer_p99=med(ideal, "p99_us"), note=note))
    hot, shown = runs.get("hotzone", {}), command.get("hotzone", "")
    if "on" in hot and "ideal" in hot:
        on, ideal = window(hot["on"], 150), window(hot["ideal"])
        rows.append(row("a 512 MiB hot region on the HDD tier, uniform 4K reads QD16, median of the segments from "
                        "160 s to the scan (ideal: all before the scan)", shown, med(on, "iops"), "IOPS",
                        "ideal (one 9 GiB fast device)", med(ideal, "iops"), strata_p99=med(on, "p99_us"),
                        peer_p99=med(ideal, "p99_us"), note=note))
    if "on" in hot and "off" in hot:
        on, off = window(hot["on"], 150), window(hot["off"])
        rows.append(row("the same hot region, migration on (from 160 s) against off (all before the scan)", shown,
                        med(on, "iops"), "IOPS", "migration off", med(off, "iops"), strata_p99=med(on, "p99_us"),
                        peer_p99=med(off, "p99_us"), note=note))
    if "on" in hot and "ideal" in hot:
        target = 0.9 * med(window(hot["ideal"]), "iops")
        reach = next((r["seconds"] for r in hot["on"] if r["iops"] >= target), None)
        if reach is not None:
            rows.append(row("the same hot region, migration on: the first 10 s segment at 90 % of the ideal's IOPS",
                            shown, reach, f"s after the fill ({LOWER})", note=note))
        scan = [i for i, r in enumerate(hot["on"]) if r["scan"]]
        if scan:
            before = hot["on"][max(0, scan[0] - 6):scan[0]]
            after = hot["on"][scan[-1] + 1:scan[-1] + 7]
            if after:
                rows.append(row("the same hot region, migration on: the minute after the 4 GiB sequential read",
                                shown, med(after, "iops"), "IOPS", "the minute before it", med(before, "iops"),
                                note=note))
    return rows


def read_tiering_csv(path):
    return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(open(path))]


def tiering(ctx):
    seconds = ctx.pick(300, 40)
    shown = {"randread": f"bash bench/tiering.sh target/release/strata {seconds}",
             "hotzone": f"RW=hotzone bash bench/tiering.sh target/release/strata {seconds}"}
    runs = {}
    for rw in ("randread", "hotzone"):
        out = ctx.tmp / f"tiering-{rw}"
        sh(["bash", "bench/tiering.sh", ctx.binary, str(seconds)], env={"RW": rw, "OUT": str(out)})
        runs[rw] = {c: read_tiering_csv(out / f"{c}.csv") for c in ("ideal", "on", "off")}
        keep = RESULTS / f"tiering-{rw}"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(out, keep)
    return tiering_rows(runs, shown)


def sendrecv(ctx):
    size, rounds = ctx.pick(("1G", 3), ("256M", 1))
    out = ctx.tmp / "sr.csv"
    shown = f"ROUNDS={rounds} bash bench/send_receive.sh target/release/strata {size}"
    sh(["bash", "bench/send_receive.sh", ctx.binary, size], env={"BENCH_CSV": str(out), "ROUNDS": str(rounds)})
    got = {r[0]: r[1] for r in read_bench_csv(out)}
    rows = []
    for key, name, peer_key, peer_name in [
            ("send_full", "send of a full snapshot to /dev/null", "nbd_read", "1M sequential NBD read (fio QD8)"),
            ("send_incremental", "send of an incremental snapshot (a quarter changed) to /dev/null", "nbd_read",
             "1M sequential NBD read (fio QD8)"),
            ("receive_full", "receive of the full stream from a file", "nbd_write", "1M sequential NBD write (fio QD8)"),
            ("send_receive_pipe", "send | receive through a pipe", "nbd_write", "1M sequential NBD write (fio QD8)")]:
        if key in got:
            rows.append(row(f"{name}, {size[:-1]} {size[-1]}iB volume", shown, got[key], "MiB/s", peer_name,
                            got.get(peer_key)))
    return rows


def tls(ctx):
    """NBD over TLS (PSK), 1M sequential with nbdcopy, one connection, 4
    requests in flight: strata with --tls=on (plaintext and TLS clients on
    one daemon) and nbdkit's memory plugin with TLS, ROUNDS interleaved
    rounds, medians."""
    rounds, mib = ctx.pick((3, 1024), (1, 64))
    work = ctx.tmp / "tls"
    work.mkdir()
    psk = work / "keys.psk"
    psk.write_text(f"alice:{os.urandom(32).hex()}\n")
    psk.chmod(0o600)
    source = Path("/dev/shm") / f"strata-tls-{os.getpid()}.raw"
    with open(source, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
    copy = ["nbdcopy", "--request-size=1048576", "--connections=1", "--requests=4"]
    shown = (f"python3 bench/all.py run tls (nbdcopy --request-size=1048576 --connections=1 --requests=4, "
             f"{mib} MiB, {rounds} rounds; strata serve --tls=on --tls-psk FILE; nbdkit --tls=on --tls-psk=FILE memory 1G)")
    procs = []
    try:
        strata = subprocess.Popen([ctx.binary, "serve", "--data-dir", str(work / "d"), "--nbd", "127.0.0.1:0",
                                   "--api", "127.0.0.1:0", "--iscsi", "127.0.0.1:0", "--nfs", "127.0.0.1:0",
                                   "--tls=on", "--tls-psk", str(psk)], cwd=work, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, STRATA_LOG="warn"))
        procs.append(strata)
        port = None
        for line in strata.stdout:
            m = re.match(r"strata: nbd listening on 127.0.0.1:(\d+)", line)
            if m:
                port = int(m.group(1))
            if line.startswith("strata: iscsi listening") and port:
                break
        subprocess.run([ctx.binary, "volume", "create", "default/bench", "--size", "1G", "--data-dir",
                        str(work / "d")], check=True, stdout=subprocess.DEVNULL, env=dict(os.environ))
        nbdkit_port = free_port()
        nbdkit = subprocess.Popen(["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(nbdkit_port), "--tls=on",
                                   f"--tls-psk={psk}", "memory", "1G"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        procs.append(nbdkit)
        time.sleep(1)
        targets = {
            "strata plaintext": (strata.pid, f"nbd://127.0.0.1:{port}/default/bench"),
            "strata TLS": (strata.pid, f"nbds://alice@127.0.0.1:{port}/default/bench?tls-psk-file={psk}"),
            "nbdkit TLS": (nbdkit.pid, f"nbds://alice@127.0.0.1:{nbdkit_port}/?tls-psk-file={psk}"),
        }
        # The first write allocates strata's volume: not counted.
        subprocess.run(copy + [str(source), targets["strata plaintext"][1]], check=True)
        samples = {}
        for _ in range(rounds):
            for name, (pid, uri) in targets.items():
                for direction, argv in (("write", copy + [str(source), uri]), ("read", copy + [uri, "null:"])):
                    before = cpu_seconds(pid)
                    started = time.time()
                    subprocess.run(argv, check=True)
                    wall = time.time() - started
                    cpu = cpu_seconds(pid) - before
                    samples.setdefault((name, direction), []).append((mib / wall, cpu * 1e6 / mib))
                    print(f"{name} {direction}: {mib / wall:.0f} MiB/s, {cpu * 1e6 / mib:.0f} µs CPU/MiB",
                          file=sys.stderr)
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        source.unlink(missing_ok=True)

    def med(name, direction, i):
        return statistics.median(s[i] for s in samples[(name, direction)])

    rows = []
    for direction in ("write", "read"):
        rows.append(row(f"1M sequential {direction} over TLS 1.3 (PSK), one connection, QD4", shown,
                        med("strata TLS", direction, 0), "MiB/s", "nbdkit memory, TLS",
                        med("nbdkit TLS", direction, 0), med("strata TLS", direction, 1),
                        med("nbdkit TLS", direction, 1), note="server CPU per MiB"))
        rows.append(row(f"1M sequential {direction}: TLS against plaintext on one strata daemon", shown,
                        med("strata TLS", direction, 0), "MiB/s", "strata plaintext",
                        med("strata plaintext", direction, 0), med("strata TLS", direction, 1),
                        med("strata plaintext", direction, 1), note="server CPU per MiB"))
    return rows


def analytics(ctx):
    seconds, rounds = ctx.pick((5, 3), (1, 1))
    out = ctx.tmp / "an.csv"
    shown = f"ROUNDS={rounds} bash bench/analytics_cost.sh target/release/strata {seconds}"
    sh(["bash", "bench/analytics_cost.sh", ctx.binary, str(seconds)], env={"BENCH_CSV": str(out),
                                                                         "ROUNDS": str(rounds)})
    got = {(r[0], r[1]): (r[2], r[3]) for r in read_bench_csv(out)}
    rows = []
    for test, name in [("randread-32", "4K random read QD32"), ("randwrite-32", "4K random write QD32")]:
        if (test, "iops") in got:
            on, off = got[(test, "iops")]
            cpu_on, cpu_off = got.get((test, "cpu_us_per_op"), ("", ""))
            rows.append(row(f"{name}, filled 1 GiB volume, NBD", shown, on, "IOPS", "--no-analytics", off, cpu_on,
                            cpu_off))
    if ("randread-1", "p50_us") in got:
        on, off = got[("randread-1", "p50_us")]
        rows.append(row("4K random read QD1, filled 1 GiB volume, NBD", shown, on, f"µs p50 ({LOWER})",
                        "--no-analytics", off))
    return rows


def recovery(ctx):
    gib = ctx.pick(10, 1)
    out = ctx.tmp / "rec.csv"
    shown = f"bash bench/recovery.sh {gib}"
    sh(["bash", "bench/recovery.sh", str(gib)], env={"BENCH_CSV": str(out), "STRATA_BIN": ctx.binary})
    got = read_bench_csv(out)
    if not got:
        return []
    g, seconds, records, suspect, ok = got[-1]
    return [row(f"restart after kill -9 with {g} GiB written, until NBD serves again", shown, seconds,
                f"s ({LOWER})", note=f"{records} log records replayed, {suspect} suspect chunks; "
                                    f"first and last MiB read back: {'yes' if ok == '1' else 'no'}")]


def connections(ctx):
    out = ctx.tmp / "conn.json"
    shown = "python3 bench/conn_scale.py"
    sh(["python3", "bench/conn_scale.py", "--binary", ctx.binary, "--json", str(out)])
    got = {r["state"]: r for r in json.loads(out.read_text())}
    rows = []
    for state in ("100 idle", "1000 idle"):
        if state in got:
            r = got[state]
            rows.append(row(f"RSS per idle NBD connection, {state.split()[0]} open", shown, r["rss_per_conn_kib"],
                            f"KiB ({LOWER})", note=f"threads per connection {abs(r['threads_per_conn']):.2f}; "
                                                  f"daemon wake-ups {r['wakeups']:.0f} per s"))
    r = got.get("100 open, 100 reading")
    if r:
        rows.append(row("RSS per open NBD connection, 100 open and all reading 4K at QD1", shown,
                        r["rss_per_conn_kib"], f"KiB ({LOWER})",
                        note=f"{r['wakeups']:.2f} daemon wake-ups per read, {r['reads_per_s']:.0f} reads/s"))
    base = got.get("no connection")
    if base:
        rows.append(row("daemon RSS with no connection", shown, base["rss_kib"], f"KiB ({LOWER})",
                        note=f"{base['threads']} threads, {base['wakeups']:.0f} wake-ups per s idle"))
    return rows


def client_memory(ctx):
    out = ctx.tmp / "memory.json"
    seconds = ctx.pick(5, 2)
    shown = "python3 bench/client_memory.py --client-memory 1G"
    sh(["python3", "bench/client_memory.py", "--binary", ctx.binary, "--client-memory", "1G",
        "--seconds", str(seconds), "--json", str(out)])
    rows = []
    for r in json.loads(out.read_text()):
        what = {"read": "four 32 MiB READs each, replies never read",
                "write": "four 32 MiB WRITEs each, replies never read",
                "idle": "idle (handshake done)"}[r["kind"]]
        rows.append(row(f"daemon growth, {r['connections']} NBD connections from one address, {what}", shown,
                        r["grown_mib"], f"MiB ({LOWER})",
                        note=f"budget 1 GiB; peak RssAnon {r['peak_mib']:.0f} MiB; another client's 4K reads "
                             f"meanwhile: {r['reads_per_s']:.0f}/s, slowest {r['worst_ms']:.1f} ms"))
    return rows


def nfs_listing(ctx):
    out = ctx.tmp / "listing.json"
    files, seconds = ctx.pick((100000, 15), (10000, 3))
    shown = f"python3 bench/nfs_list_reads.py --files {files}"
    sh(["python3", "bench/nfs_list_reads.py", "--binary", ctx.binary, "--files", str(files), "--seconds",
        str(seconds), "--json", str(out)])
    got = {r["case"]: r for r in json.loads(out.read_text())}
    alone, listing = got["alone"], got["while listing"]
    return [row(f"4K random reads of a file at QD1 while another client lists a {files}-entry directory "
                "in a loop (peer: the same reads alone)", shown, listing["p99_us"], f"µs p99 ({LOWER})",
                peer_name="alone", peer=alone["p99_us"],
                note=f"{listing['listings']} listings meanwhile; reads/s {listing['ops_per_s']:.0f} "
                     f"(alone {alone['ops_per_s']:.0f}), p50 {listing['p50_us']:.0f} µs "
                     f"(alone {alone['p50_us']:.0f})")]


def migrator_planning(ctx):
    out = ctx.tmp / "plan.json"
    sizes = ctx.pick("64,256,1024,4096", "64")
    shown = f"python3 bench/migrate_plan.py --sizes {sizes}"
    command = ["python3", "bench/migrate_plan.py", "--sizes", sizes, "--json", str(out)]
    # STRATA_PLAN_BASELINE: another build's lib test binary, measured beside.
    baseline = os.environ.get("STRATA_PLAN_BASELINE")
    if baseline:
        command += ["--baseline", baseline]
        shown += " --baseline BASELINE_LIB_TEST_BINARY"
    sh(command, timeout=4 * 3600)
    results = json.loads(out.read_text())
    peer_name = "whole-map plan"
    rows = []
    for gib in sorted({r["gib"] for r in results}):
        got = {r["build"]: r for r in results if r["gib"] == gib}
        r, base = got["tested"], got.get("baseline")
        size = f"{gib // 1024} TiB" if gib >= 1024 else f"{gib} GiB"
        what = f"{size} mapped in 16 KiB blocks ({r['blocks']:,} blocks)"
        peer = base["plan_peak_growth_kib"] / 1024 if base else None
        base_note = f" ({peer_name}: {base['owners']:,}, {base['plan_s']:.1f} s)" if base else ""
        rows.append(row(f"memory one demotion pass's planning takes, {what}", shown,
                        r["plan_peak_growth_kib"] / 1024, f"MiB peak RSS growth ({LOWER})", peer_name=peer_name,
                        peer=peer, note=f"block entries kept {r['owners']:,}, planning {r['plan_s']:.1f} s"
                                        f"{base_note}"))
        peer = base["longest_hold_us"] if base else None
        base_note = f" ({peer_name}: {base['holds']} of up to {base['most_chunks_per_hold']:,})" if base else ""
        rows.append(row(f"longest hold of the allocator lock while planning, {what}", shown,
                        r["longest_hold_us"], f"µs ({LOWER})", peer_name=peer_name, peer=peer,
                        note=f"{r['holds']:,} holds of up to {r['most_chunks_per_hold']:,} chunks, "
                             f"{r['mean_hold_us']:.0f} µs on average{base_note}"))
    return rows


def mirrors(ctx):
    out = ctx.tmp / "mirrors.json"
    runtime, repeat, size = ctx.pick((10, 3, 1024), (3, 1, 256))
    shown = "python3 bench/mirror_bench.py"
    sh(["python3", "bench/mirror_bench.py", "--binary", ctx.binary, "--runtime", str(runtime), "--repeat",
        str(repeat), "--size-mib", str(size), "--json", str(out)])
    rows = []
    for model, workloads in json.loads(out.read_text()).items():
        for workload, got in workloads.items():
            two, one = got["mirror"], got["single"]
            rows.append(row(f"{workload}, mirror of two against one ({model})", shown, two["iops"], "IOPS",
                            peer_name="one device", peer=one["iops"], strata_cpu=two["cpu_us_per_op"],
                            peer_cpu=one["cpu_us_per_op"], strata_p99=two["p99_us"], peer_p99=one["p99_us"]))
    return rows


def scrub(ctx):
    out = ctx.tmp / "scrub.json"
    runtime, size, disk = ctx.pick((15, 1024, 512), (3, 128, 64))
    shown = f"python3 bench/scrub_bench.py --runtime {runtime} --size-mib {size} --disk-mib {disk}"
    sh(["python3", "bench/scrub_bench.py", "--binary", ctx.binary, "--runtime", str(runtime), "--size-mib",
        str(size), "--disk-mib", str(disk), "--json", str(out)])
    got = json.loads(out.read_text())
    idle, slow, resilver, on_disks = got["idle"], got["slow"], got["resilver"], got["disk"]
    alone, beside = slow["alone"], slow["beside"]
    return [
        row("scrub of a mirror of two files, idle, against a client's sequential read of the volume", shown,
            idle["scrub_mib_s"], "MiB/s", peer_name="fio 1M read QD4", peer=idle["read_mib_s"],
            note=f"server CPU {idle['scrub_cpu_s_per_gib']:.2f} s per GiB scrubbed, "
                 f"{idle['read_cpu_s_per_gib']:.2f} s per GiB read"),
        row("4K randread QD1 beside a scrub, against alone (delay:4ms+throttle:iops=200 devices)", shown,
            beside["iops"], "IOPS", peer_name="no scrub", peer=alone["iops"], strata_p99=beside["p99_us"],
            peer_p99=alone["p99_us"], note=f"the scrub checked {slow['scrub_mib_s']:.1f} MiB/s meanwhile"),
        row("resilver of a new third copy (files), idle, against a client's sequential read of the volume", shown,
            resilver["full_mib_s"], "MiB/s", peer_name="fio 1M read QD4", peer=idle["read_mib_s"],
            note=f"{resilver['full_bytes'] / (1 << 20):.0f} MiB copied, server CPU "
                 f"{resilver['full_cpu_s_per_gib']:.2f} s per GiB"),
        row("resilver of a new third copy (files), idle, against dd copying a child's file to a new file", shown,
            resilver["full_mib_s"], "MiB/s", peer_name="dd bs=1M", peer=resilver["dd_copy_mib_s"]),
        row("resilver on delay:4ms+throttle:bw=100M devices, against one such device's sequential read", shown,
            on_disks["resilver_mib_s"], "MiB/s", peer_name="fio 1M read QD4", peer=on_disks["read_mib_s"],
            note=f"{on_disks['copied_bytes'] / (1 << 20):.0f} MiB copied"),
        row("resilver of a device back after an absence, against the bytes written meanwhile", shown,
            resilver["back_bytes"] / (1 << 20), f"MiB copied ({LOWER})", peer_name="written meanwhile",
            peer=resilver["changed_bytes"] / (1 << 20), note=f"copied in {resilver['back_s']:.1f} s"),
    ]


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Family:
    def __init__(self, key, title, producers, estimate, run, in_all=True):
        self.key, self.title, self.producers, self.estimate, self.run, self.in_all = \
            key, title, producers, estimate, run, in_all


LIB = "bench/lib.sh"
FAMILIES = [
    Family("nbd", "NBD", ["bench/nbd_bench.py"], "4 min", nbd),
    Family("iscsi", "iSCSI", ["bench/iscsi_bench.py"], "2 min", iscsi),
    Family("nfs", "NFS", ["bench/nfs_qd.py", "bench/nfs_peers.py", "bench/nfs_load.c"], "5 min", nfs),
    Family("sync", "Sync writes", ["bench/sync_scale.sh", LIB], "3 min", sync),
    Family("tls", "TLS", ["bench/all.py"], "2 min", tls),
    Family("recovery", "Recovery", ["bench/recovery.sh", LIB], "1 min", recovery),
    Family("analytics", "Analytics", ["bench/analytics_cost.sh", LIB], "3 min", analytics),
    Family("connections", "Connections", ["bench/conn_scale.py"], "1 min", connections),
    Family("snapshots", "Snapshots", ["bench/snapshot_load.sh", LIB], "4 min", snapshots),
    Family("send-receive", "Send and receive", ["bench/send_receive.sh", LIB], "2 min", sendrecv),
    Family("many-clients", "Many clients", ["bench/many_clients.sh", "bench/iscsi_bench.py", LIB], "12 min",
           clients),
    Family("client-memory", "Client memory", ["bench/client_memory.py"], "3 min", client_memory),
    Family("nfs-listing", "NFS listing", ["bench/nfs_list_reads.py", "bench/nfs_peers.py", "bench/nfs_load.c"],
           "4 min", nfs_listing),
    Family("mirrors", "Mirrors", ["bench/mirror_bench.py", "bench/nbd_bench.py"], "5 min", mirrors),
    Family("scrub", "Scrub", ["bench/scrub_bench.py", "bench/mirror_bench.py", "bench/nbd_bench.py"], "2 min",
           scrub),
    Family("tiering", "Tiering", ["bench/tiering.sh", LIB], "40 min", tiering, in_all=False),
    Family("migrator-planning", "Migrator planning", ["bench/migrate_plan.py"], "10 min", migrator_planning,
           in_all=False),
]
BY_KEY = {f.key: f for f in FAMILIES}


# --- machine and git -------------------------------------------------------------------------------

def cpu_model():
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    name = info.get("model name", "unknown")
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']} model {info['model']})"
    return f"{name}, {os.cpu_count()} cores"


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def changed_since(commit, family, cache={}):
    """True if the code or the family's producers differ between COMMIT and
    HEAD (or COMMIT is not in this clone's history)."""
    key = (commit, family.key)
    if key not in cache:
        rc = git("diff", "--quiet", commit, "HEAD", "--", *CODE, *family.producers).returncode
        cache[key] = rc != 0
    return cache[key]


# --- CSVs and rendering ----------------------------------------------------------------------------

def csv_path(family):
    return RESULTS / f"{family.key}.csv"


def read_rows(family):
    path = csv_path(family)
    if not path.exists():
        return []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != COLUMNS:
            sys.exit(f"{path}: columns {reader.fieldnames}, want {COLUMNS}")
        return list(reader)


def write_rows(family, rows):
    RESULTS.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    csv_path(family).write_text(buf.getvalue())


def figure(text):
    """A CSV figure for the table: thousands separated."""
    value = number(text)
    if value is None:
        return text
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return text


def cell(text):
    return text.replace("|", "\\|")


def table(family, notes):
    rows = read_rows(family)
    if not rows:
        return "_No measurement yet: `python3 bench/all.py run " + family.key + "`._"
    with_p99 = any(r["strata_p99_us"] or r["peer_p99_us"] for r in rows)
    head = ["row", "unit", "strata", "peer", "strata / peer", "server CPU µs/op, strata / peer"]
    if with_p99:
        head.append("p99 µs, strata / peer")
    head += ["notes", "run (date, CPU, load, commit)", "command"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        peer = f"{r['peer_name']}: {figure(r['peer'])}" if r["peer"] else (r["peer_name"] or "")
        ratio = f"{r['ratio']}x" if r["ratio"] else ""
        cpu = " / ".join(x or "—" for x in (r["strata_cpu_us"], r["peer_cpu_us"])) \
            if (r["strata_cpu_us"] or r["peer_cpu_us"]) else ""
        if cpu and not r["peer"] and not r["peer_cpu_us"]:
            cpu = r["strata_cpu_us"]
        load = f", load {r['load']}" if r["load"] else ""
        run = f"{r['date']}, {r['cpu']}{load}, `{r['commit']}`"
        if notes and changed_since(r["commit"], family):
            run += NOTE.format(r["commit"])
        cells = [r["row"], r["unit"], figure(r["strata"]), peer, ratio, cpu]
        if with_p99:
            p99 = " / ".join(figure(x) or "—" for x in (r["strata_p99_us"], r["peer_p99_us"])) \
                if (r["strata_p99_us"] or r["peer_p99_us"]) else ""
            if p99 and not r["peer"] and not r["peer_p99_us"]:
                p99 = figure(r["strata_p99_us"])
            cells.append(p99)
        cells += [r["note"], run, f"`{r['command']}`"]
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return "\n".join(lines)


def families_table():
    lines = ["| family | rows from | one run takes | in `run all` |", "|---|---|---|---|"]
    for f in FAMILIES:
        lines.append(f"| [{f.title}](#{anchor(f)}) | {', '.join(f'`{p}`' for p in f.producers if p != LIB)} "
                     f"| {f.estimate} | {'yes' if f.in_all else 'no'} |")
    return "\n".join(lines)


def anchor(family):
    """The GitHub anchor of the family's section ("## TITLE")."""
    return re.sub(r"[^a-z0-9 -]", "", family.title.lower()).replace(" ", "-")


def render(notes=True):
    text = TEMPLATE.read_text()
    for f in FAMILIES:
        if f"\n## {f.title}\n" not in text or "{{table " + f.key + "}}" not in text:
            sys.exit(f"{TEMPLATE}: wants a section '## {f.title}' with {{{{table {f.key}}}}}")
    text = text.replace("{{families}}", families_table())
    for f in FAMILIES:
        text = text.replace("{{table " + f.key + "}}", table(f, notes))
    left = re.findall(r"\{\{[^}]*\}\}", text)
    if left:
        sys.exit(f"{TEMPLATE}: unknown placeholders {left}")
    return text


def check():
    expected = render(notes=False)
    actual = NOTE_RE.sub("", DOC.read_text()) if DOC.exists() else ""
    if expected == actual:
        print("BENCHMARKS.md is what bench/all.py render writes (notes aside)")
        return 0
    import difflib
    sys.stdout.writelines(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True),
                                               "BENCHMARKS.md (notes removed)", "render (notes left out)"))
    print("\nBENCHMARKS.md differs from what `python3 bench/all.py render` writes: edit bench/BENCHMARKS.md.in "
          "or bench/results/*.csv, then render (never BENCHMARKS.md by hand)")
    return 1


class Context:
    def __init__(self, tmp, quick=False):
        self.tmp, self.quick = tmp, quick
        self.binary = os.environ.get("STRATA_BIN") or str(ROOT / "target/release/strata")

    def pick(self, normal, quick):
        """A producer's setting: the normal one, or the shortest that still
        exercises every step (`try`)."""
        return quick if self.quick else normal


def run(keys, quick=False):
    """Runs the families; with quick (`try`), the shortest settings, and the
    rows are printed instead of written."""
    if keys == ["all"]:
        keys = [f.key for f in FAMILIES if f.in_all]
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        sys.exit(f"unknown families {unknown}; known: {', '.join(BY_KEY)}")
    binary = os.environ.get("STRATA_BIN") or str(ROOT / "target/release/strata")
    if not os.path.exists(binary):
        sys.exit(f"no {binary}: cargo build --release first")
    # STRATA_COMMIT names the commit STRATA_BIN was built from, when that
    # is not HEAD (a binary kept from an earlier build).
    commit = os.environ.get("STRATA_COMMIT") or git("rev-parse", "--short=7", "HEAD").stdout.strip()
    if git("diff", "--quiet", "HEAD", "--", *CODE).returncode != 0:
        print(f"warning: src has uncommitted changes; the rows name HEAD ({commit})", file=sys.stderr)
    failed = []
    for key in keys:
        family = BY_KEY[key]
        started = time.time()
        date = time.strftime("%Y-%m-%d", time.gmtime())
        loads, done = [os.getloadavg()[0]], threading.Event()
        sampler = threading.Thread(target=sample_load, args=(loads, done), daemon=True)
        sampler.start()
        with tempfile.TemporaryDirectory(prefix=f"strata-all-{key}-") as tmp:
            try:
                rows = family.run(Context(Path(tmp), quick))
            except Exception as error:  # a failed family keeps its old CSV
                print(f"{key}: failed: {error}", file=sys.stderr)
                failed.append(key)
                continue
            finally:
                done.set()
                sampler.join()
        if not rows:
            print(f"{key}: no rows", file=sys.stderr)
            failed.append(key)
            continue
        for r in rows:
            r.update(date=date, cpu=cpu_model(), commit=commit, load=f"{min(loads):.1f}-{max(loads):.1f}")
        if quick:
            writer = csv.DictWriter(sys.stdout, fieldnames=COLUMNS, lineterminator="\n")
            writer.writeheader()
            writer.writerows({c: r.get(c, "") for c in COLUMNS} for r in rows)
            print(f"{key}: {len(rows)} rows in {time.time() - started:.0f} s (try: nothing written)", file=sys.stderr)
            continue
        write_rows(family, [{c: r.get(c, "") for c in COLUMNS} for r in rows])
        DOC.write_text(render())
        print(f"{key}: {len(rows)} rows in {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    return 1 if failed else 0


def sample_load(loads, done):
    """Appends the 1-minute load average every 10 s until done is set."""
    while not done.wait(10):
        loads.append(os.getloadavg()[0])
    loads.append(os.getloadavg()[0])


def usage():
    doc = __doc__.replace("FAMILIES_HELP", "\n".join(
        f"    {f.key:<13} {f.estimate:>7}   {f.title}{'' if f.in_all else ' (not in run all)'}" for f in FAMILIES))
    return doc


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(usage())
        return 0 if len(argv) >= 2 else 2
    command = argv[1]
    if command == "run" and len(argv) > 2:
        return run(argv[2:])
    if command == "try" and len(argv) > 2:
        return run(argv[2:], quick=True)
    if command == "render":
        DOC.write_text(render())
        return 0
    if command == "check":
        return check()
    if command == "list":
        print(families_table())
        return 0
    print(usage())
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
