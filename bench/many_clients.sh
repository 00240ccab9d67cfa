#!/usr/bin/env bash
# Many clients: fio's nbd engine, 4K random reads and writes,
# one connection per job, jobs x QD = 1x32, 16x4, 64x2, 128x1, 256x1, over
# one filled 1 GiB volume, strata (default pool) against nbdkit's file
# plugin on an equal file, in the same run. Reports IOPS, the p99 of
# completion latency of the median job, the spread of the jobs' own p99s
# (slowest job / median job: fairness), and the server's CPU per operation
# (utime + stime of its process over the run, from /proc).
# Every row starts with nothing left dirty by the fill or an earlier row
# (settle, below). A temporary directory, ephemeral 127.0.0.1 ports,
# servers stopped by PID.
#
# VOLUMES=16 splits the same 1 GiB into 16 volumes of 64 MiB (strata: 16
# volumes of the pool; nbdkit: its file plugin's dir= mode, one file per
# export), each job group writing its own: JOBS/16 connections per volume
# (rows with fewer jobs than volumes are skipped).
#
# Usage: bench/many_clients.sh [STRATA_BINARY] [SECONDS]
#        (ROWS="1x32 16x4" picks rows; SERVERS="strata nbdkit" picks servers;
#        RWS=randwrite picks the direction; RATE=20000 offers that many
#        requests a second in all instead of a closed loop, for latency at
#        an equal load; BENCH_CSV=FILE appends each row as
#        "server,rw,row,volumes,rate,iops,p99_us,spread,cpu_us_per_op")
set -euo pipefail
BIN=$(realpath "${1:-$(dirname "$0")/../target/release/strata}")
SECONDS_RUN=${2:-15}
ROWS=${ROWS:-1x32 16x4 64x2 128x1 256x1}
SERVERS=${SERVERS:-strata nbdkit}
RWS=${RWS:-randread randwrite}
VOLUMES=${VOLUMES:-1}
RATE=${RATE:-}
VOLUME_MIB=$((1024 / VOLUMES))
LIB=$(realpath "$(dirname "$0")/lib.sh")
DIR=$(mktemp -d)
PID=
trap 'stop_pid "$PID"; rm -rf "$DIR"' EXIT
# shellcheck source=bench/lib.sh
source "$LIB" # stop_pid, for the trap
TICKS=$(getconf CLK_TCK)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

start_server() {
    if [ "$1" = strata ]; then
        # shellcheck source=bench/lib.sh
        source "$LIB"
        # 256 connections from one address: above the default per-client cap.
        start_strata "$BIN" --max-connections-per-client 512
        URIS=()
        for v in $(seq 0 $((VOLUMES - 1))); do
            "$BIN" volume create "default/b$v" --size "${VOLUME_MIB}M" >/dev/null
            URIS+=("nbd://127.0.0.1:$PORT/default/b$v")
        done
    elif [ "$VOLUMES" = 1 ]; then
        # shellcheck source=bench/lib.sh
        source "$LIB"
        start_nbdkit
        URIS=("$URI")
    else
        mkdir -p "$DIR/vols"
        URIS=()
        for v in $(seq 0 $((VOLUMES - 1))); do
            truncate -s "${VOLUME_MIB}M" "$DIR/vols/b$v"
        done
        PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        nbdkit -f -i 127.0.0.1 -p "$PORT" --threads 16 file dir="$DIR/vols" &
        PID=$!
        for v in $(seq 0 $((VOLUMES - 1))); do
            URIS+=("nbd://127.0.0.1:$PORT/b$v")
        done
        for _ in $(seq 50); do nbdinfo "${URIS[0]}" >/dev/null 2>&1 && break; sleep 0.1; done
    fi
    for uri in "${URIS[@]}"; do
        fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=4 --size="${VOLUME_MIB}M" \
            --output-format=terse >/dev/null
    done
}

# Before each row: what earlier rows (and the fill) left dirty goes to the
# disk first, so that no row pays for another's writes: strata destages
# its RAM write-back cache (`pool sync`), and the kernel writes back the
# page cache (`sync`: nbdkit's file, strata's device files).
settle() {
    if [ "$1" = strata ]; then
        "$BIN" pool sync default >/dev/null
    fi
    sync
}

stop_server() {
    kill "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    PID=
    rm -rf "$DIR/d" "$DIR/img" "$DIR/vols" "$DIR"/*.txt
}

# One row: prints "IOPS p99_us spread cpu_us_per_op".
run_row() {
    local rw=$1 jobs=$2 depth=$3 before after
    # One job group per volume, JOBS / VOLUMES connections each.
    local groups=() uri
    # RATE: an open loop, that many requests a second offered in all,
    # split evenly among the jobs (a global option: before the first job).
    [ -z "$RATE" ] || groups+=(--rate_iops=$((RATE / jobs)))
    for uri in "${URIS[@]}"; do
        groups+=(--name=w --uri="$uri" --numjobs=$((jobs / VOLUMES)))
    done
    before=$(cpu_ticks "$PID")
    fio --ioengine=nbd --rw="$rw" --bs=4k --iodepth="$depth" --size="${VOLUME_MIB}M" \
        --time_based --runtime="$SECONDS_RUN" --norandommap \
        --output-format=json --output="$DIR/fio.json" "${groups[@]}" >/dev/null
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
        [ "$jobs" -ge "$VOLUMES" ] || continue
        for rw in $RWS; do
            settle "$server"
            read -r iops p99 spread cpu < <(run_row "$rw" "$jobs" "$depth")
            echo "| $server | $rw | $row | $iops | $p99 | $spread | $cpu |"
            bench_csv "$server" "$rw" "$row" "$VOLUMES" "${RATE:-0}" "$iops" "$p99" "$spread" "$cpu"
        done
    done
    stop_server
done
