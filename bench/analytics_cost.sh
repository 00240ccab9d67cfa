#!/usr/bin/env bash
# The cost of recording analytics: the same daemon binary with
# analytics on and with `--no-analytics`, side by side in one run: 4K random
# read and write QD32 (IOPS, server CPU µs per operation) and 4K random
# read QD1 (p50 latency), over NBD with fio's nbd engine, on a filled 1 GiB
# volume. ROUNDS rounds (default 4) alternate the two, and which goes
# first, so drift and position hit both alike; medians are reported.
# A temporary directory, ephemeral 127.0.0.1 ports, servers stopped by PID.
#
# Usage: bench/analytics_cost.sh [STRATA_BINARY] [SECONDS]
#        (BENCH_CSV=FILE appends each median as "test,field,on,off")
set -euo pipefail
BIN=$(realpath "${1:-$(dirname "$0")/../target/release/strata}")
RUNTIME=${2:-10}
ROUNDS=${ROUNDS:-4}
LIB=$(realpath "$(dirname "$0")/lib.sh")
# shellcheck source=bench/lib.sh
source "$LIB" # bench_csv
TOP=$(mktemp -d)
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; rm -rf "$TOP"' EXIT
ticks() { awk '{print $14 + $15}' "/proc/$PID/stat"; }

# One fio job; prints "IOPS CPU_US_PER_OP P50_US".
job() {
    local rw=$1 qd=$2
    local c0 c1 out
    c0=$(ticks)
    out=$(fio --name=j --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/default/b" --rw="$rw" --bs=4k \
        --iodepth="$qd" --size=1G --time_based --runtime="$RUNTIME" --output-format=json)
    c1=$(ticks)
    python3 -c '
import json, os, sys
text = sys.argv[1]
job = json.loads(text[text.index("{"):])["jobs"][0]
side = job["read"] if job["read"]["io_bytes"] else job["write"]
ops = side["total_ios"]
hz = os.sysconf("SC_CLK_TCK")
p50 = side["clat_ns"]["percentile"]["50.000000"] / 1000
iops = side["iops"]
print(f"{iops:.0f} {(int(sys.argv[3]) - int(sys.argv[2])) / hz * 1e6 / ops:.2f} {p50:.1f}")
' "$out" "$c0" "$c1"
}

declare -A RESULTS
for round in $(seq "$ROUNDS"); do
    # Odd rounds start with analytics on, even rounds with them off: the
    # first daemon of a round runs on a quieter page cache and disk.
    order="on off"
    [ $((round % 2)) -eq 0 ] && order="off on"
    for mode in $order; do
        DIR=$TOP/$mode-$round
        mkdir -p "$DIR"
        # shellcheck source=bench/lib.sh
        source "$LIB"
        if [ "$mode" = off ]; then
            start_strata "$BIN" --no-analytics
        else
            start_strata "$BIN"
        fi
        "$BIN" volume create default/b --size 1G >/dev/null
        fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/default/b" --rw=write --bs=1M --iodepth=4 \
            --size=1G --output-format=terse >/dev/null
        RESULTS[$mode-randread-32-$round]=$(job randread 32)
        RESULTS[$mode-randwrite-32-$round]=$(job randwrite 32)
        RESULTS[$mode-randread-1-$round]=$(job randread 1)
        kill "$PID"
        wait "$PID" 2>/dev/null || true
        PID=
        echo "round $round analytics $mode: randread QD32 ${RESULTS[$mode-randread-32-$round]}," \
            "randwrite QD32 ${RESULTS[$mode-randwrite-32-$round]}, randread QD1 ${RESULTS[$mode-randread-1-$round]}" >&2
    done
done
# Medians over the rounds.
printf '| 4K, NBD | analytics on | analytics off | on / off |\n|---|---|---|---|\n'
for test in randread-32 randwrite-32 randread-1; do
    for field in 1 2 3; do
        [ "$test" = randread-1 ] && [ "$field" != 3 ] && [ "$field" != 1 ] && continue
        [ "$test" != randread-1 ] && [ "$field" = 3 ] && continue
        med() { for r in $(seq "$ROUNDS"); do echo "${RESULTS[$1-$test-$r]}" | cut -d' ' -f"$field"; done | sort -n | sed -n "$(( (ROUNDS + 1) / 2 ))p"; }
        on=$(med on) off=$(med off)
        name=$(case $field in 1) echo "IOPS";; 2) echo "server CPU µs/op";; 3) echo "p50 µs";; esac)
        printf '| %s %s | %s | %s | %.3f |\n' "$test" "$name" "$on" "$off" "$(python3 -c "print($on / $off)")"
        bench_csv "$test" "$(case $field in 1) echo iops;; 2) echo cpu_us_per_op;; 3) echo p50_us;; esac)" "$on" "$off"
    done
done
