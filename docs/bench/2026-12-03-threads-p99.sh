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
root=$(cd "$(dirname "$0")/../.." && pwd)
pgfence=$root/target/release/pgfence
bin=$(pg_config --bindir 2>/dev/null || ls -d /usr/lib/postgresql/*/bin | tail -1)
work=$(mktemp -d /dev/shm/threads-p99.XXXXXX)
chmod 777 "$work"
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -c "$*"; else bash -c "$*"; fi; }
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  as_pg "$bin/pg_ctl -D $work/data -m immediate stop" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
pg=25432 bouncer=26432 one=27432 two=28432
as_pg "$bin/initdb -D $work/data -U postgres -A trust" >/dev/null
cat >>"$work/data/postgresql.conf" <<EOF
port = $pg
listen_addresses = '127.0.0.1'
unix_socket_directories = '$work'
shared_buffers = 256MB
synchronous_commit = off
autovacuum = off
max_connections = 100
EOF
as_pg "$bin/pg_ctl -D $work/data -l $work/pg.log -w start" >/dev/null
pgbench -i -q -s 10 -h 127.0.0.1 -p $pg -U postgres postgres >/dev/null 2>&1
"$pgfence" install --upstream 127.0.0.1:$pg -U postgres -d postgres >/dev/null 2>&1
cat >"$work/bouncer.ini" <<EOF
[databases]
postgres = host=127.0.0.1 port=$pg
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $bouncer
unix_socket_dir =
auth_type = trust
auth_file = $work/users.txt
pool_mode = session
max_client_conn = 200
default_pool_size = 50
logfile = $work/bouncer.log
pidfile = $work/bouncer.pid
EOF
echo '"postgres" ""' >"$work/users.txt"
chmod 666 "$work"/bouncer.ini "$work"/users.txt
as_pg "pgbouncer -d $work/bouncer.ini"
sleep 0.5
pids+=("$(cat "$work/bouncer.pid")")
RUST_LOG=warn "$pgfence" --listen 127.0.0.1:$one --upstream 127.0.0.1:$pg --threads 1 &
pids+=($!)
RUST_LOG=warn "$pgfence" --listen 127.0.0.1:$two --upstream 127.0.0.1:$pg --threads 2 &
pids+=($!)
sleep 1
names=([$bouncer]=pgbouncer [$one]="pgfence-1-thread" [$two]="pgfence-2-threads")
ports=($bouncer $one $two)
for w in "-S -M prepared" "-S -M simple" "-M prepared" "-M simple"; do
  for p in "${ports[@]}"; do # warm-up
    pgbench -n -h 127.0.0.1 -p "$p" -U postgres -T 1 -c 8 -j 2 $w postgres >/dev/null 2>&1
  done
done
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
