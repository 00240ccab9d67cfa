#!/usr/bin/env bash
# Durability soak (outside CI): many kill -9 cycles over real NBD (fio
# verification) and real iSCSI (qemu-io), on sync=always, logbias=throughput
# and wce=on volumes with flushes/FUA, plus many more simulation seeds.
#
# Usage: bench/soak.sh [KILL_CYCLES] [SIM_SEEDS]   (defaults 100, 20000)
set -euo pipefail
cd "$(dirname "$0")/.."
cycles=${1:-100}
seeds=${2:-20000}
STRATA_KILL_CYCLES=$cycles cargo test --release --test engine_durability -- --test-threads=1 kill9
STRATA_KILL_CYCLES=$cycles cargo test --release --test iscsi_durability -- --test-threads=1
STRATA_SIM_SEEDS=$seeds cargo test --release --test engine_sim
