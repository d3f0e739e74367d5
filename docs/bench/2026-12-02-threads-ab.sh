#!/bin/bash
# 2026-12-02, after v26: PgBouncer 1.18 (session mode) on 16432, pgfence --threads 1 on 18432 and
# --threads 2 on 20432 (fence on, no token), all in front of one PostgreSQL 15 (pgbench -i -s 10
# bench, fsync off, shared_buffers 256MB, synchronous_commit off). Prints round|workload|port|tps;
# the output of that run is 2026-12-02-threads-ab.txt.
ports=(16432 18432 20432)
for r in 1 2 3 4 5; do
  for w in "-S -M simple" "-S -M prepared" "-M simple" "-M prepared"; do
    for i in 0 1 2; do
      p=${ports[$(( (i + r) % 3 ))]}
      tps=$(pgbench -n -h 127.0.0.1 -p $p -U postgres -T 5 -c 8 -j 2 $w bench 2>/dev/null | awk '/^tps/ {print int($3)}')
      echo "$r|$w|$p|$tps"
    done
  done
done
