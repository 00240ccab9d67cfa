#!/usr/bin/env python3
"""4K random reads of one file while another client lists a big directory:
does a READDIR stall the dataset's data I/O?

For each binary given (the one under test, and with --baseline another one
to compare with, run in the same invocation): a strata daemon on ephemeral
127.0.0.1 ports with default/files, a directory of --files entries (the
export's root, made with bench/nfs_load.c `create`) and a 64 MiB file
(`seqwrite`). Then, with bench/nfs_load.c on its own connection, QD1 4K
`randread` of the file for --seconds alone, then again while a second
process lists the whole directory (`list`: READDIRPLUS to the end) in a
loop. Recorded: the reads' ops/s, p50 and p99 in each case, and how many
listings ran meanwhile.

Usage: bench/nfs_list_reads.py [--binary target/release/strata]
       [--baseline OTHER_BINARY] [--files 100000] [--seconds 15] [--json FILE]
Prints one line per binary and case; a temporary directory under /tmp,
removed at the end; daemons stopped by PID (SIGINT).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from nfs_peers import Strata, compile_load, run_load  # noqa: E402


def measure(binary, tmp, tag, exe, files, seconds):
    server = Strata(binary, tmp, tag)
    try:
        run_load(exe, server, ["create", "-n", str(files), "-p", "d", "-q", "32"])
        run_load(exe, server, ["seqwrite", "-s", "64", "-b", "1048576", "-q", "8"])
        reads = ["randread", "-s", "64", "-q", "1", "-t", str(seconds)]
        alone = run_load(exe, server, reads)
        stop = threading.Event()
        listings = [0]

        def lister():
            while not stop.is_set():
                subprocess.run([str(exe), server.url, "list", "-n", str(files)], check=True,
                               capture_output=True)
                listings[0] += 1

        thread = threading.Thread(target=lister)
        thread.start()
        try:
            listing = run_load(exe, server, reads)
        finally:
            stop.set()
            thread.join()
        return alone, listing, listings[0]
    finally:
        server.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", default="target/release/strata")
    parser.add_argument("--baseline", help="another strata binary, measured in the same run")
    parser.add_argument("--files", type=int, default=100000)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--json", help="also write the results to this file (a list of objects)")
    args = parser.parse_args()
    results = []
    binaries = [("new", Path(args.binary).resolve())]
    if args.baseline:
        binaries.insert(0, ("baseline", Path(args.baseline).resolve()))
    with tempfile.TemporaryDirectory(prefix="strata-list-reads-") as tmp:
        tmp = Path(tmp)
        exe = compile_load(tmp)
        print(f"{'binary':<9} {'case':<14} {'reads/s':>9} {'p50_us':>8} {'p99_us':>8} {'listings':>9}")
        for tag, binary in binaries:
            alone, listing, listings = measure(binary, tmp, tag, exe, args.files, args.seconds)
            for case, res, count in [("alone", alone, 0), ("while listing", listing, listings)]:
                results.append({"binary": tag, "case": case, "listings": count, **res})
                print(f"{tag:<9} {case:<14} {res['ops_per_s']:>9.0f} {res['p50_us']:>8.0f} {res['p99_us']:>8.0f}"
                      f" {count:>9}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
