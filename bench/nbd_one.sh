#!/bin/bash
# One NBD server at a time, for before/after measurements of one change:
#   bench/nbd_one.sh strata|nbdkit-file RW BS QD
# e.g. bench/nbd_one.sh strata write 1m 4. strata serves a fresh 1 GiB volume
# filled with nbdcopy from a seed file of random data; nbdkit-file serves a
# copy of the same seed. Both listen on an ephemeral 127.0.0.1 port and are
# stopped by PID. fio's nbd engine runs RW/BS/QD for RUNTIME seconds (5).
# Prints fio's rate, the server's CPU per operation (utime+stime from
# /proc/PID/stat over the run, divided by the operations completed), the
# client's CPU and the machine's idle share during the run.
# Environment: RUNTIME; PRE="fio args[;fio args...]" runs 5 s workloads first
# (the dirty data written out after each); SERVER_CPU / CLIENT_CPU pin with taskset;
# STRATA_BIN runs another strata binary (an old build, for before/after).
set -euo pipefail
SERVER=$1 RW=$2 BS=$3 QD=$4
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STRATA=${STRATA_BIN:-$ROOT/target/release/strata}
[ -x "$STRATA" ] || (cd "$ROOT" && cargo build --release)
WORK=$(mktemp -d /tmp/strata-nbd-one.XXXXXX)
PID=
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
pin() { if [ -n "${1:-}" ]; then echo "taskset -c $1"; fi; }
head -c 1G /dev/urandom > "$WORK/seed.img"
NBD=$(port)
case $SERVER in
  strata)
    API=$(port)
    $(pin "${SERVER_CPU:-}") env STRATA_LOG=warn STRATA_RAM_DIR="$WORK" "$STRATA" serve --nfs 127.0.0.1:0 --data-dir "$WORK/data" \
      --nbd 127.0.0.1:$NBD --api 127.0.0.1:$API --iscsi 127.0.0.1:0 >/dev/null 2>&1 &
    PID=$!
    # The API token (builds before it need none; an empty one is ignored).
    token() { echo "Authorization: Bearer $(cat "$WORK/data/api.token" 2>/dev/null)"; }
    for _ in $(seq 200); do curl -sf -H "$(token)" http://127.0.0.1:$API/v1/pools >/dev/null 2>&1 && break; sleep 0.05; done
    curl -sf -H "$(token)" -X POST -H 'Content-Type: application/json' -d '{"name":"default/bench","size":1073741824}' \
      http://127.0.0.1:$API/v1/volumes >/dev/null
    URI=nbd://127.0.0.1:$NBD/default/bench
    nbdcopy --flush "$WORK/seed.img" "$URI"
    settle() { curl -sf -H "$(token)" -X POST http://127.0.0.1:$API/v1/pools/default/sync >/dev/null; sync; }
    ;;
  nbdkit-file)
    cp "$WORK/seed.img" "$WORK/peer.img"
    $(pin "${SERVER_CPU:-}") nbdkit -f -i 127.0.0.1 -p $NBD file "$WORK/peer.img" &
    PID=$!
    for _ in $(seq 200); do nbdinfo --size nbd://127.0.0.1:$NBD/ >/dev/null 2>&1 && break; sleep 0.05; done
    URI=nbd://127.0.0.1:$NBD/
    settle() { sync; }
    ;;
  *) echo "usage: $0 strata|nbdkit-file RW BS QD" >&2; exit 2 ;;
esac
FIO=(fio --name=bench --ioengine=nbd --uri="$URI" --size=1g --time_based --norandommap --randrepeat=0)
if [ -n "${PRE:-}" ]; then
  # Workloads separated by ";" run one after another, each followed by settle.
  IFS=';' read -ra PRES <<< "$PRE"
  for pre in "${PRES[@]}"; do
    # shellcheck disable=SC2086
    "${FIO[@]}" --runtime=5 $pre >/dev/null
    settle
  done
fi
settle
cpu() { awk '{print $14+$15}' "/proc/$PID/stat"; }
idle() { awk '/^cpu /{print $5+$6}' /proc/stat; }
c0=$(cpu) i0=$(idle)
$(pin "${CLIENT_CPU:-}") "${FIO[@]}" --runtime="${RUNTIME:-5}" --rw="$RW" --bs="$BS" --iodepth="$QD" \
  --output-format=json > "$WORK/fio.json"
c1=$(cpu) i1=$(idle)
python3 - "$WORK/fio.json" "$c0" "$c1" "$i0" "$i1" "${RUNTIME:-5}" "$SERVER" <<'PY'
import json, os, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
c0, c1, i0, i1, runtime = (float(x) for x in sys.argv[2:7])
ticks = os.sysconf("SC_CLK_TCK")
ops = job["read"]["total_ios"] + job["write"]["total_ios"]
side = job["read"] if job["read"]["total_ios"] else job["write"]
print(f"{sys.argv[7]:12} {side['iops']:9.0f} IOPS {side['bw_bytes'] / 2**20:7.0f} MiB/s "
      f"server {(c1 - c0) / ticks * 1e6 / ops:6.1f} µs CPU/op  client {job['usr_cpu'] + job['sys_cpu']:3.0f}% CPU  "
      f"machine idle {(i1 - i0) / ticks / runtime / os.cpu_count() * 100:3.0f}%")
PY
