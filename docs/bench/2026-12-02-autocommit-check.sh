#!/bin/bash
# The server's cost of an autocommit UPDATE's check in the simple protocol, through pgfence
# (docs/benchmarks.md#simple-execute): backend instructions per transaction with the postmaster
# under callgrind, through two pgfence release binaries and the second with --no-fence, without
# and with a session token. Pooling is off, so that each pgbench run has a backend of its own.
#
# usage: bash docs/bench/2026-12-02-autocommit-check.sh OLD_PGFENCE NEW_PGFENCE   (as root;
#        needs valgrind and pgbench; about four minutes)
set -eu
OLD=$1; NEW=$2
BIN=$(ls -d /usr/lib/postgresql/*/bin | tail -1)
D=/dev/shm/pgfence-proxied
PORT=15442
as_pg() { su postgres -c "$*"; }
settings="-p $PORT -k $D/sock -c listen_addresses=127.0.0.1 -c autovacuum=off -c synchronous_commit=off"
as_pg "$BIN/pg_ctl -D $D/data -m immediate stop" > /dev/null 2>&1 || true
rm -rf "$D"; mkdir -p "$D/sock" "$D/cgout"; chown -R postgres "$D"
as_pg "$BIN/initdb -D $D/data -A trust -U postgres" > /dev/null
as_pg "$BIN/pg_ctl -D $D/data -l $D/log -o '$settings' -w start" > /dev/null
pgbench -i -s 1 -q -h 127.0.0.1 -p "$PORT" -U postgres postgres > /dev/null 2>&1
"$NEW" install --upstream "127.0.0.1:$PORT" > /dev/null 2>&1
as_pg "$BIN/pg_ctl -D $D/data -m fast stop" > /dev/null
printf '[pool]\nreuse_servers = false\n' > $D/pgfence.toml
printf '\\set aid random(1, 100000 * :scale)\nUPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n' > $D/update.sql
as_pg "valgrind --tool=callgrind --trace-children=yes --callgrind-out-file=$D/cgout/cg.%p \
    $BIN/postgres -D $D/data $settings" > "$D/valgrind.log" 2>&1 &
for _ in $(seq 1 240); do pg_isready -q -h 127.0.0.1 -p "$PORT" && break; sleep 0.5; done
"$OLD" -c $D/pgfence.toml --threads 1 --listen 127.0.0.1:15443 --upstream 127.0.0.1:$PORT > $D/old.log 2>&1 &
"$NEW" -c $D/pgfence.toml --threads 1 --listen 127.0.0.1:15444 --upstream 127.0.0.1:$PORT > $D/new.log 2>&1 &
"$NEW" -c $D/pgfence.toml --threads 1 --no-fence --listen 127.0.0.1:15445 --upstream 127.0.0.1:$PORT > $D/nf.log 2>&1 &
sleep 2
backend_instructions() { # port transactions options
  local before new
  psql -q -h 127.0.0.1 -p "$PORT" -U postgres -c "VACUUM pgbench_accounts" postgres
  sleep 2
  before=$(ls "$D/cgout" | sort)
  PGOPTIONS="$3" pgbench -n -M simple -h 127.0.0.1 -p "$1" -U postgres -t "$2" --random-seed=7 \
      -f $D/update.sql postgres > $D/pgbench.log 2>&1
  sleep 3
  new=$(comm -13 <(echo "$before") <(ls "$D/cgout" | sort))
  for f in $new; do grep -E '^(summary|totals)' "$D/cgout/$f" | head -1 | awk '{print $2}'; done |
      sort -n | tail -1
}
for opts in "" "-c fencing.token=5 -c fencing.resource=bench"; do
  for p in 15445:no-fence 15443:old 15444:new; do
    a=$(backend_instructions ${p%%:*} 200 "$opts")
    b=$(backend_instructions ${p%%:*} 1200 "$opts")
    echo "${opts:+token }${p##*:}: $(( (b - a) / 1000 )) backend instructions per transaction"
  done
done
kill %2 %3 %4 2>/dev/null || true
as_pg "$BIN/pg_ctl -D $D/data -m fast stop" > /dev/null
