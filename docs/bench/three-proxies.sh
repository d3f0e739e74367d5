# Sourced by the docs/bench scripts that compare PgBouncer with pgfence at 1 and 2 worker
# threads: starts a throwaway PostgreSQL 15 (scale 10, shared_buffers 256MB,
# synchronous_commit off, autovacuum off) in a directory of /dev/shm, PgBouncer in session
# mode and two pgfence processes (fence on, --threads 1 and --threads 2) in front of it,
# and stops them all and removes the directory on exit.
#
# Before sourcing, set `base`, the first of five ports (PostgreSQL; PgBouncer, pgfence with
# 1 thread and with 2 at base+1000, +2000, +3000). Sets `bouncer`, `one` and `two` (the
# proxies' ports), `pid_of[port]` and `names[port]`, and `work`, `bin` and `pgfence`
# (PGFENCE, or the workspace's release build: cargo build --release -p pgfence); defines
# `server_ticks` and `proxy_ticks PID` (CPU time in clock ticks, `tck` to the second), and
# `warm_up PORT...` (1 s of each workload through each port, CLIENTS clients, default 8).
# As root, the server and PgBouncer run as the `postgres` user. 2026-12-06-check-8c.sh
# sources it for the server alone and stops the proxies at once.
#
# PgBouncer and pgfence both run in this script's session, as pgbench does (the server is
# in one of its own: pg_ctl calls setsid). Until 2026-12-06 PgBouncer was started with
# `su -c "pgbouncer -d"`, which put it in a session of its own, and with the kernel's
# autogroup scheduling (on here) in a CPU group of its own, while pgfence shared one with
# pgbench: see docs/benchmarks.md#autogroup-2026-12-06. The runner (benches/) never did
# this: it starts both proxies in its own session.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
pgfence=${PGFENCE:-$root/target/release/pgfence}
bin=$(pg_config --bindir 2>/dev/null || ls -d /usr/lib/postgresql/*/bin | tail -1)
work=$(mktemp -d /dev/shm/three-proxies.XXXXXX)
chmod 777 "$work"
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -c "$*"; else bash -c "$*"; fi; }
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  as_pg "$bin/pg_ctl -D $work/data -m immediate stop" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
pg=$base bouncer=$((base + 1000)) one=$((base + 2000)) two=$((base + 3000))
as_pg "$bin/initdb -D $work/data -U postgres -A trust" >/dev/null
cat >>"$work/data/postgresql.conf" <<CONF
port = $pg
listen_addresses = '127.0.0.1'
unix_socket_directories = '$work'
shared_buffers = 256MB
synchronous_commit = off
autovacuum = off
max_connections = 100
CONF
as_pg "$bin/pg_ctl -D $work/data -l $work/pg.log -w start" >/dev/null
pgbench -i -q -s 10 -h 127.0.0.1 -p $pg -U postgres postgres >/dev/null 2>&1
"$pgfence" install --upstream 127.0.0.1:$pg -U postgres -d postgres >/dev/null 2>&1
cat >"$work/bouncer.ini" <<CONF
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
CONF
echo '"postgres" ""' >"$work/users.txt"
chmod 666 "$work"/bouncer.ini "$work"/users.txt
# Not `su -c` (a new session) nor `pgbouncer -d` (which calls setsid): see the head.
if [ "$(id -u)" = 0 ]; then
  setpriv --reuid=postgres --regid=postgres --init-groups pgbouncer "$work/bouncer.ini" >/dev/null 2>&1 &
else
  pgbouncer "$work/bouncer.ini" >/dev/null 2>&1 &
fi
declare -A pid_of names
pid_of[$bouncer]=$!
pids+=("${pid_of[$bouncer]}")
sleep 0.5
for port in $one $two; do
  RUST_LOG=warn "$pgfence" --listen 127.0.0.1:$port --upstream 127.0.0.1:$pg \
    --threads $((port == one ? 1 : 2)) &
  pids+=($!)
  pid_of[$port]=$!
done
sleep 1
names=([$bouncer]=pgbouncer [$one]="pgfence-1-thread" [$two]="pgfence-2-threads")
pm=$(head -1 "$work/data/postmaster.pid")
tck=$(getconf CLK_TCK)
server_ticks() { # the postmaster, its reaped children and its live ones
  local t c
  t=$(awk '{print $14 + $15 + $16 + $17}' /proc/$pm/stat)
  for c in $(cat /proc/$pm/task/$pm/children); do
    t=$((t + $(awk '{print $14 + $15}' /proc/$c/stat 2>/dev/null || echo 0)))
  done
  echo $t
}
proxy_ticks() { awk '{print $14 + $15}' /proc/$1/stat; }
warm_up() {
  local w p c=${CLIENTS:-8}
  for w in "-S -M prepared" "-S -M simple" "-M prepared" "-M simple"; do
    for p in "$@"; do
      pgbench -n -h 127.0.0.1 -p "$p" -U postgres -T 1 -c $c -j $((c > 1 ? 2 : 1)) $w postgres >/dev/null 2>&1
    done
  done
}
