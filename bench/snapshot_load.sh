#!/usr/bin/env bash
# Snapshots under load: 4K random writes QD32 on a
# filled 1 GiB volume (fio's nbd engine, one strata server) without
# snapshots, while 100 snapshots are taken (one every 200 ms, each timed at
# the CLI), and in the steady state after them; then the deletion of a
# snapshot holding 4 GiB of data only it maps (a 4 GiB volume rewritten
# after the snapshot), timed, with foreground reads running meanwhile.
# Ratios within one run only; a temporary data directory, ephemeral
# 127.0.0.1 ports, the server stopped by PID.
#
# Usage: bench/snapshot_load.sh [STRATA_BINARY] [SECONDS_PER_PHASE]
# (DELETE_ONLY=1 runs the deletion part alone, CREATE_ONLY=1 the rest;
# BENCH_CSV=FILE appends "key,value..." lines: phase,LABEL,IOPS,CPU_US,
# P50,P99,P999,MAX; create_cli_ms,P50,P99,MAX; delete_4g_ms,MS;
# read_p99_us,IDLE,FREEING; freed_ms,MS.)
set -euo pipefail
# shellcheck source=bench/lib.sh
source "$(dirname "$0")/lib.sh" # bench_csv
BIN=${1:-$(dirname "$0")/../target/release/strata}
BIN=$(realpath "$BIN")
SECONDS_PER_PHASE=${2:-20}
DIR=$(mktemp -d)
trap 'kill "$PID" 2>/dev/null || true; rm -rf "$DIR"' EXIT
cd "$DIR"
# Debug lines of snapshot creation give its time inside the daemon.
STRATA_LOG=${STRATA_LOG:-info,strata::control::manager::snapshots=debug} "$BIN" serve --nfs 127.0.0.1:0 --data-dir ./d --nbd 127.0.0.1:0 --api 127.0.0.1:0 --iscsi 127.0.0.1:0 >out.txt 2>"${SERVER_LOG:-err.txt}" &
PID=$!
for _ in $(seq 100); do grep -q "nbd listening" out.txt 2>/dev/null && break; sleep 0.1; done
PORT=$(sed -n 's/^strata: nbd listening on 127.0.0.1://p' out.txt)
s() { "$BIN" "$@" --data-dir ./d; }
s volume create default/b --size 1G >/dev/null
URI=nbd://127.0.0.1:$PORT/default/b
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=4 --size=1G --output-format=terse >/dev/null
s pool sync default >/dev/null

ticks() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
# fio terse v3: 49 write IOPS; write clat percentiles in fields 59.. ("p=v"); 56
# clat max (µs).
phase() { # label seconds seed [command to run meanwhile]
    local before after out iops
    before=$(ticks)
    fio --name=w --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=32 --size=1G \
        --time_based --runtime="$2" --randseed="$3" --output-format=terse \
        --percentile_list=50:99:99.9 >fio.txt &
    local fio_pid=$!
    if [ $# -ge 4 ]; then sleep 1; eval "$4"; fi
    wait $fio_pid
    after=$(ticks)
    out=$(cat fio.txt)
    iops=$(echo "$out" | awk -F';' 'NF > 40 {print $49}')
    local p50 p99 p999 max
    p50=$(echo "$out" | awk -F';' 'NF > 40 {print $59}' | cut -d= -f2)
    p99=$(echo "$out" | awk -F';' 'NF > 40 {print $60}' | cut -d= -f2)
    p999=$(echo "$out" | awk -F';' 'NF > 40 {print $61}' | cut -d= -f2)
    max=$(echo "$out" | awk -F';' 'NF > 40 {print $56}')
    echo "| $1 | $iops | $(( (after - before) * 1000000 / $(getconf CLK_TCK) / (iops * $2) )) | ${p50} / ${p99} / ${p999} | $max |"
    bench_csv phase "$1" "$iops" "$(( (after - before) * 1000000 / $(getconf CLK_TCK) / (iops * $2) ))" "$p50" "$p99" "$p999" "$max"
}
take_snapshots() {
    : >create_ms.txt
    for n in $(seq 100); do
        local start
        start=$(date +%s%N)
        s snapshot create "default/b@auto$n" >/dev/null
        echo $(( ($(date +%s%N) - start) / 1000000 )) >>create_ms.txt
        sleep 0.2
    done
}
if [ -z "${DELETE_ONLY:-}" ]; then
echo "| phase | write IOPS | server CPU µs/op | clat p50 / p99 / p99.9 (µs) | clat max (µs) |"
echo "|---|---|---|---|---|"
phase "warm-up (not counted)" 6 9
phase "no snapshot" "$SECONDS_PER_PHASE" 1
phase "100 snapshots taken during the run" "$((SECONDS_PER_PHASE + 25))" 2 take_snapshots
phase "steady state with 100 snapshots" "$SECONDS_PER_PHASE" 3
sort -n create_ms.txt | awk '{a[NR]=$1} END {printf "snapshot create at the CLI under that load (ms): p50 %d, p99 %d, max %d (n=%d)\n", a[int(NR*0.5)], a[int(NR*0.99)], a[NR], NR}'
bench_csv create_cli_ms "$(sort -n create_ms.txt | awk '{a[NR]=$1} END {printf "%d,%d,%d", a[int(NR*0.5)], a[int(NR*0.99)], a[NR]}')"
# The same creates inside the daemon (the engine's part: writes stopped,
# the record appended and committed), from its debug lines.
sed -n 's/.*snapshot create: \([0-9]*\) µs in the engine.*/\1/p' "${SERVER_LOG:-err.txt}" | sort -n |
    awk 'NR > 0 {a[NR]=$1} END {if (NR) printf "snapshot create in the daemon (ms): p50 %.1f, p99 %.1f, max %.1f (n=%d)\n", a[int(NR*0.5)]/1000, a[int(NR*0.99)]/1000, a[NR]/1000, NR}'
# The CLI's own cost (a process, the socket, the token): idle creates.
: >idle_ms.txt
for n in $(seq 20); do
    start=$(date +%s%N)
    s snapshot create "default/b@idle$n" >/dev/null
    echo $(( ($(date +%s%N) - start) / 1000000 )) >>idle_ms.txt
done
sort -n idle_ms.txt | awk '{a[NR]=$1} END {printf "snapshot create at the CLI, idle (ms): p50 %d, max %d (n=%d)\n", a[int(NR*0.5)], a[NR], NR}'
[ -n "${CREATE_ONLY:-}" ] && exit 0

fi

# Deleting a snapshot that alone holds 4 GiB.
s volume create default/big --size 4G >/dev/null
BIG=nbd://127.0.0.1:$PORT/default/big
fio --name=fill --ioengine=nbd --uri="$BIG" --rw=write --bs=1M --iodepth=4 --size=4G --output-format=terse >/dev/null
s snapshot create default/big@old >/dev/null
fio --name=rewrite --ioengine=nbd --uri="$BIG" --rw=write --bs=1M --iodepth=4 --size=4G --output-format=terse >/dev/null
s pool sync default >/dev/null
s snapshot list default/big
# Foreground 4K reads QD1 on the other volume: idle, then while the
# snapshot is deleted and its space freed in the background.
reader() { # seconds
    fio --name=r --ioengine=nbd --uri="$URI" --rw=randread --bs=4k --iodepth=1 --size=1G --time_based --runtime="$1" \
        --output-format=terse --percentile_list=50:99
}
p99() { awk -F';' 'NF > 40 {print $19}' | cut -d= -f2; }
idle=$(reader 5 | p99)
freeing() { s pool status default | awk 'NR == 2 {print $5}'; }
reader 15 >read.txt &
READER=$!
sleep 2
start=$(date +%s%N)
s snapshot delete default/big@old
deleted_ms=$(( ($(date +%s%N) - start) / 1000000 ))
echo "snapshot delete of 4 GiB only it holds: $deleted_ms ms at the CLI; freeing: $(freeing)"
bench_csv delete_4g_ms "$deleted_ms"
wait "$READER" || echo "the foreground read failed: $(cat read.txt)"
echo "foreground 4K read QD1 clat p99: idle ${idle} µs, while freeing $(p99 <read.txt) µs (freeing left: $(freeing))"
bench_csv read_p99_us "$idle" "$(p99 <read.txt)"
while [ "$(freeing)" != "0B" ]; do sleep 0.2; done
echo "space freed $(( ($(date +%s%N) - start) / 1000000 )) ms after the delete began"
bench_csv freed_ms "$(( ($(date +%s%N) - start) / 1000000 ))"
