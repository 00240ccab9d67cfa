#!/usr/bin/env bash
# Allocating random writes with FLUSHes: a fresh 4 GiB volume on a fresh
# default pool, fio's nbd engine, 4 jobs x QD8, one FLUSH per FSYNC writes
# per job, SECS seconds; each binary in turn, ROUNDS rounds alternating
# (the second binary of a round tends to win a few percent on this VM).
# Prints IOPS and the daemon's CPU per write (from /proc). Temporary data
# directories, ephemeral 127.0.0.1 ports, servers stopped by PID.
#
# Usage: [BS=4k] [FSYNC=32] [ROUNDS=2] bench/alloc_flush.sh SECS BINARY...
set -euo pipefail
SECS=${1:?seconds}
shift
BS=${BS:-4k}
FSYNC=${FSYNC:-32}
ROUNDS=${ROUNDS:-2}
. "$(dirname "$0")/lib.sh"
ticks() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
for round in $(seq "$ROUNDS"); do
    for bin in "$@"; do
        bin=$(realpath "$bin")
        DIR=$(mktemp -d)
        start_strata "$bin"
        "$bin" volume create default/v --size 4G >/dev/null
        before=$(ticks)
        out=$(fio --name=w --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/default/v" --rw=randwrite --bs="$BS" \
            --iodepth=8 --numjobs=4 --group_reporting --fsync="$FSYNC" --time_based --runtime="$SECS" \
            --size=4G --output-format=json 2>/dev/null)
        after=$(ticks)
        kill "$PID"
        wait "$PID" 2>/dev/null || true
        cd /
        rm -rf "$DIR"
        echo "$out" | sed -n '/^{/,$p' | python3 -c '
import json, sys
job = json.load(sys.stdin)["jobs"][0]["write"]
ios, iops = job["total_ios"], job["iops"]
ticks, hz = float(sys.argv[2]) - float(sys.argv[1]), float(sys.argv[3])
print(f"round {sys.argv[4]} {sys.argv[5]}: {iops:,.0f} IOPS, {ticks / hz * 1e6 / max(ios, 1):.1f} us CPU/write")
' "$before" "$after" "$(getconf CLK_TCK)" "$round" "$bin"
    done
done
