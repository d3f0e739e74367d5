#!/bin/bash
# 2026-12-03: tail latency at 8 clients, PgBouncer (session mode) against pgfence with 1 and
# with 2 worker threads (fence on, no token), all three in front of one throwaway PostgreSQL
# 15 (scale 10, shared_buffers 256MB, synchronous_commit off), interleaved in rotated order.
# Prints round|workload|proxy|tps|mean ms|p99 ms; p99 comes from pgbench's per-transaction
# log (-l). Usage: bash docs/bench/2026-12-03-threads-p99.sh [ROUNDS] [SECONDS]
# (as root or as a user that may run initdb; needs pgbouncer, pgbench and a release build of
# pgfence: cargo build --release -p pgfence).
set -euo pipefail
rounds=${1:-5}
secs=${2:-5}
base=25432
source "$(dirname "$0")/three-proxies.sh"
ports=($bouncer $one $two)
warm_up "${ports[@]}"
for r in $(seq 1 "$rounds"); do
  for w in "-S -M prepared" "-S -M simple" "-M prepared" "-M simple"; do
    for i in 0 1 2; do
      p=${ports[$(((i + r) % 3))]}
      rm -f "$work"/log.*
      (cd "$work" && pgbench -n -h 127.0.0.1 -p "$p" -U postgres -T "$secs" -c 8 -j 2 $w \
        -l --log-prefix=log postgres >"$work/out" 2>&1)
      tps=$(awk '/^tps/ {print int($3)}' "$work/out")
      stats=$(cat "$work"/log.* | awk '{print $3}' | sort -n |
        awk '{a[NR]=$1; s+=$1} END {printf "%.3f|%.3f", s/NR/1000, a[int(NR*0.99)]/1000}')
      echo "$r|$w|${names[$p]}|$tps|$stats"
    done
  done
done
