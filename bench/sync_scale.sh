#!/usr/bin/env bash
# Group commit on the default pool: `sync=always` 4K random
# writes through fio's nbd engine, one connection per job, on the default
# pool (no configuration: the log shares the fast device with the data).
#   fresh:   a new 1 GiB volume (writes allocate), QD1 then QD32 (32 jobs
#            x QD1: a database's many sessions), each on its own new volume;
#   filled:  the same on a 1 GiB volume filled first (overwrites);
#   16 vols: 16 filled 256 MiB volumes written at once, 16 x (4 jobs x
#            QD1), against one of them alone at QD1;
#   256:     256 connections on one fresh 1 GiB volume (the log fills many
#            times over: writers must wait for room, never fail).
# Prints IOPS, p99 completion latency, the daemon's CPU per write, how
# busy the machine's CPUs were (client included), the log commits a second
# and the flushes of the data devices a second, all and those made by a
# commit under its lock (from /metrics; the others are the destager's), the
# writes that waited for room in the intent log (and how long, summed over
# the writers), and the ratios against the target (>= 8x). Also counts writes
# that failed (fio err=). Every row starts settled: nothing an earlier row
# or a fill wrote is still cached (`strata pool sync`, then `sync`).
# A temporary directory, ephemeral 127.0.0.1 ports, the server stopped by PID.
#
# Usage: bench/sync_scale.sh [STRATA_BINARY] [SECONDS]
#        (ROWS="fresh filled 16vols 256" picks rows; BENCH_CSV=FILE appends
#        each run as "label,iops,p99_us,cpu_us_per_write,room_waits,
#        room_wait_writer_s,jobs_with_errors")
set -euo pipefail
ROWS=${ROWS:-fresh filled 16vols 256}
BIN=$(realpath "${1:-$(dirname "$0")/../target/release/strata}")
SECS=${2:-10}
LIB=$(realpath "$(dirname "$0")/lib.sh")
DIR=$(mktemp -d)
PID=
trap 'stop_pid "$PID"; rm -rf "$DIR"' EXIT
# shellcheck source=bench/lib.sh
source "$LIB"
start_strata "$BIN" --max-connections-per-client 512
API=$(grep -o "api listening on http://127.0.0.1:[0-9]*" out.txt | grep -o "[0-9]*$")
metric() { curl -s "http://127.0.0.1:$API/metrics" | awk -v m="$1" '$1 ~ "^"m"[{ ]" {print $2}'; }

volume() { # NAME SIZE [fill]
    "$BIN" volume create "default/$1" --size "$2" >/dev/null
    if [ "${3:-}" = fill ]; then
        fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/default/$1" --rw=write --bs=1M \
            --iodepth=4 --size="$2" --output-format=terse >/dev/null
    fi
    "$BIN" volume set "default/$1" sync=always >/dev/null
}

# run LABEL JOBS VOLUMES...: JOBS connections per volume, QD1 each, all at once.
run() {
    local label=$1 jobs=$2
    shift 2
    local args=() i=0
    for v in "$@"; do
        args+=("--name=v$i" "--uri=nbd://127.0.0.1:$PORT/default/$v" "--numjobs=$jobs")
        i=$((i + 1))
    done
    local ticks0 busy0 commits0 flushes0 cflushes0 waits0 waited0
    # Settle first: what a fill or an earlier row left in the write-back
    # cache and the page cache goes to the disk before this row starts.
    "$BIN" pool sync default >/dev/null
    sync
    ticks0=$(awk '{print $14 + $15}' "/proc/$PID/stat")
    commits0=$(metric strata_pool_log_commits_total)
    flushes0=$(metric strata_pool_data_flushes_total)
    cflushes0=$(metric strata_pool_commit_data_flushes_total)
    waits0=$(metric strata_pool_log_room_waits_total)
    waited0=$(metric strata_pool_log_room_wait_microseconds_total)
    busy0=$(machine_busy)
    fio --ioengine=nbd --rw=randwrite --bs=4k --iodepth=1 --thread --norandommap \
        --time_based --runtime="$SECS" --group_reporting --output-format=json \
        --output="$DIR/fio.json" "${args[@]}" >/dev/null 2>"$DIR/fio.err" || { cat "$DIR/fio.err" >&2; }
    local ticks=$(($(awk '{print $14 + $15}' "/proc/$PID/stat") - ticks0))
    local commits=$(($(metric strata_pool_log_commits_total) - commits0))
    local flushes=$(($(metric strata_pool_data_flushes_total) - flushes0))
    local cflushes=$(($(metric strata_pool_commit_data_flushes_total || true) - ${cflushes0:-0}))
    local waits=$(($(metric strata_pool_log_room_waits_total || true) - ${waits0:-0}))
    local waited=$(($(metric strata_pool_log_room_wait_microseconds_total || true) - ${waited0:-0}))
    local busy
    busy=$(machine_busy | awk -v a="$busy0" '{split(a, x, " "); printf "%.0f", 100 * ($1 - x[1]) / ($2 - x[2])}')
    python3 - "$label" "$DIR/fio.json" "$ticks" "$(getconf CLK_TCK)" "$busy" "$commits" "$flushes" "$SECS" "$cflushes" "$waits" "$waited" <<'EOF'
import json, sys
label, path = sys.argv[1], sys.argv[2]
ticks, per_second, busy = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
commits, flushes, secs = int(sys.argv[6]), int(sys.argv[7]), float(sys.argv[8])
commit_flushes = int(sys.argv[9])
room_waits, room_waited = int(sys.argv[10]), int(sys.argv[11]) / 1e6
text = open(path).read()
# (fio's nbd engine prints "connected" lines into the same file first.)
jobs = json.loads(text[text.index("{"):])["jobs"]
iops = sum(j["write"]["iops"] for j in jobs)
errors = sum(j.get("error", 0) != 0 for j in jobs)
p99 = max(j["write"]["clat_ns"]["percentile"].get("99.000000", 0) for j in jobs) / 1000
ios = sum(j["write"]["total_ios"] for j in jobs)
cpu = ticks / per_second * 1e6 / max(ios, 1)
print(f"{label:<28} {iops:>9.0f} IOPS   p99 {p99:>8.0f} us   daemon CPU {cpu:>5.1f} us/write   "
      f"machine CPU busy {busy} %   commits/s {commits / secs:.0f}, data flushes/s {flushes / secs:.0f} "
      f"({commit_flushes / secs:.0f} in commits)   "
      f"log-room waits {room_waits} ({room_waited:.1f} writer-s)   "
      f"jobs with errors: {errors}")
open(sys.argv[2] + ".iops", "w").write(f"{iops}\n")
open(sys.argv[2] + ".csv", "w").write(f"{label},{iops:.0f},{p99:.0f},{cpu:.1f},{room_waits},{room_waited:.1f},{errors}\n")
EOF
    [ -z "${BENCH_CSV:-}" ] || cat "$DIR/fio.json.csv" >>"$BENCH_CSV"
    cat "$DIR/fio.json.iops" >"$DIR/$label.iops"
}

# All CPUs' busy and total jiffies from /proc/stat (busy: not idle, not
# waiting for I/O, not stolen), as "busy total".
machine_busy() { awk '/^cpu / {t = 0; for (i = 2; i <= NF; i++) t += $i; print t - $5 - $6 - $9, t}' /proc/stat; }

ratio() { python3 -c "import sys; a, b = (float(open(f).read()) for f in sys.argv[1:]); print(f'{a / b:.1f}x')" "$DIR/$1.iops" "$DIR/$2.iops"; }

for row in $ROWS; do
    case $row in
    fresh)
        volume fresh1 1G
        volume fresh32 1G
        run fresh-qd1 1 fresh1
        run fresh-qd32 32 fresh32
        echo "fresh volume, QD32 / QD1: $(ratio fresh-qd32 fresh-qd1)"
        ;;
    filled)
        volume filled 1G fill
        run filled-qd1 1 filled
        run filled-qd32 32 filled
        echo "filled volume, QD32 / QD1: $(ratio filled-qd32 filled-qd1)"
        ;;
    16vols)
        vols=()
        for i in $(seq 1 16); do
            volume "m$i" 256M fill
            vols+=("m$i")
        done
        run one-of-16-qd1 1 m1
        run 16-vols-qd4 4 "${vols[@]}"
        echo "16 volumes x QD4 / one volume QD1: $(ratio 16-vols-qd4 one-of-16-qd1)"
        ;;
    256)
        volume many 1G
        run 256-connections 256 many
        ;;
    esac
done
grep -c "the log is full" err.txt | sed 's/^/daemon log lines with "the log is full": /' || true
