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
root=$(cd "$(dirname "$0")/../.." && pwd)
pgfence=${PGFENCE:-$root/target/release/pgfence}
bin=$(pg_config --bindir 2>/dev/null || ls -d /usr/lib/postgresql/*/bin | tail -1)
work=$(mktemp -d /dev/shm/syscalls.XXXXXX)
chmod 777 "$work"
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -c "$*"; else bash -c "$*"; fi; }
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  as_pg "$bin/pg_ctl -D $work/data -m immediate stop" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
pg=25532 bouncer=26532 one=27532 two=28532
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
declare -A pid_of=([$bouncer]="${pids[0]}" [$one]=$!)
RUST_LOG=warn "$pgfence" --listen 127.0.0.1:$two --upstream 127.0.0.1:$pg --threads 2 &
pids+=($!)
pid_of[$two]=$!
sleep 1
names=([$bouncer]=pgbouncer [$one]="pgfence-1-thread" [$two]="pgfence-2-threads")
for w in "-S -M prepared" "-S -M simple" "-M prepared" "-M simple"; do
  for c in "${clients[@]}"; do
    for p in $bouncer $one $two; do
      # Connections are made before strace attaches: only the transactions are counted.
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
