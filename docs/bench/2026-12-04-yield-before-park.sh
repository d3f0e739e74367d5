#!/bin/bash
# 2026-12-04: A/B of pgfence --threads 2 (fence on, no token) with and without a sched_yield
# before each park of its worker runtimes (tokio on_thread_park, a temporary build that read
# PGFENCE_EXPERIMENT_YIELD; the code was not kept), next to PgBouncer, 8 clients, rotated
# order. Usage: PGFENCE=<that build> bash docs/bench/2026-12-04-yield-before-park.sh [ROUNDS] [SECONDS]
set -euo pipefail
rounds=${1:-5}; secs=${2:-5}
base=25732
export PGFENCE=${PGFENCE:?the experimental build}
source "$(dirname "$0")/three-proxies.sh"
y=$((base + 4000))
PGFENCE_EXPERIMENT_YIELD=1 RUST_LOG=warn "$pgfence" --listen 127.0.0.1:$y --upstream 127.0.0.1:$pg --threads 2 &
pids+=($!); pid_of[$y]=$!
sleep 1
names[$y]=pgfence-2-yield
ports=($bouncer $two $y)
cpu() { awk '{print $14 + $15}' /proc/$1/stat; }
for w in "-M prepared" "-S -M prepared" "-M simple"; do
  for p in "${ports[@]}"; do pgbench -n -h 127.0.0.1 -p "$p" -U postgres -T 1 -c 8 -j 2 $w postgres >/dev/null 2>&1; done
done
for r in $(seq 1 "$rounds"); do
  for w in "-M prepared" "-S -M prepared" "-M simple"; do
    for i in 0 1 2; do
      p=${ports[$(((i + r) % 3))]}
      c0=$(cpu ${pid_of[$p]})
      out=$(pgbench -n -h 127.0.0.1 -p "$p" -U postgres -T "$secs" -c 8 -j 2 $w postgres 2>&1)
      c1=$(cpu ${pid_of[$p]})
      tps=$(awk '/^tps/ {print int($3)}' <<<"$out")
      txns=$(awk '/number of transactions actually processed/ {split($NF, a, "/"); print a[1]}' <<<"$out")
      echo "$r|$w|${names[$p]}|$tps|proxy cpu us/txn $(awk -v a=$c0 -v b=$c1 -v t=$txns 'BEGIN {printf "%.1f", (b-a)*10000/t}')"
    done
  done
done
