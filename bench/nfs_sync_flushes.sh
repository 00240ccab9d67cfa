#!/usr/bin/env bash
# FILE_SYNC writes over NFS and the commits they cost: one fresh
# daemon, a file written sequentially first (so the random writes overwrite
# mapped blocks), then 4K random FILE_SYNC writes at QD32 from
# bench/nfs_load.c for SECONDS. Prints the writes per second, the log
# commits and data-device flushes per second from /metrics (the flush
# counter includes the destager's own, made outside the commit lock),
# writes per commit, the daemon's CPU per write and its threads' context
# switches per write.
# A temporary directory, ephemeral 127.0.0.1 ports, the server stopped by PID.
#
# Usage: bench/nfs_sync_flushes.sh [STRATA_BINARY] [SECONDS] [FILE_MIB]
set -euo pipefail
BIN=$(realpath "${1:-$(dirname "$0")/../target/release/strata}")
SECS=${2:-10}
MIB=${3:-256}
HERE=$(realpath "$(dirname "$0")")
DIR=$(mktemp -d)
PID=
trap 'stop_pid "$PID" INT; rm -rf "$DIR"' EXIT
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh"
cc -O2 -o "$DIR/nfs_load" "$HERE/nfs_load.c" -lnfs
start_strata "$BIN"
until grep -q "iscsi listening" "$DIR/out.txt"; do
    kill -0 "$PID" || { cat "$DIR/err.txt"; exit 1; }
    sleep 0.1
done
"$BIN" fs set default/files nfs.squash=none > /dev/null
NFS=$(grep -o "nfs listening on 127.0.0.1:[0-9]*" "$DIR/out.txt" | cut -d: -f2)
API=$(grep -o "api listening on http://127.0.0.1:[0-9]*" "$DIR/out.txt" | grep -o "[0-9]*$")
URL="nfs://127.0.0.1/default/files?nfsport=$NFS&mountport=$NFS&version=3"
metric() { curl -s "http://127.0.0.1:$API/metrics" | awk -v m="$1" '$1 ~ "^"m"[{ ]" {print $2}'; }
switches() { cat /proc/"$PID"/task/*/status | awk '/ctxt_switches/ {s += $2} END {print s}'; }
cpu_ticks() { awk '{print $14 + $15}' /proc/"$PID"/stat; }
"$DIR/nfs_load" "$URL" seqwrite -s "$MIB" -f /f > /dev/null
c0=$(metric strata_pool_log_commits_total); f0=$(metric strata_pool_data_flushes_total)
s0=$(switches); t0=$(cpu_ticks)
RESULT=$("$DIR/nfs_load" "$URL" randwrite -S -q 32 -t "$SECS" -s "$MIB" -f /f | grep '^RESULT')
s1=$(switches); t1=$(cpu_ticks)
c1=$(metric strata_pool_log_commits_total); f1=$(metric strata_pool_data_flushes_total)
echo "$RESULT"
ops=$(echo "$RESULT" | grep -o ' ops=[0-9]*' | cut -d= -f2)
secs=$(echo "$RESULT" | grep -o ' seconds=[0-9.]*' | cut -d= -f2)
hz=$(getconf CLK_TCK)
awk -v ops="$ops" -v secs="$secs" -v c=$((c1 - c0)) -v f=$((f1 - f0)) -v s=$((s1 - s0)) \
    -v t=$((t1 - t0)) -v hz="$hz" 'BEGIN {
    printf "writes/s %.0f  commits/s %.0f  data flushes/s %.0f (%.1f %% of commits)  writes/commit %.1f  daemon CPU us/write %.1f  switches/write %.2f\n",
        ops / secs, c / secs, f / secs, 100 * f / c, ops / c, t * 1e6 / hz / ops, s / ops }'
