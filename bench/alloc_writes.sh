#!/usr/bin/env bash
# Allocating writes: 1M sequential writes (fio's nbd engine, QD8) into three
# fresh volumes of SIZE in a row on one strata server (default pool), with
# the daemon's CPU time for each from /proc. A temporary data directory,
# ephemeral 127.0.0.1 ports, the server stopped by PID.
#
# Usage: bench/alloc_writes.sh [STRATA_BINARY] [SIZE]
set -euo pipefail
BIN=$(realpath "${1:-$(dirname "$0")/../target/release/strata}")
SIZE=${2:-4G}
DIR=$(mktemp -d)
trap 'kill "$PID" 2>/dev/null || true; rm -rf "$DIR"' EXIT
. "$(dirname "$0")/lib.sh"
start_strata "$BIN"
ticks() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
for volume in a b c; do
    "$BIN" volume create "default/$volume" --size "$SIZE" >/dev/null
    before=$(ticks)
    mibs=$(fio --name=seq --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/default/$volume" --rw=write --bs=1M \
        --iodepth=8 --size="$SIZE" --output-format=terse | awk -F';' 'NF > 40 {printf "%.0f", $48 / 1024}')
    after=$(ticks)
    echo "volume $volume: $mibs MiB/s, daemon CPU $(echo "$before $after $(getconf CLK_TCK)" | awk '{printf "%.1f", ($2 - $1) / $3}') s"
done
