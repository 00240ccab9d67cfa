#!/usr/bin/env bash
# Automatic tiering: a 1 GiB fast device and an 8 GiB capacity
# device made to behave like an HDD (4 ms per operation, 150 IOPS, 150 MB/s),
# one 6 GiB volume filled with nbdcopy, then fio random reads (zipf 1.1,
# 4K, QD16) for SECONDS, in three configurations one after the other:
#   ideal  everything on the fast tier (one 9 GiB fast device)
#   on     two tiers, migration on (the default)
#   off    two tiers, migration off
# IOPS, p99 and the fast tier's use are taken every 10 s (fio runs in 10 s
# segments, each drawing new offsets: with fio's default randrepeat=1 every
# segment replayed the same sequence, and the caches learnt it). Halfway through, a 4 GiB sequential read (nbdcopy to null:)
# runs beside fio: a scan that must not push the hot set out.
# RW=mixed runs 70/30 random reads/writes instead (zipf 1.1 both).
# RW=hotzone reads a hot region instead: 100 % of the reads uniformly over
# 512 MiB at 4 GiB into the volume (where the sequential fill put it on
# the capacity tier), a hot set that fits the fast tier. (fio's zipf
# spreads its ranks over the whole volume, so no placement of 1 MiB chunks
# puts most of its reads on a 1 GiB fast tier: BENCHMARKS.md, "Tiering".)
#
# Usage: bench/tiering.sh [STRATA_BINARY] [SECONDS]
#        (CONFIGS="on off" picks configurations; OUT=DIR keeps the results:
#        one CSV per configuration, a summary, and tiering.png if
#        python3-matplotlib is installed; CONFIGS= with OUT=DIR only
#        summarises and plots the CSVs already there)
# A temporary directory, ephemeral 127.0.0.1 ports, servers stopped by PID.
set -euo pipefail
BIN=$(realpath "${1:-$(dirname "$0")/../target/release/strata}")
RUN=${2:-600}
CONFIGS=${CONFIGS-ideal on off}
RW=${RW:-randread}
HERE=$(realpath "$(dirname "$0")")
OUT=$(realpath -m "${OUT:-$HERE/results/tiering-$RW}")
mkdir -p "$OUT"
DIR=$(mktemp -d)
PID=
trap 'stop_pid "$PID"; rm -rf "$DIR"' EXIT
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh" # stop_pid, for the trap
HDD="delay:4ms+throttle:iops=150,bw=150M"
SEGMENT=10

segment() {
    # One 10 s fio run; prints "iops p99_us".
    local uri=$1
    local rwargs=(--rw=randread --random_distribution=zipf:1.1)
    [ "$RW" = mixed ] && rwargs=(--rw=randrw --rwmixread=70 --random_distribution=zipf:1.1)
    [ "$RW" = hotzone ] && rwargs=(--rw=randread --random_distribution=zoned_abs:0/4g:100/512m:0/1536m)
    fio --name=t --ioengine=nbd --uri="$uri" "${rwargs[@]}" --randrepeat=0 \
        --bs=4k --iodepth=16 --numjobs=1 --time_based --runtime=$SEGMENT --size=6g \
        --output-format=json 2>/dev/null |
        python3 -c '
import json, sys
text = sys.stdin.read()
job = json.loads(text[text.index("{"):])["jobs"][0]
ops = job["read"]["total_ios"] + job["write"]["total_ios"]
secs = max(job["job_runtime"], 1) / 1000
p99 = job["read"]["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1000
print(f"{ops / secs:.0f} {p99:.0f}")'
}

pool_line() {
    # "fast_used_percent moved_up_bytes moved_down_bytes running"
    "$BIN" pool status t --json | python3 -c '
import json, sys
s = json.load(sys.stdin)
devs = [d for d in s["devices"] if d["role"] == "fast"]
size = sum(d["data_bytes"] for d in devs) or 1
used = sum(d["used_bytes"] for d in devs)
m = s.get("migration") or {}
up, down, running = m.get("moved_up_bytes", 0), m.get("moved_down_bytes", 0), int(bool(m.get("running")))
print(f"{100 * used / size:.1f} {up} {down} {running}")'
}

wait_api() {
    for _ in $(seq 300); do "$BIN" pool status >/dev/null 2>&1 && return; sleep 0.1; done
    cat "$DIR/err.txt" >&2
    exit 1
}

for config in $CONFIGS; do
    rm -rf "${DIR:?}"/*
    cd "$DIR"
    if [ "$config" = ideal ]; then
        truncate -s 9G fast.img
        # shellcheck source=bench/lib.sh
        source "$HERE/lib.sh"
        start_strata "$BIN"
        wait_api
        "$BIN" pool create t --fast "$DIR/fast.img" >/dev/null
    else
        truncate -s 1G fast.img
        truncate -s 8G capacity.img
        # shellcheck source=bench/lib.sh
        source "$HERE/lib.sh"
        start_strata "$BIN"
        wait_api
        "$BIN" pool create t --fast "$DIR/fast.img" --capacity "$DIR/capacity.img" >/dev/null
        [ "$config" = off ] && "$BIN" pool set t migration=off
        # --wrap names a pool's device: restart with the capacity device
        # made an HDD.
        kill "$PID"
        wait "$PID" 2>/dev/null || true
        start_strata "$BIN" --wrap "$DIR/capacity.img=$HDD"
        wait_api
    fi
    "$BIN" volume create t/v --size 6G >/dev/null
    URI=nbd://127.0.0.1:$PORT/t/v
    started=$(date +%s)
    nbdcopy --request-size=1048576 -- [ nbdkit --exit-with-parent pattern size=6G ] "$URI"
    echo "$config: filled 6 GiB in $(($(date +%s) - started)) s" | tee -a "$OUT/summary.txt"
    csv="$OUT/$config.csv"
    echo "seconds,iops,p99_us,fast_used_percent,moved_up_bytes,moved_down_bytes,migrating,scan" >"$csv"
    scan_pid=
    scan=0
    for ((t = 0; t < RUN; t += SEGMENT)); do
        if [ -z "$scan_pid" ] && [ "$t" -ge $((RUN / 2)) ] && [ "$scan" = 0 ]; then
            # The 4 GiB sequential read, beside fio.
            nbdcopy --request-size=262144 -- "$URI" null: &
            scan_pid=$!
        fi
        line=$(segment "$URI")
        scanning=0
        if [ -n "$scan_pid" ]; then
            if kill -0 "$scan_pid" 2>/dev/null; then scanning=1; else wait "$scan_pid" || true; scan_pid=; scan=1; fi
        fi
        echo "$((t + SEGMENT)),${line// /,},$(pool_line | tr ' ' ','),$scanning" >>"$csv"
        tail -1 "$csv"
    done
    [ -n "$scan_pid" ] && kill "$scan_pid" 2>/dev/null
    kill "$PID"
    wait "$PID" 2>/dev/null || true
    PID=
done

# The system's python has python3-matplotlib (Debian's package).
PYTHON=/usr/bin/python3
[ -x "$PYTHON" ] || PYTHON=python3
"$PYTHON" - "$OUT" "$RUN" <<'EOF' | tee -a "$OUT/summary.txt"
import csv, os, statistics, sys
out, run = sys.argv[1], int(sys.argv[2])
rows = {}
for config in ("ideal", "on", "off"):
    path = os.path.join(out, f"{config}.csv")
    if os.path.exists(path):
        rows[config] = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(open(path))]
def median(rs, key):
    return statistics.median(r[key] for r in rs) if rs else 0
ideal = median(rows.get("ideal", []), "iops")
for config, rs in rows.items():
    first = next((r["seconds"] for r in rs if ideal and r["iops"] >= 0.9 * ideal), None)
    scan_rows = [i for i, r in enumerate(rs) if r["scan"]]
    before = rs[max(0, (scan_rows[0] if scan_rows else 0) - 6):scan_rows[0]] if scan_rows else []
    after = rs[scan_rows[-1] + 1:scan_rows[-1] + 7] if scan_rows else []
    print(f"{config}: median IOPS {median(rs, 'iops'):.0f}, last minute {median(rs[-6:], 'iops'):.0f}, "
          f"median p99 {median(rs, 'p99_us'):.0f} us; reaches 90% of ideal at "
          f"{'%.0f s' % first if first is not None else 'never'}; "
          f"IOPS the minute before the scan {median(before, 'iops'):.0f}, after {median(after, 'iops'):.0f}; "
          f"fast tier at most {max(r['fast_used_percent'] for r in rs):.0f}% used; "
          f"moved up {rs[-1]['moved_up_bytes'] / 2**20:.0f} MiB, down {rs[-1]['moved_down_bytes'] / 2**20:.0f} MiB")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("(no plot: apt-get install python3-matplotlib)")
    sys.exit(0)
fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
for config, rs in rows.items():
    xs = [r["seconds"] for r in rs]
    a.plot(xs, [r["iops"] for r in rs], label=config)
    b.plot(xs, [r["p99_us"] / 1000 for r in rs], label=config)
for config, rs in rows.items():
    scan = [r["seconds"] for r in rs if r["scan"]]
    if scan:
        a.axvspan(min(scan) - 10, max(scan), color="grey", alpha=0.15)
        break
a.set_ylabel("IOPS (4K random reads, QD16)")
a.set_yscale("log")
b.set_ylabel("p99 of completed reads (ms)")
b.set_yscale("log")
b.set_xlabel("seconds since the volume was filled (grey: 4 GiB sequential read)")
a.legend()
a.set_title("strata tiering: 1 GiB fast + 8 GiB emulated HDD, 6 GiB volume")
fig.tight_layout()
fig.savefig(os.path.join(out, "tiering.png"), dpi=100)
print(f"plot: {os.path.join(out, 'tiering.png')}")
EOF
