# Shared by the bench scripts (source it): starts a strata server on
# ephemeral 127.0.0.1 ports with its data in $DIR/d, and sets PID and PORT
# (the NBD port). The caller owns DIR and stops the server by PID.
#
# Usage: start_strata BINARY [EXTRA SERVE ARGUMENTS...]; start_nbdkit and
# stop_pid (below)
start_strata() {
    cd "$DIR"
    export STRATA_DATA_DIR=$DIR/d
    "$1" serve --nfs 127.0.0.1:0 --data-dir ./d --nbd 127.0.0.1:0 --api 127.0.0.1:0 --iscsi 127.0.0.1:0 "${@:2}" >out.txt 2>err.txt &
    PID=$!
    for _ in $(seq 100); do grep -q "nbd listening" out.txt 2>/dev/null && break; sleep 0.1; done
    PORT=$(sed -n 's/^strata: nbd listening on 127.0.0.1://p' out.txt)
}

# Starts nbdkit's file plugin (16 threads) on a 1 GiB file $DIR/img on an
# ephemeral 127.0.0.1 port; sets PID, PORT and URI.
start_nbdkit() {
    cd "$DIR"
    truncate -s 1G img
    PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    nbdkit -f -i 127.0.0.1 -p "$PORT" --threads 16 file img &
    PID=$!
    for _ in $(seq 50); do nbdinfo "nbd://127.0.0.1:$PORT/" >/dev/null 2>&1 && break; sleep 0.1; done
    URI=nbd://127.0.0.1:$PORT/
}

# Stops the server PID (SIGTERM, or the signal given) and waits for it to
# exit, so that its data directory is not removed under a daemon still
# flushing (whose open files would keep their space); after 60 s it is
# killed (-9), with a line saying so: a clean stop that takes that long is
# a defect to look into.
#
# Usage: stop_pid PID [SIGNAL]
stop_pid() {
    [ -n "${1:-}" ] || return 0
    kill "-${2:-TERM}" "$1" 2>/dev/null || return 0
    for _ in $(seq 600); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
    echo "server $1 did not stop within 60 s of SIG${2:-TERM}: killed" >&2
    kill -9 "$1" 2>/dev/null || true
}

# Appends one CSV line (the arguments, comma-separated) to $BENCH_CSV when
# it is set: the machine-readable output bench/all.py reads. Without
# BENCH_CSV a script prints only what it always printed.
#
# Usage: bench_csv FIELD...
bench_csv() {
    [ -n "${BENCH_CSV:-}" ] || return 0
    local IFS=,
    echo "$*" >>"$BENCH_CSV"
}
