#!/bin/bash
# pgfence's own instructions per pgbench transaction, two binaries side by side
# (docs/benchmarks.md, "Counted the same way ... 2026-12-03"): each binary runs under
# callgrind with --threads 1 and pooling on; pgbench -n -c 1 runs 300 and then 1,300
# transactions against a fresh one (--random-seed=7), and the difference over 1,000 is
# printed. Scale 1, a throwaway cluster in /dev/shm. About ten minutes.
#
# usage: bash docs/bench/2026-12-03-proxy-instructions.sh OLD_PGFENCE NEW_PGFENCE   (as root;
#        needs valgrind, pgbench and PostgreSQL's server programs)
set -eu
OLD=$1; NEW=$2
BIN=$(ls -d /usr/lib/postgresql/*/bin | tail -1)
D=/dev/shm/pgfence-cg
PORT=15452
as_pg() { su postgres -c "$*"; }
settings="-p $PORT -k $D/sock -c listen_addresses=127.0.0.1 -c autovacuum=off -c synchronous_commit=off"
as_pg "$BIN/pg_ctl -D $D/data -m immediate stop" > /dev/null 2>&1 || true
rm -rf "$D"; mkdir -p "$D/sock" "$D/cgout"; chown -R postgres "$D"
as_pg "$BIN/initdb -D $D/data -A trust -U postgres" > /dev/null
as_pg "$BIN/pg_ctl -D $D/data -l $D/log -o '$settings' -w start" > /dev/null
pgbench -i -s 1 -q -h 127.0.0.1 -p "$PORT" -U postgres postgres > /dev/null 2>&1
"$NEW" install --upstream "127.0.0.1:$PORT" > /dev/null 2>&1
run() { # binary workload mode txns options -> total instructions
  local out=$D/cgout/cg.$RANDOM
  valgrind --tool=callgrind --callgrind-out-file=$out "$1" --threads 1 --listen 127.0.0.1:15453 \
      --upstream 127.0.0.1:$PORT > $D/proxy.log 2>&1 &
  local pid=$!
  for _ in $(seq 1 100); do pg_isready -q -h 127.0.0.1 -p 15453 && break; sleep 0.2; done
  PGOPTIONS="$5" pgbench -n -b "$2" -M "$3" -h 127.0.0.1 -p 15453 -U postgres -t "$4" --random-seed=7 postgres > $D/pgbench.log 2>&1
  kill -INT $pid; wait $pid || true
  grep -E '^(summary|totals)' "$out" | head -1 | awk '{print $2}'
}
for opts in "" "-c fencing.token=5 -c fencing.resource=bench"; do
  for w in select-only tpcb-like; do
    for m in simple prepared; do
      for b in OLD NEW; do
        bin=${!b}
        a=$(run "$bin" $w $m 300 "$opts")
        c=$(run "$bin" $w $m 1300 "$opts")
        echo "${opts:+token }$w $m $b: $(( (c - a) / 1000 )) pgfence instructions per transaction"
      done
    done
  done
done
as_pg "$BIN/pg_ctl -D $D/data -m fast stop" > /dev/null
