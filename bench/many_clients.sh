#!/usr/bin/env bash
# Many clients (issue 21): fio's nbd engine, 4K random reads and writes,
# one connection per job, jobs x QD = 1x32, 16x4, 64x2, 128x1, 256x1, over
# one filled 1 GiB volume, strata (default pool) against nbdkit's file
# plugin on an equal file, in the same run. Reports IOPS, the p99 of
# completion latency of the median job, the spread of the jobs' own p99s
# (slowest job / median job: fairness), and the server's CPU per operation
# (utime + stime of its process over the run, from /proc).
# A temporary directory, ephemeral 127.0.0.1 ports, servers stopped by PID.
#
# Usage: bench/many_clients.sh [STRATA_BINARY] [SECONDS]
#        (ROWS="1x32 16x4" picks rows; SERVERS="strata nbdkit" picks servers;
#        RWS=randwrite picks the direction)
set -euo pipefail
BIN=$(realpath "${1:-$(dirname "$0")/../target/release/strata}")
SECONDS_RUN=${2:-15}
ROWS=${ROWS:-1x32 16x4 64x2 128x1 256x1}
SERVERS=${SERVERS:-strata nbdkit}
RWS=${RWS:-randread randwrite}
LIB=$(realpath "$(dirname "$0")/lib.sh")
DIR=$(mktemp -d)
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; sleep 0.5; rm -rf "$DIR"' EXIT
TICKS=$(getconf CLK_TCK)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

start_server() {
    if [ "$1" = strata ]; then
        # shellcheck source=bench/lib.sh
        source "$LIB"
        # 256 connections from one address: above the default per-client cap.
        start_strata "$BIN" --max-connections-per-client 512
        "$BIN" volume create default/b --size 1G >/dev/null
        URI=nbd://127.0.0.1:$PORT/default/b
    else
        # shellcheck source=bench/lib.sh
        source "$LIB"
        start_nbdkit
    fi
    fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=4 --size=1G \
        --output-format=terse >/dev/null
}

stop_server() {
    kill "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    PID=
    rm -rf "$DIR/d" "$DIR/img" "$DIR"/*.txt
}

# One row: prints "IOPS p99_us spread cpu_us_per_op".
run_row() {
    local rw=$1 jobs=$2 depth=$3 before after
    before=$(cpu_ticks "$PID")
    fio --name=w --ioengine=nbd --uri="$URI" --rw="$rw" --bs=4k --iodepth="$depth" --numjobs="$jobs" \
        --size=1G --time_based --runtime="$SECONDS_RUN" --norandommap \
        --output-format=json --output="$DIR/fio.json" >/dev/null
    after=$(cpu_ticks "$PID")
    python3 - "$DIR/fio.json" "$rw" $((after - before)) "$TICKS" <<'EOF'
import json, statistics, sys
data = json.load(open(sys.argv[1]))
direction = "read" if "read" in sys.argv[2] else "write"
ticks, per_second = int(sys.argv[3]), int(sys.argv[4])
jobs = [job[direction] for job in data["jobs"]]
ios = sum(job["total_ios"] for job in jobs)
iops = sum(job["iops"] for job in jobs)
p99s = sorted(job["clat_ns"]["percentile"]["99.000000"] for job in jobs if job["total_ios"])
median = statistics.median(p99s) if p99s else 0
spread = p99s[-1] / median if median else 0
cpu_seconds = ticks / per_second
print(f"{iops:.0f} {median / 1000:.0f} {spread:.2f} {cpu_seconds * 1e6 / max(ios, 1):.1f}")
EOF
}

echo "| server | rw | jobs x QD | IOPS | median job's p99 (µs) | slowest job's p99 / median's | server CPU µs/op |"
echo "|---|---|---|---:|---:|---:|---:|"
for server in $SERVERS; do
    start_server "$server"
    for row in $ROWS; do
        jobs=${row%x*}
        depth=${row#*x}
        for rw in $RWS; do
            read -r iops p99 spread cpu < <(run_row "$rw" "$jobs" "$depth")
            echo "| $server | $rw | $row | $iops | $p99 | $spread | $cpu |"
        done
    done
    stop_server
done
