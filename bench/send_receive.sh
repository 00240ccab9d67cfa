#!/usr/bin/env bash
# send / receive throughput against the same volume's NBD throughput, in
# one run of one strata server: 1M sequential read and write over NBD
# (fio's nbd engine, QD8), then `strata send` of a full snapshot and of an
# incremental one to /dev/null, `strata receive` of the full stream from a
# file (page cache) into a new volume, and `send | receive` through a pipe.
# The NBD read and the full send take turns ROUNDS times (default 3; the
# medians are compared). The volume is SIZE (default 4G; the run then needs
# about 5 x SIZE of free disk for the volumes, the changed quarter and the
# stream file, and is refused without it). The data directory is a
# temporary one, the server listens on ephemeral 127.0.0.1 ports and is
# stopped by PID.
#
# Usage: [ROUNDS=N] bench/send_receive.sh [STRATA_BINARY] [SIZE]
# (BENCH_CSV=FILE appends "name,MiB/s" lines: nbd_read, nbd_write,
# send_full, send_incremental, receive_full, send_receive_pipe)
set -euo pipefail
BIN=${1:-$(dirname "$0")/../target/release/strata}
BIN=$(realpath "$BIN")
SIZE=${2:-4G}
ROUNDS=${ROUNDS:-3}
BYTES=$(numfmt --from=iec "$SIZE")
MIB=$((BYTES >> 20))
DIR=$(mktemp -d)
free_mib=$(df -m --output=avail "$DIR" | tail -1)
if [ "$free_mib" -lt $((MIB * 5 + 1024)) ]; then
    echo "send_receive.sh: $SIZE needs about $((MIB * 5 / 1024 + 1)) GiB free in $DIR, there are $((free_mib / 1024)) GiB" >&2
    rmdir "$DIR"
    exit 1
fi
trap 'kill "$PID" 2>/dev/null || true; rm -rf "$DIR"' EXIT
. "$(dirname "$0")/lib.sh"
start_strata "$BIN"

fio_mibs() { # rw uri: MiB/s of a 1M sequential pass over the volume
    fio --name=seq --ioengine=nbd --uri="$2" --rw="$1" --bs=1M --iodepth=8 --size="$SIZE" \
        --output-format=terse | awk -F';' -v rw="$1" 'NF > 40 {print (rw == "read" ? $7 : $48) / 1024}'
}
timed_mibs() { # bytes command...: MiB/s of the command
    local bytes=$1 start end
    shift
    start=$(date +%s%N)
    "$@"
    end=$(date +%s%N)
    echo "$bytes $start $end" | awk '{printf "%.0f", $1 / 1048576 / (($3 - $2) / 1e9)}'
}
ratio() { echo "$1 $2" | awk '{printf "%.2f", $1 / $2}'; }

"$BIN" volume create default/b --size "$SIZE"
"$BIN" volume create default/w --size "$SIZE"
URI=nbd://127.0.0.1:$PORT/default/b
write_nbd=$(fio_mibs write "nbd://127.0.0.1:$PORT/default/w")
fio_mibs write "$URI" >/dev/null
"$BIN" pool sync default
"$BIN" snapshot create default/b@s1
# The NBD read and the full send take turns, ROUNDS times; each figure is
# the median of its rounds (on a shared machine one pass of either can
# lose half its speed to another tenant's disk or CPU load).
reads=() sends=()
for _ in $(seq "$ROUNDS"); do
    reads+=("$(fio_mibs read "$URI")")
    sends+=("$(timed_mibs "$BYTES" sh -c "'$BIN' send default/b@s1 > /dev/null")")
done
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
read_nbd=$(median "${reads[@]}")
send_full=$(median "${sends[@]}")
# A quarter of the volume changes, then the incremental stream.
fio --name=change --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size=$((MIB / 4))M \
    --offset=$((MIB / 2))M --output-format=terse >/dev/null
"$BIN" snapshot create default/b@s2
send_incr=$(timed_mibs $((BYTES / 4)) sh -c "'$BIN' send default/b@s2 -i @s1 > /dev/null")
"$BIN" send default/b@s1 > stream
receive=$(timed_mibs "$BYTES" sh -c "'$BIN' receive default/r < stream")
rm -f stream
pipe=$(timed_mibs "$BYTES" sh -c "'$BIN' send default/b@s1 | '$BIN' receive default/p")
"$BIN" volume list

echo "volume $SIZE, 1M sequential over NBD (fio, QD8): read $read_nbd MiB/s, write $write_nbd MiB/s"
echo "NBD read rounds: ${reads[*]} MiB/s; send full rounds: ${sends[*]} MiB/s (medians below)"
echo "send full:        $send_full MiB/s ($(ratio "$send_full" "$read_nbd")x NBD read)"
echo "send incremental: $send_incr MiB/s ($(ratio "$send_incr" "$read_nbd")x NBD read; $((MIB / 4)) MiB changed)"
echo "receive full:     $receive MiB/s ($(ratio "$receive" "$write_nbd")x NBD write)"
echo "send | receive:   $pipe MiB/s ($(ratio "$pipe" "$write_nbd")x NBD write)"
bench_csv nbd_read "$read_nbd"
bench_csv nbd_write "$write_nbd"
bench_csv send_full "$send_full"
bench_csv send_incremental "$send_incr"
bench_csv receive_full "$receive"
bench_csv send_receive_pipe "$pipe"
