#!/usr/bin/env bash
# Recovery time after kill -9 with 10 GiB written: start strata on a fresh
# data directory, write 10 GiB to a volume with fio (1 MiB sequential writes,
# plus 4 KiB random overwrites so the log and dirty chunks are not empty),
# kill the daemon with SIGKILL, and time the restart until it serves again.
#
# Usage: bench/recovery.sh [GiB]   (default 10; STRATA_BIN=PATH runs another binary)
#        (BENCH_CSV=FILE appends "gib,seconds,log_records,suspect_chunks,reads_ok")
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh # bench_csv
gib=${1:-10}
BIN=${STRATA_BIN:-target/release/strata}
[ -x "$BIN" ] || cargo build --release
work=$(mktemp -d /var/tmp/strata-recovery-XXXXXX)
trap 'kill -9 $pid 2>/dev/null || true; rm -rf "$work"' EXIT

start() {
    "$BIN" serve --nfs 127.0.0.1:0 --data-dir "$work/data" --nbd 127.0.0.1:0 --api 127.0.0.1:0 --iscsi 127.0.0.1:0 \
        >"$work/out" 2>"$work/err" &
    pid=$!
    for _ in $(seq 1 600); do
        grep -q "nbd listening" "$work/out" 2>/dev/null && break
        sleep 0.01
    done
    nbd=$(sed -n 's/^strata: nbd listening on //p' "$work/out")
    api=$(sed -n 's|^strata: api listening on http://||p' "$work/out")
}

start
"$BIN" volume create default/big --size "${gib}G" --data-dir "$work/data"
fio --name=fill --ioengine=nbd --uri="nbd://$nbd/default/big" --rw=write --bs=1m --iodepth=4 \
    --size="${gib}g" --output-format=terse >/dev/null
fio --name=over --ioengine=nbd --uri="nbd://$nbd/default/big" --rw=randwrite --bs=4k --iodepth=32 \
    --size="${gib}g" --time_based --runtime=5 --output-format=terse >/dev/null
kill -9 "$pid"
wait "$pid" 2>/dev/null || true
: >"$work/out"
began=$(date +%s.%N)
start
ended=$(date +%s.%N)
replayed=$(grep -o 'replayed [0-9]* log records ([0-9]* suspect chunks)' "$work/err" || echo "nothing to replay")
printf 'recovery after kill -9 with %s GiB written: %.2f s to serving again (%s)\n' \
    "$gib" "$(echo "$ended - $began" | bc)" "$replayed"
# The data is all there: read the first and last MiB.
reads_ok=0
qemu-io -f raw -c "read 0 1M" -c "read $((gib * 1024 - 1))M 1M" "nbd://$nbd/default/big" | grep -c "^read" \
    | grep -q 2 && echo "reads after recovery: ok" && reads_ok=1
records=$(echo "$replayed" | sed -n 's/replayed \([0-9]*\) log records (\([0-9]*\) suspect chunks)/\1,\2/p')
bench_csv "$gib" "$(echo "$ended - $began" | bc)" "${records:-0,0}" "$reads_ok"
