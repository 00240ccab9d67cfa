#!/usr/bin/env bash
# Where the slow synchronous writes fall in time (outside CI): one strata
# daemon, pool `wp` on an 8G fast file and a 2G log file in one directory,
# --ram 2G, a 1 GiB volume with sync=always filled with random data and
# synced; then fio 4K random writes at QD1 for 8 s with a per-write latency
# log, and a histogram of the writes over 1 ms per 250 ms of the run.
# Ephemeral loopback ports; the daemon is stopped by PID.
# Usage: bench/sync_tail.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x target/release/strata ] || cargo build --release
strata=$PWD/target/release/strata
work=${1:-$(mktemp -d /tmp/strata-sync-tail.XXXXXX)}
mkdir -p "$work"
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
nbd=$(port); api=$(port)
STRATA_LOG=warn "$strata" serve --nfs 127.0.0.1:0 --data-dir "$work/data" --nbd "127.0.0.1:$nbd" --api "127.0.0.1:$api" \
    --iscsi 127.0.0.1:0 >"$work/daemon.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 100); do curl -sf --unix-socket "$work/data/api.sock" http://localhost/v1/pools >/dev/null 2>&1 && break; sleep 0.1; done
truncate -s 8G "$work/fast.img"; truncate -s 2G "$work/log.img"
cli() { "$strata" "$@" --data-dir "$work/data" >/dev/null; }
cli pool create wp --fast "$work/fast.img" --log "$work/log.img" --ram 2G
cli volume create wp/sync --size 1G
cli volume set wp/sync sync=always
head -c 1G /dev/urandom >"$work/seed.img"
nbdcopy --flush "$work/seed.img" "nbd://127.0.0.1:$nbd/wp/sync"
rm "$work/seed.img"
cli pool sync wp
fio --name=tail --ioengine=nbd --uri="nbd://127.0.0.1:$nbd/wp/sync" --size=1024m --time_based --runtime=8 \
    --norandommap --randrepeat=0 --rw=randwrite --bs=4k --iodepth=1 \
    --write_lat_log="$work/lat" --log_avg_msec=0 | grep -E "IOPS|50.00th|99.00th"
python3 - "$work" <<'PY'
import collections, glob, sys
rows = [line.split(",") for line in open(glob.glob(sys.argv[1] + "/lat_clat*.log")[0])]
slow = [int(r[0]) for r in rows if int(r[1]) > 1_000_000]
print(f"{len(rows)} writes, {len(slow)} over 1 ms; per 250 ms bucket:")
print(sorted(collections.Counter(t // 250 for t in slow).items()))
PY
