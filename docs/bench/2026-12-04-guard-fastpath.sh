#!/bin/bash
# 2026-12-04: backend instructions of the guard before COMMIT, as pgfence sends it (Bind and
# Execute of a prepared SELECT) and as a FunctionCall of a PL/pgSQL function with the same
# test, counted with callgrind: a throwaway PostgreSQL 15 whose postmaster runs under
# `valgrind --tool=callgrind --trace-children=yes`, and 2026-12-04-guard-fastpath.py
# running one variant on a connection of its own for 200 and for 1,200 transactions; the
# difference of the two backends' totals over 1,000 is one transaction's instructions.
# Usage (as root): bash docs/bench/2026-12-04-guard-fastpath.sh   (about five minutes)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
bin=$(pg_config --bindir 2>/dev/null || ls -d /usr/lib/postgresql/*/bin | tail -1)
d=/dev/shm/pgfence-guard-cg
port=15462
as_pg() { su postgres -c "$*"; }
as_pg "$bin/pg_ctl -D $d/data -m immediate stop" >/dev/null 2>&1 || true
rm -rf "$d"; mkdir -p "$d/sock" "$d/cg"; chown -R postgres "$d"
trap 'as_pg "$bin/pg_ctl -D $d/data -m immediate stop" >/dev/null 2>&1 || true; rm -rf "$d"' EXIT
as_pg "$bin/initdb -D $d/data -A trust -U postgres" >/dev/null
as_pg "valgrind --tool=callgrind --trace-children=yes --callgrind-out-file=$d/cg/cg.%p \
  $bin/postgres -D $d/data -p $port -k $d/sock -c listen_addresses=127.0.0.1 \
  -c autovacuum=off -c synchronous_commit=off -c shared_buffers=128MB" >"$d/log" 2>&1 &
for _ in $(seq 1 300); do pg_isready -q -h 127.0.0.1 -p $port && break; sleep 0.5; done
count() { # variant transactions -> the backend's total instructions
  python3 "$here/2026-12-04-guard-fastpath.py" 127.0.0.1 $port postgres postgres "$2" 1 "$1" >/dev/null
  sleep 2 # the backend writes its profile as it exits
  local f
  f=$(ls -t "$d"/cg/cg.* | head -1)
  grep -E '^(summary|totals):' "$f" | head -1 | awk '{print $2}'
  rm -f "$f"
}
for v in none select fcall; do
  a=$(count $v 200)
  b=$(count $v 1200)
  echo "$v: $(((b - a) / 1000)) backend instructions per transaction"
done
