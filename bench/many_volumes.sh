#!/usr/bin/env bash
# Many volumes written at once on the default pool: VOLUMES
# volumes of SIZE, filled first with 1 MiB writes when FILL=1 (then the
# run waits for the write-back cache to drain), then 4K random writes
# through fio's nbd engine, 4 connections x QD1 per volume, for SECONDS.
# Prints IOPS, the p99 of completion latency, the daemon's CPU per write,
# and over the run: how often writers found the pool's shared locks held
# (allocator, the log's pending records) and for how long, and the block-map
# and checksum page caches' size and misses (pages read from the store).
# SYNC=always makes the volumes sync=always.
# A temporary directory, ephemeral 127.0.0.1 ports, the server stopped by PID.
#
# Usage: [VOLUMES=16] [SIZE=1G] [FILL=1] [SYNC=standard] bench/many_volumes.sh [STRATA_BINARY] [SECONDS]
set -euo pipefail
BIN=$(realpath "${1:-$(dirname "$0")/../target/release/strata}")
SECS=${2:-10}
VOLUMES=${VOLUMES:-16}
SIZE=${SIZE:-1G}
SYNC=${SYNC:-standard}
LIB=$(realpath "$(dirname "$0")/lib.sh")
DIR=$(mktemp -d)
PID=
trap 'stop_pid "$PID"; rm -rf "$DIR"' EXIT
# shellcheck source=bench/lib.sh
source "$LIB"
start_strata "$BIN" --max-connections-per-client 512
API=$(grep -o "api listening on http://127.0.0.1:[0-9]*" out.txt | grep -o "[0-9]*$")
metrics() { curl -s "http://127.0.0.1:$API/metrics"; }
metric() { metrics | awk -v m="$1" '$1 ~ "^"m"[{ ]" {print $2}'; }

args=()
for i in $(seq 1 "$VOLUMES"); do
    "$BIN" volume create "default/v$i" --size "$SIZE" >/dev/null
    "$BIN" volume set "default/v$i" "sync=$SYNC" >/dev/null
    if [ -n "${FILL:-}" ]; then
        fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/default/v$i" --rw=write --bs=1M \
            --iodepth=4 --size="$SIZE" --output-format=terse >/dev/null
    fi
    args+=("--name=v$i" "--uri=nbd://127.0.0.1:$PORT/default/v$i" "--numjobs=4")
done
for _ in $(seq 1200); do [ "$(metric strata_pool_dirty_bytes)" = 0 ] && break; sleep 0.5; done

SERIES="allocator_lock_waits_total allocator_lock_wait_microseconds_total log_lock_waits_total
        log_lock_wait_microseconds_total map_cache_misses_total checksum_cache_misses_total"
declare -A before
for s in $SERIES; do before[$s]=$(metric "strata_pool_$s"); done
ticks0=$(awk '{print $14 + $15}' "/proc/$PID/stat")
fio --ioengine=nbd --rw=randwrite --bs=4k --iodepth=1 --thread --norandommap --time_based --runtime="$SECS" \
    --group_reporting --output-format=json --output="$DIR/fio.json" "${args[@]}" >/dev/null 2>"$DIR/fio.err" ||
    cat "$DIR/fio.err" >&2
ticks=$(($(awk '{print $14 + $15}' "/proc/$PID/stat") - ticks0))
python3 - "$DIR/fio.json" "$ticks" "$(getconf CLK_TCK)" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
w = job["write"]
cpu = int(sys.argv[2]) / int(sys.argv[3]) * 1e6 / max(w["total_ios"], 1)
print(f'{w["iops"]:.0f} writes/s   p99 {w["clat_ns"]["percentile"]["99.000000"] / 1000:.0f} us   '
      f'daemon CPU {cpu:.1f} us/write   ({w["total_ios"]} writes)')
PY
for s in $SERIES; do echo "  $s: +$(($(metric "strata_pool_$s") - ${before[$s]}))"; done
metrics | grep -E "^strata_pool_(map|checksum)_cache_(max_)?pages" | sed 's/^/  /'
