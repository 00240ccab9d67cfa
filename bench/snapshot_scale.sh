#!/usr/bin/env bash
# Snapshots at scale (the target: 1,000 snapshots per volume and 10,000
# per pool without the system degrading). One strata server on a
# temporary data directory, ephemeral 127.0.0.1 ports, stopped by PID.
#
# One volume (1 GiB, 16K blocks, filled and synced); between consecutive
# snapshots WRITE_KIB of random 4K writes (qemu-io aio_write over NBD: one
# short process per interval, where fio's start-up alone costs ~0.35 s), so
# every snapshot owns page copies and data of its own. Measured:
#   - `snapshot create` at the CLI, p50/p99/max over WINDOW creates at 0,
#     100 and N existing snapshots (the last window's snapshots are deleted
#     again, newest first, timed as well);
#   - 4K random writes QD32 (fio's nbd engine): IOPS and server CPU µs/op
#     (utime+stime ticks of /proc/PID/stat) with 0 and N snapshots;
#   - `snapshot list`, `volume get` and `volume list` with N snapshots;
#   - daemon stop (SIGTERM, by PID) and restart time until NBD listens;
#   - deleting the snapshot in the middle of N, then the oldest.
# Then VOLUMES-1 more volumes get N snapshots each (one `snapshot create`
# of all of them per round, a few 4K writes into one volume per round), so
# the pool holds VOLUMES x N: `snapshot list` of all, `volume list`, one
# more create, restart.
#
# Usage: bench/snapshot_scale.sh [STRATA_BINARY] [N=1000] [VOLUMES=10] [WRITE_KIB=1024] [SECONDS=10]
set -euo pipefail
BIN=${1:-$(dirname "$0")/../target/release/strata}
BIN=$(realpath "$BIN")
N=${2:-1000}
VOLUMES=${3:-10}
WRITE_KIB=${4:-1024}
SECONDS_PER_PHASE=${5:-10}
WINDOW=50
[ "$N" -ge $((100 + WINDOW)) ] || WINDOW=$((N / 3 > 0 ? N / 3 : 1))
command -v qemu-io >/dev/null || { echo "needs qemu-io (qemu-utils)" >&2; exit 1; }
command -v fio >/dev/null || { echo "needs fio" >&2; exit 1; }
DIR=$(mktemp -d)
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID"; rm -rf "$DIR"' EXIT
cd "$DIR"

now_us() { echo $(($(date +%s%N) / 1000)); }
# Starts the server; sets PID and PORT; prints the µs until NBD listens.
start() {
    local began
    began=$(now_us)
    : >out.txt
    "$BIN" serve --nfs 127.0.0.1:0 --data-dir ./d --nbd 127.0.0.1:0 --api 127.0.0.1:0 --iscsi 127.0.0.1:0 >out.txt 2>>err.txt &
    PID=$!
    for _ in $(seq 6000); do grep -q "nbd listening" out.txt 2>/dev/null && break; sleep 0.01; done
    grep -q "nbd listening" out.txt || { echo "the server did not start:" >&2; tail err.txt >&2; exit 1; }
    echo $(($(now_us) - began)) >start_us.txt
    PORT=$(sed -n 's/^strata: nbd listening on 127.0.0.1://p' out.txt)
}
# Stops the server by PID (SIGTERM: a clean shutdown); the µs it took go
# to stop_us.txt (not a subshell: only this shell can wait for the PID).
stop() {
    local began
    began=$(now_us)
    kill "$PID"
    wait "$PID" || true
    PID=
    echo $(($(now_us) - began)) >stop_us.txt
}
s() { "$BIN" "$@" --data-dir ./d; }
# Runs a command, prints its wall time in ms (one decimal).
timed() {
    local began
    began=$(now_us)
    "$@" >/dev/null
    awk -v us=$(($(now_us) - began)) 'BEGIN {printf "%.1f", us / 1000}'
}
# p50 / p99 / max of the numbers in a file.
pct() {
    sort -n "$1" | awk '{a[NR] = $1} END {
        if (NR == 0) { print "-"; exit }
        i50 = int(NR * 0.5 + 0.5); i99 = int(NR * 0.99 + 0.5); if (i50 < 1) i50 = 1; if (i99 < 1) i99 = 1
        printf "%s / %s / %s (n=%d)", a[i50], a[i99], a[NR], NR }'
}
# The median of REPEAT timings of a command.
median_ms() {
    local repeat=$1
    shift
    : >m.txt
    for _ in $(seq "$repeat"); do timed "$@" >>m.txt; echo >>m.txt; done
    sort -n m.txt | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'
}
# WRITE_KIB (or $3) of random 4K writes into volume $1 (seeded by $2), in
# its first $4 bytes (default: all of it).
scribble() {
    local kib=${3:-$WRITE_KIB}
    awk -v seed="$2" -v n=$((kib / 4)) -v blocks=$((${4:-$SIZE} / 4096)) 'BEGIN {
        srand(seed); printf "-c\naio_write -P %d %d 4k\n", seed % 251, int(rand() * blocks) * 4096
        for (i = 1; i < n; i++) printf "-c\naio_write -P %d %d 4k\n", (seed + i) % 251, int(rand() * blocks) * 4096
        printf "-c\naio_flush\n" }' | tr '\n' '\0' | xargs -0 qemu-io -f raw "nbd://127.0.0.1:$PORT/default/$1" >/dev/null
}
ticks() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
# 4K random reads QD1 of export $1 for 5 s: IOPS.
randread() {
    fio --name=r --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/$1" --rw=randread --bs=4k --iodepth=1 --size=1G \
        --time_based --runtime=5 --output-format=terse | awk -F';' 'NF > 40 {print $8}'
}
# 4K random writes QD32 for SECONDS_PER_PHASE into volume $2 (default v0):
# "IOPS | CPU µs/op".
randwrite() {
    local before after iops
    before=$(ticks)
    iops=$(fio --name=w --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/default/${2:-v0}" --rw=randwrite --bs=4k --iodepth=32 \
        --size=1G --time_based --runtime="$SECONDS_PER_PHASE" --randseed="$1" --output-format=terse |
        awk -F';' 'NF > 40 {print $49}')
    after=$(ticks)
    echo "$iops | $(((after - before) * 1000000 / $(getconf CLK_TCK) / (iops * SECONDS_PER_PHASE)))"
}
# Takes snapshots v0@sFIRST..v0@sLAST, each after WRITE_KIB of writes;
# appends each create's ms to $3 (if given).
take() {
    for n in $(seq "$1" "$2"); do
        scribble v0 "$n"
        if [ -n "${3:-}" ]; then
            timed s snapshot create "default/v0@s$n" >>"$3"
            echo >>"$3"
        else
            s snapshot create "default/v0@s$n" >/dev/null
        fi
    done
}

SIZE=$((1 << 30))
start
began_all=$(date +%s)
s volume create default/v0 --size 1G >/dev/null
fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/default/v0" --rw=write --bs=1M --iodepth=4 --size=1G \
    --output-format=terse >/dev/null
s pool sync default >/dev/null
echo "# one volume (1 GiB, 16K blocks), ${WRITE_KIB} KiB of random 4K writes between snapshots, N=$N"
randwrite 9 >/dev/null # warm-up: the first overwrites of a fresh fill run slower
echo "| 4K randwrite QD32, ${SECONDS_PER_PHASE} s | IOPS | server CPU µs/op |"
echo "|---|---|---|"
echo "| 0 snapshots | $(randwrite 1) |"
: >create0.txt
: >create100.txt
: >createN.txt
take 1 1 create0.txt
# Right after a snapshot every first write to a map page copies it and a
# 4K write to a shared 16K block copies the block: compare like with like.
echo "| 1 snapshot, right after it | $(randwrite 2) |"
s pool sync default >/dev/null
take 2 "$WINDOW" create0.txt
take $((WINDOW + 1)) 100
take 101 $((100 + WINDOW)) create100.txt
take $((101 + WINDOW)) "$N"
echo "| $N snapshots, right after the last | $(randwrite 3) |"
s pool sync default >/dev/null
take $((N + 1)) $((N + WINDOW)) createN.txt
: >deleteN.txt
for n in $(seq $((N + WINDOW)) -1 $((N + 1))); do
    timed s snapshot delete "default/v0@s$n" >>deleteN.txt
    echo >>deleteN.txt
done
echo
echo "snapshot create at the CLI, ms p50 / p99 / max:"
echo "- with 0..$((WINDOW - 1)) existing: $(pct create0.txt)"
echo "- with 100..$((99 + WINDOW)) existing: $(pct create100.txt)"
echo "- with $N..$((N + WINDOW - 1)) existing: $(pct createN.txt)"
echo "snapshot delete of the newest with $N..$((N + WINDOW - 1)) existing, ms: $(pct deleteN.txt)"
s pool sync default >/dev/null
echo "with $N snapshots of the volume (median of 5, ms):"
echo "- snapshot list default/v0: $(median_ms 5 s snapshot list default/v0)"
echo "- snapshot list (all): $(median_ms 5 s snapshot list)"
echo "- volume get default/v0: $(median_ms 5 s volume get default/v0)"
echo "- volume list: $(median_ms 5 s volume list)"
echo "- 4K random reads QD1 of the oldest snapshot (v0@s1): $(randread default/v0@s1) IOPS; of the volume: $(randread default/v0) IOPS"
stop
start
echo "- daemon stop (SIGTERM) $(($(cat stop_us.txt) / 1000)) ms; start to NBD listening $(($(cat start_us.txt) / 1000)) ms"
echo "- first volume get after the start: $(timed s volume get default/v0) ms; first snapshot list default/v0: $(timed s snapshot list default/v0) ms"
echo "- snapshot delete of the middle one (v0@s$((N / 2))): $(timed s snapshot delete "default/v0@s$((N / 2))") ms"
echo "- snapshot delete of the oldest (v0@s1): $(timed s snapshot delete default/v0@s1) ms"

# What the count costs writes, apart from the data the snapshots hold: a
# fresh volume with 1 snapshot, then with N taken with no write between
# (same pool, minutes apart instead of the first part's quarter hour).
s volume create default/c --size 1G >/dev/null
fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/default/c" --rw=write --bs=1M --iodepth=4 --size=1G \
    --output-format=terse >/dev/null
s pool sync default >/dev/null
randwrite 8 c >/dev/null
s snapshot create default/c@c0 >/dev/null
echo "| c: a fresh volume, 1 snapshot, right after it | $(randwrite 4 c) |"
s pool sync default >/dev/null
for n in $(seq 1 $((N - 1))); do s snapshot create "default/c@c$n" >/dev/null; done
echo "| c: $N snapshots (no write between them but the last), right after the last | $(randwrite 5 c) |"
s pool sync default >/dev/null
s snapshot create default/v0@again >/dev/null
echo "| v0: $((N - 1)) snapshots holding data, right after the last | $(randwrite 6) |"
echo "(first part: $(($(date +%s) - began_all)) s)"

if [ "$VOLUMES" -gt 1 ]; then
    began_pool=$(date +%s)
    names=()
    for v in $(seq 1 $((VOLUMES - 1))); do
        s volume create "default/v$v" --size 1G >/dev/null
        names+=("default/v$v")
    done
    # v1 holds data (the snapshot reads below read it); the others do not need to.
    fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/default/v1" --rw=write --bs=1M --iodepth=4 --size=1G \
        --output-format=terse >/dev/null
    # v0 has N - 2 now; it gets 2 more, every other volume N.
    take $((N + 1)) $((N + 2))
    : >poolcreate.txt
    for n in $(seq 1 "$N"); do
        v=$(((n - 1) % (VOLUMES - 1) + 1))
        scribble "v$v" "$n" 64 $((16 << 20))
        if [ $((n % (N / 10 > 0 ? N / 10 : 1))) -eq 0 ]; then
            timed s snapshot create "${names[@]/%/@p$n}" >>poolcreate.txt
            echo >>poolcreate.txt
        else
            s snapshot create "${names[@]/%/@p$n}" >/dev/null
        fi
    done
    s pool sync default >/dev/null
    total=$(s snapshot list | tail -n +2 | wc -l)
    echo
    echo "# the pool: $VOLUMES volumes, $total snapshots ($((VOLUMES - 1)) taken together per create, 64 KiB written into the first 16 MiB of one volume between)"
    echo "- snapshot create of $((VOLUMES - 1)) at once, sampled every $((N / 10 > 0 ? N / 10 : 1))th, ms: $(pct poolcreate.txt)"
    echo "- snapshot list (all): $(median_ms 3 s snapshot list) ms"
    echo "- snapshot list default/v1: $(median_ms 3 s snapshot list default/v1) ms"
    echo "- volume list: $(median_ms 3 s volume list) ms"
    echo "- volume get default/v1: $(median_ms 3 s volume get default/v1) ms"
    echo "- 4K random reads QD1 of the oldest snapshot of v1 (most of its map pages never change after it): $(randread default/v1@p1) IOPS"
    echo "- snapshot create (one more, v0): $(scribble v0 99999 && timed s snapshot create default/v0@last) ms"
    stop
    start
    echo "- daemon stop (SIGTERM) $(($(cat stop_us.txt) / 1000)) ms; start to NBD listening $(($(cat start_us.txt) / 1000)) ms"
    echo "- first snapshot list (all) after the start: $(timed s snapshot list) ms; first volume list: $(timed s volume list) ms"
    echo "(pool part: $(($(date +%s) - began_pool)) s)"
fi
stop
