#!/usr/bin/env bash
# A first look at what a snapshot costs writes: 4K random writes, QD32, on a
# filled 1 GiB volume of one strata server (fio's nbd engine): without a
# snapshot, right after one (first overwrites: copy on write), and after.
# Ratios within one run only; the data directory is a temporary one and the
# server listens on ephemeral 127.0.0.1 ports and is stopped by PID.
#
# Usage: bench/snapshot_overwrites.sh [STRATA_BINARY]
set -euo pipefail
BIN=${1:-$(dirname "$0")/../target/release/strata}
BIN=$(realpath "$BIN")
DIR=$(mktemp -d)
trap 'kill "$PID" 2>/dev/null || true; rm -rf "$DIR"' EXIT
cd "$DIR"
"$BIN" serve --nfs 127.0.0.1:0 --data-dir ./d --nbd 127.0.0.1:0 --api 127.0.0.1:0 --iscsi 127.0.0.1:0 >out.txt 2>err.txt &
PID=$!
for _ in $(seq 100); do grep -q "nbd listening" out.txt 2>/dev/null && break; sleep 0.1; done
PORT=$(sed -n 's/^strata: nbd listening on 127.0.0.1://p' out.txt)
"$BIN" volume create default/b --size 1G --data-dir ./d
URI=nbd://127.0.0.1:$PORT/default/b
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=4 --size=1G --output-format=terse >/dev/null
"$BIN" pool sync default --data-dir ./d

ticks() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
run() { # label seconds seed
    local before after out iops
    before=$(ticks)
    out=$(fio --name=w --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=32 --size=1G \
        --time_based --runtime="$2" --randseed="$3" --output-format=terse)
    after=$(ticks)
    iops=$(echo "$out" | awk -F';' 'NF > 40 {print $49}')
    echo "$1: $iops IOPS, server CPU $(( (after - before) * 1000000 / $(getconf CLK_TCK) / (iops * $2) )) µs/op"
}
run "warm-up (not counted)" 6 9
run "no snapshot" 6 1
start=$(date +%s%N)
"$BIN" snapshot create default/b@s1 --data-dir ./d
echo "snapshot create: $(( ($(date +%s%N) - start) / 1000000 )) ms (CLI round trip, the volume's dirty cache destaged first)"
run "right after the snapshot (first overwrites)" 3 2
run "after that" 6 3
"$BIN" snapshot list --data-dir ./d
