#!/bin/bash
# 2026-12-02 (evening): autocommit UPDATE in the simple protocol, side by side, 5 s per run,
# five rounds in rotated order, at 8 then 1 client: PgBouncer 1.18 (session mode) on 16432,
# pgfence before the EXECUTE change (712b4eb) on 20432, after it on 26432, and after it with
# --no-fence on 28432 (the others with the fence on and no token; every pgfence with its default
# threads), all in front of one PostgreSQL 15
# (pgbench -i -s 10 bench, fsync off, synchronous_commit off). Prints
# clients|round|config|tps|latency ms; the output of that run is 2026-12-02-autocommit-ab.txt.
printf '\\set aid random(1, 100000 * :scale)\nUPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n' > /tmp/update.sql
names=(pgbouncer old new no-fence); ports=(16432 20432 26432 28432)
for c in 8 1; do
for r in 1 2 3 4 5; do
  for i in 0 1 2 3; do
    k=$(( (i + r) % 4 ))
    out=$(pgbench -n -h 127.0.0.1 -p ${ports[$k]} -U postgres -T 5 -c $c -j $(( c > 1 ? 2 : 1 )) -M simple -f /tmp/update.sql bench 2>/dev/null)
    echo "$c|$r|${names[$k]}|$(echo "$out" | awk '/^tps/ {print int($3)}')|$(echo "$out" | awk '/latency average/ {print $4}')"
  done
done
done
