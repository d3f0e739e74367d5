#!/bin/bash
# 2026-12-04: system calls per transaction of PgBouncer (session mode) and pgfence (fence
# on, no token; 1 and 2 worker threads), in front of one throwaway PostgreSQL 15 (scale 10,
# synchronous_commit off). Each proxy is traced with `strace -c -f` (all of its threads)
# while pgbench runs a fixed number of transactions through it; strace slows the proxy
# down, but it counts every call. Prints proxy|workload|clients|transactions|calls per
# transaction, then the calls that make up the total.
# Usage: bash docs/bench/2026-12-04-syscalls.sh [TRANSACTIONS PER CLIENT] [CLIENTS...]
# (as root or as a user that may run initdb; needs pgbouncer, pgbench, strace and a release
# build of pgfence: cargo build --release -p pgfence).
set -euo pipefail
per_client=${1:-2000}
shift || true
clients=("${@:-1 8}")
read -r -a clients <<<"${clients[*]}"
base=25532
source "$(dirname "$0")/three-proxies.sh"
for w in "-S -M prepared" "-S -M simple" "-M prepared" "-M simple"; do
  for c in "${clients[@]}"; do
    for p in $bouncer $one $two; do
      # A warm-up run first; the measured run's own logins are counted too (accept4,
      # close, setsockopt: below 0.01 per transaction at 1,000 transactions a client).
      pgbench -n -h 127.0.0.1 -p "$p" -U postgres -T 1 -c "$c" -j 1 $w postgres >/dev/null 2>&1
      strace -c -f -o "$work/strace" -p "${pid_of[$p]}" 2>/dev/null &
      tracer=$!
      sleep 0.5
      out=$(pgbench -n -h 127.0.0.1 -p "$p" -U postgres -t "$per_client" -c "$c" -j 1 $w \
        postgres 2>&1)
      kill -INT "$tracer"
      wait "$tracer" 2>/dev/null || true
      txns=$(awk '/number of transactions actually processed/ {split($NF, a, "/"); print a[1]}' <<<"$out")
      total=$(awk '$NF == "total" {print $4}' "$work/strace")
      detail=$(awk -v t="$txns" 'NF >= 5 && $1 ~ /^[0-9.]+$/ && $NF != "total" {
          printf "%s %.2f ", $NF, $4 / t }' "$work/strace")
      printf '%s|%s|%s|%s|%.2f|%s\n' "${names[$p]}" "$w" "$c" "$txns" \
        "$(awk -v a="$total" -v t="$txns" 'BEGIN {print a / t}')" "$detail"
    done
  done
done
