#!/usr/bin/env python3
"""What one migrator pass's planning costs as the pool grows: the memory it
takes (peak resident memory grown over the planning call, and the block
entries it keeps), the longest hold of the allocator lock (which every
allocating writer waits for), and its time, at several pool sizes.

Each size is one run of the lib's ignored test
`pool::migrate::tests::planning_at_scale`: a pool on sparse files (a fast
device and a capacity device under --dir) whose one volume maps SIZE GiB
of 16 KiB blocks, half on the fast tier (filled to 90 %, above its high
watermark, so the pass demotes), the other half on the capacity tier.
The blocks are mapped to slots without their data being written
(planning reads only the maps and the allocator), so a pool far larger
than the disk's free space can be measured; RAM bounds it (the maps take
8 bytes a block).

Usage: bench/migrate_plan.py [--test-binary PATH] [--baseline PATH]
       [--baseline-max-gib 1024] [--sizes 64,256,1024,4096]
       [--dir /var/tmp] [--json FILE]
--test-binary is the lib's release test binary (default: built with
`cargo test --release --lib --no-run`); --baseline is another build's,
run before it at every size up to --baseline-max-gib (a planner that
grows with the pool would not fit this machine's RAM beyond). Sizes below
64 GiB leave the fast tier under its high watermark (its device keeps
17 GiB for metadata): nothing to plan.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "pool::migrate::tests::planning_at_scale"


def lib_test_binary():
    out = subprocess.run(["cargo", "test", "--release", "--lib", "--no-run", "--message-format=json"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        message = json.loads(line)
        if message.get("reason") == "compiler-artifact" and message.get("executable") \
                and "lib" in message["target"]["kind"]:
            return message["executable"]
    sys.exit("cargo built no lib test binary")


def measure(binary, gib, directory):
    env = dict(os.environ, STRATA_PLAN_GIB=str(gib), STRATA_PLAN_DIR=directory, RUST_LOG="off")
    run = subprocess.run([binary, TEST, "--exact", "--ignored", "--nocapture", "--test-threads=1"],
                         env=env, capture_output=True, text=True, timeout=7200)
    for line in run.stdout.splitlines():
        # The test harness may print its "test ... " on the same line.
        if "plan: {" in line:
            return json.loads(line[line.index("plan: {") + len("plan: "):])
    sys.exit(f"{binary} at {gib} GiB printed no plan line:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--test-binary")
    parser.add_argument("--baseline")
    parser.add_argument("--baseline-max-gib", type=int, default=1024)
    parser.add_argument("--sizes", default="64,256,1024,4096")
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--json")
    args = parser.parse_args()
    binary = args.test_binary or lib_test_binary()
    results = []
    print(f"{'GiB':>6} {'blocks':>10} {'build':>8} {'plan s':>7} {'entries':>10} {'grown MiB':>9} "
          f"{'holds':>6} {'longest hold µs':>15} {'mean hold µs':>12} {'chunks/hold':>11}", flush=True)
    for gib in (int(s) for s in args.sizes.split(",")):
        for build, path in (("baseline", args.baseline), ("tested", binary)):
            if not path or (build == "baseline" and gib > args.baseline_max_gib):
                continue
            r = measure(path, gib, args.dir)
            r["build"] = build
            r.setdefault("mean_hold_us", r["longest_hold_us"] / max(r["holds"], 1))
            results.append(r)
            print(f"{gib:>6} {r['blocks']:>10} {build:>8} {r['plan_s']:>7.2f} {r['owners']:>10} "
                  f"{r['plan_peak_growth_kib'] / 1024:>9.1f} {r['holds']:>6} {r['longest_hold_us']:>15} "
                  f"{r['mean_hold_us']:>12.1f} {r['most_chunks_per_hold']:>11}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
