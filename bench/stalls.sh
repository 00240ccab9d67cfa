#!/usr/bin/env bash
# Foreground stalls (the target: no I/O stall over 50 ms): 4K random writes
# QD32 on a filled 1 GiB volume over NBD (fio's nbd engine) with every
# I/O's completion latency logged, counted above 20 and 50 ms and grouped
# into stall episodes (100 ms bins holding an I/O over 50 ms); optionally
# while 100 snapshots are taken (one every INTERVAL seconds, each timed at
# the CLI). The same load against nbdkit's file plugin on an equal file
# shows what the machine's disk does by itself.
# A temporary directory, ephemeral 127.0.0.1 ports, servers stopped by PID.
#
# Usage: bench/stalls.sh strata|nbdkit [STRATA_BINARY] [SECONDS]
#        (SNAPSHOTS=1 takes the snapshots; INTERVAL=0.2 by default;
#        STRATA_LOG=info,strata::pool=debug adds the daemon's timings
#        to $DIR/err.txt, kept with the latency logs when KEEP=1; PHASES=1 counts the slow
#        writes' time queued and waiting for commits, from the analytics)
set -euo pipefail
KIND=$1
BIN=$(realpath "${2:-$(dirname "$0")/../target/release/strata}")
SECONDS_RUN=${3:-40}
LIB=$(realpath "$(dirname "$0")/lib.sh")
DIR=$(mktemp -d)
PID=
# KEEP=1 keeps the logs, never the pool (gigabytes once snapshots hold data).
trap 'stop_pid "$PID"; rm -rf "$DIR/d" "$DIR/img"; [ -n "${KEEP:-}" ] && echo "kept $DIR" || rm -rf "$DIR"' EXIT
# shellcheck source=bench/lib.sh
source "$LIB" # stop_pid, for the trap
cd "$DIR"
if [ "$KIND" = strata ]; then
    # shellcheck source=bench/lib.sh
    source "$LIB"
    start_strata "$BIN"
    "$BIN" volume create default/b --size 1G >/dev/null
    URI=nbd://127.0.0.1:$PORT/default/b
else
    # shellcheck source=bench/lib.sh
    source "$LIB"
    start_nbdkit
fi
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=4 --size=1G --output-format=terse >/dev/null
fio --name=warm --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=32 --size=1G --time_based --runtime=6 \
    --output-format=terse >/dev/null
SNAPPER=
if [ -n "${SNAPSHOTS:-}" ] && [ "$KIND" = strata ]; then
    (
        sleep 2
        : >create_ms.txt
        for n in $(seq 100); do
            start=$(date +%s%N)
            "$BIN" snapshot create "default/b@s$n" >/dev/null
            echo $(( ($(date +%s%N) - start) / 1000000 )) >>create_ms.txt
            sleep "${INTERVAL:-0.2}"
        done
    ) &
    SNAPPER=$!
fi
fio --name=w --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=32 --size=1G --time_based \
    --runtime="$SECONDS_RUN" --write_lat_log=lat --log_avg_msec=0 --output-format=terse >fio.txt
# terse v3: 49 write IOPS.
echo "$KIND: write IOPS $(awk -F';' 'NF > 40 {print $49}' fio.txt)"
# lat_clat.1.log: time (ms), completion latency (ns), direction, size.
awk -F', ' '{ if ($2 > 20000000) a++; if ($2 > 50000000) { b++; if (!(int($1 / 100) in bins)) { bins[int($1 / 100)] = 1; e++ } } if ($2 > m) m = $2 }
    END { printf "I/Os over 20 ms: %d, over 50 ms: %d, stall episodes: %d, max %.1f ms\n", a, b, e, m / 1e6 }' lat_clat.1.log
if [ -n "${PHASES:-}" ] && [ "$KIND" = strata ]; then
    # Where the slow writes' time went (the analytics' latency parts): how
    # many writes took over 50 ms in all, and how many spent over 50 ms
    # queued before running or waiting for intent-log commits.
    API=$(sed -n 's/^strata: api listening on //p' out.txt | head -1)
    TOKEN=$(cat d/api.token)
    for part in total queued commit; do
        curl -s -H "Authorization: Bearer $TOKEN" \
            "$API/v1/analytics/stats?volume=default/b&op=write&phase=$part&min_ns=50000000&from=$(( $(date +%s) - SECONDS_RUN - 5 ))" |
            python3 -c "import json,sys; t=json.load(sys.stdin); print('writes with $part over 50 ms:', t['ops'])"
    done
fi
if [ -n "$SNAPPER" ]; then
    wait "$SNAPPER"
    sort -n create_ms.txt | awk '{a[NR] = $1} END {printf "snapshot create at the CLI (ms): p50 %d, p99 %d, max %d (n=%d)\n", a[int(NR * 0.5)], a[int(NR * 0.99)], a[NR], NR}'
fi
