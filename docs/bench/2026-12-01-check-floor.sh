#!/bin/bash
# The check's server cost against one-statement alternatives and its floor
# (docs/fence-locking.md, "The hot path as one statement, and the floor of any check").
#
# usage: bash docs/bench/2026-12-01-check-floor.sh   (as root; needs valgrind, pgbench, and
#        target/release/pgfence from `cargo build --release -p pgfence`)
# Prints the backend's instructions per transaction for each script: the built-in TPC-B
# script, plus one statement before END. Takes about five minutes.
set -eu
BIN=$(ls -d /usr/lib/postgresql/*/bin | tail -1)
PGFENCE=${PGFENCE:-target/release/pgfence}
D=${D:-/dev/shm/pgfence-check-floor}
PORT=${PORT:-15440}
W=$D/scripts
as_pg() { su postgres -c "$*"; }
settings="-p $PORT -k $D/sock -c listen_addresses=127.0.0.1 -c autovacuum=off -c synchronous_commit=off"

as_pg "$BIN/pg_ctl -D $D/data -m immediate stop" > /dev/null 2>&1 || true
rm -rf "$D"; mkdir -p "$D/sock" "$D/cgout" "$W"; chown -R postgres "$D"
as_pg "$BIN/initdb -D $D/data -A trust -U postgres" > /dev/null
as_pg "$BIN/pg_ctl -D $D/data -l $D/log -o '$settings' -w start" > /dev/null
pgbench -i -s 1 -q -h 127.0.0.1 -p "$PORT" -U postgres postgres > /dev/null 2>&1
"$PGFENCE" install --upstream "127.0.0.1:$PORT" > /dev/null 2>&1
key=$(psql -h 127.0.0.1 -p "$PORT" -U postgres -Atc \
    "SELECT hashtextextended('bench', 31638886877651813)" postgres)
psql -q -h 127.0.0.1 -p "$PORT" -U postgres postgres <<'SQL'
CREATE FUNCTION pgfence.fence_token(p_resource text) RETURNS bigint LANGUAGE plpgsql VOLATILE AS $f$
DECLARE v pg_catalog.int8;
BEGIN
  SELECT f.token INTO v FROM pgfence.fences AS f WHERE f.resource OPERATOR(pg_catalog.=) p_resource;
  RETURN v;
END $f$;
CREATE FUNCTION pgfence.fence_token_locked(p_resource text) RETURNS bigint LANGUAGE plpgsql VOLATILE AS $f$
DECLARE v pg_catalog.int8;
BEGIN
  IF pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtextextended(p_resource, 31638886877651813)) IS NULL THEN
    RETURN NULL;
  END IF;
  SELECT f.token INTO v FROM pgfence.fences AS f WHERE f.resource OPERATOR(pg_catalog.=) p_resource;
  RETURN v;
END $f$;
SQL
as_pg "$BIN/pg_ctl -D $D/data -m fast stop" > /dev/null

# The scripts: TPC-B, then one statement before END.
tpcb='\set aid random(1, 100000 * :scale)
\set bid random(1, 1 * :scale)
\set tid random(1, 10 * :scale)
\set delta random(-5000, 5000)
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
UPDATE pgbench_tellers SET tbalance = tbalance + :delta WHERE tid = :tid;
UPDATE pgbench_branches SET bbalance = bbalance + :delta WHERE bid = :bid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);'
check="pgfence.check(NULL, NULL, NULL, '{}', '127.0.0.1:1', false)"
setting() { echo "pg_catalog.current_setting('$1', true)"; }
eq="OPERATOR(pg_catalog.=)"
cat_="OPERATOR(pg_catalog.||)"
wrote_rc="pg_catalog.current_setting('transaction_isolation') $eq 'read committed' AND pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL"
tests_settings="coalesce($(setting pgfence.accepted) $eq ($(setting fencing.resource) $cat_ '=' $cat_ $(setting fencing.token)), false) AND $wrote_rc"
tests_literals="coalesce($(setting pgfence.accepted) $eq 'bench=5', false) AND coalesce($(setting fencing.token) $eq '5', false) AND coalesce($(setting fencing.resource) $eq 'bench', false) AND $wrote_rc"
declare -A stmt=(
  [1-none]=""
  [2-select-1]="SELECT 1;"
  [3-bare-read]="SELECT token FROM pgfence.fences WHERE resource = 'bench';"
  [4-plpgsql-read]="SELECT pgfence.fence_token('bench');"
  [5-pgfence-check]="SELECT $check;"
  [6-one-statement]="SELECT CASE WHEN $tests_settings AND pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtextextended($(setting fencing.resource), 31638886877651813)) IS NOT NULL AND coalesce(pgfence.fence_token($(setting fencing.resource))::pg_catalog.text $eq $(setting fencing.token), false) THEN $(setting pgfence.accepted) ELSE $check END;"
  [7-literals]="SELECT CASE WHEN $tests_literals AND pg_catalog.pg_advisory_xact_lock_shared($key) IS NOT NULL AND pgfence.fence_token('bench') $eq 5 THEN 'bench=5' ELSE $check END;"
  [8-lock-in-function]="SELECT CASE WHEN $tests_literals AND pgfence.fence_token_locked('bench') $eq 5 THEN 'bench=5' ELSE $check END;"
  [9-no-tests]="SELECT CASE WHEN pgfence.fence_token_locked('bench') $eq 5 THEN 'bench=5' ELSE $check END;"
)
for name in "${!stmt[@]}"; do printf '%s\n%s\nEND;\n' "$tpcb" "${stmt[$name]}" > "$W/$name.sql"; done

# The postmaster and its backends under callgrind; each pgbench run gets its own backend.
as_pg "valgrind --tool=callgrind --trace-children=yes --callgrind-out-file=$D/cgout/cg.%p \
    $BIN/postgres -D $D/data $settings" > "$D/valgrind.log" 2>&1 &
for _ in $(seq 1 240); do pg_isready -q -h 127.0.0.1 -p "$PORT" && break; sleep 0.5; done
backend_instructions() { # script transactions
  local before new
  psql -q -h 127.0.0.1 -p "$PORT" -U postgres \
      -c "VACUUM pgbench_branches, pgbench_tellers, pgbench_accounts" postgres
  sleep 2  # the VACUUM's backend writes its profile when it exits: not pgbench's
  before=$(ls "$D/cgout" | sort)
  PGOPTIONS='-c fencing.token=5 -c fencing.resource=bench' pgbench -n -M prepared \
      -h 127.0.0.1 -p "$PORT" -U postgres -t "$2" --random-seed=7 -f "$1" postgres > /dev/null 2>&1
  sleep 2  # the backend writes its profile when it exits
  # pgbench's backend, and the short one of the connection where it reads the scale.
  new=$(comm -13 <(echo "$before") <(ls "$D/cgout" | sort))
  for f in $new; do grep -E '^(summary|totals)' "$D/cgout/$f" | head -1 | awk '{print $2}'; done |
      sort -n | tail -1
}
for name in $(printf '%s\n' "${!stmt[@]}" | sort); do
  a=$(backend_instructions "$W/$name.sql" 200)
  b=$(backend_instructions "$W/$name.sql" 1200)
  echo "$name: $(( (b - a) / 1000 )) backend instructions per transaction"
done
as_pg "$BIN/pg_ctl -D $D/data -m fast stop" > /dev/null
