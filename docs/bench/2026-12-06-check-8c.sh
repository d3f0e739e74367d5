#!/bin/bash
# What the session token's check costs the server at 8 clients, straight to PostgreSQL
# (no proxy): pgbench's TPC-B statements in one pipeline per transaction (so the server,
# not round trips, bounds the rate), `-M prepared`, with one statement before `END`:
#   base     none
#   select1  SELECT 1 (what any statement costs)
#   guard    the guarded statement pgfence sends for a tokenless session
#   lock     the shared advisory lock of resource `bench` alone
#   read     the read of its fence row alone
#   fnread   the same read in a VOLATILE PL/pgSQL function (SELECT ... INTO), as the check
#            reads it
#   fnlock   the shared advisory lock, then that read, in one such function (the check's
#            hot path without its tests)
#   session  SELECT pgfence.check(...) with fencing.token/resource set (what pgfence
#            sends for a fenced session), the token equal to the fence (the hot path)
#   copy     an identical copy of pgfence.check, called the same way (how far two equal
#            variants land apart: the noise)
#   stable   a copy declared STABLE whose read goes through a VOLATILE function taking
#            the fence resource as argument: a STABLE PL/pgSQL function neither
#            increments the command counter nor takes a snapshot for each expression
#            (a VOLATILE one does both), and the read still gets a snapshot of its own,
#            taken after the lock
# Rounds run the variants back to back in an order rotated by one. Prints each run, then
# per variant the median TPS, the median of the rounds' TPS ratios to `base`, and the
# median server CPU per transaction (postmaster and backends, /proc, clock ticks).
# Usage: bash docs/bench/2026-12-06-check-8c.sh [ROUNDS=5] [SECONDS=6] [CLIENTS=8]
set -euo pipefail
rounds=${1:-5} dur=${2:-6} clients=${3:-8}
base=${BASE:-47600}
source "$(dirname "${BASH_SOURCE[0]}")/three-proxies.sh"
# Only the server is used here.
kill "${pid_of[$one]}" "${pid_of[$two]}" "${pid_of[$bouncer]}" 2>/dev/null || true
d=$work/scripts
mkdir -p $d
# pgbench's own TPC-B script, with the transaction in a pipeline and END left for below.
head=$(pgbench --show-script=tpcb-like 2>&1 | grep -v -e '^--' -e '^END;$' |
  sed 's/^BEGIN;$/\\startpipeline\nBEGIN;/')
tail='END;
\endpipeline'
key="pg_catalog.hashtextextended('bench', 31638886877651813)"
key_in_fn="pg_catalog.pg_advisory_xact_lock_shared($key)"
declare -A stmt=(
  [base]=""
  [select1]="SELECT 1;"
  [guard]="SELECT CASE WHEN pg_catalog.current_setting('fencing.resource', true) IS NULL AND pg_catalog.current_setting('fencing.token', true) IS NULL THEN NULL ELSE pgfence.check(NULL, NULL, NULL, NULL, '127.0.0.1', false) END;"
  [lock]="SELECT pg_catalog.pg_advisory_xact_lock_shared($key);"
  [read]="SELECT token FROM pgfence.fences WHERE resource = 'bench';"
  [fnread]="SELECT bench_scratch.fnread();"
  [fnlock]="SELECT bench_scratch.fnlock();"
  [session]="SELECT pgfence.check(NULL, NULL, NULL, NULL, '127.0.0.1', false);"
  [copy]="SELECT bench_scratch.check_copy(NULL, NULL, NULL, NULL, '127.0.0.1', false);"
  [stable]="SELECT bench_scratch.check_stable(NULL, NULL, NULL, NULL, '127.0.0.1', false);"
)
variants=(base select1 guard lock read fnread fnlock session copy stable)
psql -qX -v ON_ERROR_STOP=1 -h 127.0.0.1 -p $pg -U postgres postgres >/dev/null <<SQL
CREATE SCHEMA bench_scratch;
CREATE FUNCTION bench_scratch.fnread() RETURNS bigint LANGUAGE plpgsql VOLATILE AS \$f\$
DECLARE v bigint;
BEGIN
    SELECT f.token INTO v FROM pgfence.fences AS f WHERE f.resource = 'bench';
    RETURN v;
END \$f\$;
CREATE FUNCTION bench_scratch.fnlock() RETURNS bigint LANGUAGE plpgsql VOLATILE AS \$f\$
DECLARE v bigint;
BEGIN
    PERFORM $key_in_fn;
    SELECT f.token INTO v FROM pgfence.fences AS f WHERE f.resource = 'bench';
    RETURN v;
END \$f\$;
CREATE FUNCTION bench_scratch.fence_of(p_resource text) RETURNS bigint LANGUAGE plpgsql VOLATILE AS \$f\$
DECLARE v bigint;
BEGIN
    SELECT f.token INTO v FROM pgfence.fences AS f WHERE f.resource = p_resource;
    RETURN v;
END \$f\$;
DO \$copies\$
DECLARE
    d text := pg_catalog.pg_get_functiondef('pgfence.check(text[], text[], text, text[], text, boolean)'::regprocedure);
    r text := 'SELECT f.token INTO v_locked FROM pgfence.fences AS f WHERE f.resource OPERATOR(pg_catalog.=) v_r0;';
BEGIN
    IF pg_catalog.strpos(d, r) = 0 THEN
        RAISE EXCEPTION 'pgfence.check no longer reads the fence as this script expects';
    END IF;
    EXECUTE replace(d, 'pgfence."check"(', 'bench_scratch.check_copy(');
    EXECUTE replace(replace(replace(d, 'pgfence."check"(', 'bench_scratch.check_stable('),
                            E' LANGUAGE plpgsql\\n', E' LANGUAGE plpgsql STABLE\\n'),
                    r, 'v_locked := bench_scratch.fence_of(v_r0);');
    IF (SELECT p.provolatile FROM pg_catalog.pg_proc AS p
        WHERE p.oid = 'bench_scratch.check_stable'::regproc) <> 's' THEN
        RAISE EXCEPTION 'bench_scratch.check_stable did not become STABLE';
    END IF;
END
\$copies\$;
SQL
for v in "${variants[@]}"; do
  printf '%s\n%s\n%s\n' "$head" "${stmt[$v]}" "$tail" >$d/$v.sql
done
token="-c fencing.token=1000 -c fencing.resource=bench"
# The fence of `bench` at 1000, so that the session's check takes its hot path.
PGOPTIONS="$token" psql -qX -h 127.0.0.1 -p $pg -U postgres postgres -c \
  "BEGIN; UPDATE pgbench_branches SET bbalance = bbalance WHERE bid = 1; SELECT pgfence.check(NULL, NULL, NULL, NULL, 'x', false); COMMIT;" >/dev/null
# Each of the three checks takes its hot path from a session's second write on: in three
# transactions of a fresh session, only the first calls pgfence.check_write.
psql -qXAt -h 127.0.0.1 -p $pg -U postgres postgres -c "SELECT pg_catalog.pg_stat_reset()" >/dev/null
for v in session copy stable; do
  call=${stmt[$v]}
  tx="BEGIN; UPDATE pgbench_branches SET bbalance = bbalance WHERE bid = 1; $call COMMIT;"
  PGOPTIONS="$token -c track_functions=pl" psql -qX -h 127.0.0.1 -p $pg -U postgres postgres \
    -c "$tx" -c "$tx" -c "$tx" -c "SELECT pg_catalog.pg_stat_force_next_flush()" >/dev/null
done
calls=$(psql -qXAt -h 127.0.0.1 -p $pg -U postgres postgres -c \
  "SELECT coalesce(sum(calls), 0) FROM pg_catalog.pg_stat_user_functions WHERE funcname = 'check_write'")
if [ "$calls" != 3 ]; then
  echo "pgfence.check_write ran $calls times, expected 3: a check missed its hot path" >&2
  exit 1
fi
run() { # variant seconds
  local opts=""
  [[ $1 == session || $1 == copy || $1 == stable ]] && opts=$token
  PGOPTIONS="$opts" pgbench -n -h 127.0.0.1 -p $pg -U postgres -M prepared -T "$2" \
    -c $clients -j $((clients > 1 ? 2 : 1)) -f $d/$1.sql postgres 2>&1
}
for v in "${variants[@]}"; do run $v 1 >/dev/null; done
echo "# $(date -u +%FT%TZ) git $(git -C "$root" rev-parse --short HEAD), $clients clients, $rounds rounds of $dur s"
echo "# variant|round|tps|server µs/txn"
results=()
for r in $(seq 1 $rounds); do
  for i in "${!variants[@]}"; do
    v=${variants[$(((i + r) % ${#variants[@]}))]}
    s0=$(server_ticks)
    out=$(run $v $dur)
    sleep 0.5 # the backends exit and are reaped: their time is the postmaster's then
    s1=$(server_ticks)
    n=$(echo "$out" | awk '/number of transactions actually processed/{print $NF}' | cut -d/ -f1)
    if [ -z "$n" ]; then echo "$out" | tail -5 >&2; exit 1; fi
    tps=$(echo "$out" | awk '/^tps/{printf "%.0f", $3}')
    line="$v|$r|$tps|$(((s1 - s0) * 1000000 / tck / n))"
    echo "$line"
    results+=("$line")
  done
done
echo "# variant|median tps|median of rounds' tps / base|median server µs/txn"
printf '%s\n' "${results[@]}" | python3 -c '
import sys, statistics as st
rows = [l.strip().split("|") for l in sys.stdin if l.strip()]
by = {}
for v, r, tps, cpu in rows:
    by.setdefault(v, {})[r] = (float(tps), float(cpu))
for v in by:
    ratios = [by[v][r][0] / by["base"][r][0] for r in by[v]]
    print("%s|%.0f|%.2f (%.2f to %.2f)|%.0f" % (v, st.median(t for t, _ in by[v].values()),
          st.median(ratios), min(ratios), max(ratios), st.median(c for _, c in by[v].values())))
'
