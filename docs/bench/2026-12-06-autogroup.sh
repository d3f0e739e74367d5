#!/bin/bash
# 2026-12-06: does it matter which CPU group the kernel's autogroup scheduling puts a proxy
# in? With /proc/sys/kernel/sched_autogroup_enabled = 1 each session (setsid) is a group,
# and groups share the CPUs fairly before their tasks do. PgBouncer and pgfence (fence on,
# no token, --threads 2) each twice in front of one throwaway PostgreSQL 15: once in this
# script's session, which pgbench shares (as the runner in benches/ starts them), once in
# a session of their own (`pgbouncer -d`, `setsid pgfence`; as a service manager would).
# 8 clients, -j 2, rotated order. Prints
# round|workload|proxy|tps|proxy CPU us/txn|server CPU us/txn.
# Usage: bash docs/bench/2026-12-06-autogroup.sh [ROUNDS] [SECONDS]   (as root or as a user
# that may run initdb; needs pgbouncer, pgbench, setsid and a release build of pgfence)
set -euo pipefail
rounds=${1:-5}
secs=${2:-5}
base=${BASE:-35432}
source "$(dirname "$0")/three-proxies.sh" # bouncer, one, two: this script's session
echo "autogroup scheduling: $(cat /proc/sys/kernel/sched_autogroup_enabled 2>/dev/null || echo absent)"
bouncer_own=$((base + 4000)) two_own=$((base + 5000))
sed -e "s/^listen_port = .*/listen_port = $bouncer_own/" -e "s#bouncer\.#bouncer-own.#g" \
  "$work/bouncer.ini" >"$work/bouncer-own.ini"
chmod 666 "$work/bouncer-own.ini"
as_pg "pgbouncer -d $work/bouncer-own.ini"
RUST_LOG=warn setsid "$pgfence" --listen 127.0.0.1:$two_own --upstream 127.0.0.1:$pg \
  --threads 2 >/dev/null 2>&1 &
sleep 1
pid_of[$bouncer_own]=$(cat "$work/bouncer-own.pid")
pid_of[$two_own]=$(pgrep -n -f -- "--listen 127.0.0.1:$two_own")
pids+=("${pid_of[$bouncer_own]}" "${pid_of[$two_own]}")
names[$bouncer]=pgbouncer-shared names[$bouncer_own]=pgbouncer-own
names[$two]=pgfence-shared names[$two_own]=pgfence-own
ports=($bouncer $bouncer_own $two $two_own)
for p in "${ports[@]}"; do
  echo "# ${names[$p]}: pid ${pid_of[$p]}, $(cat /proc/${pid_of[$p]}/autogroup)"
done
echo "# pgbench (this shell): $(cat /proc/$$/autogroup)"
warm_up "${ports[@]}"
for r in $(seq 1 "$rounds"); do
  for w in "-S -M prepared" "-S -M simple" "-M prepared" "-M simple"; do
    for i in 0 1 2 3; do
      p=${ports[$(((i + r) % 4))]}
      s0=$(server_ticks) x0=$(proxy_ticks ${pid_of[$p]})
      out=$(pgbench -n -h 127.0.0.1 -p "$p" -U postgres -T "$secs" -c 8 -j 2 $w postgres 2>&1)
      sleep 0.3 # the backends exit and are reaped
      s1=$(server_ticks) x1=$(proxy_ticks ${pid_of[$p]})
      n=$(echo "$out" | awk '/^number of transactions actually processed/ {split($NF, a, "/"); print a[1]}')
      tps=$(echo "$out" | awk '/^tps/ {print int($3)}')
      echo "$r|$w|${names[$p]}|$tps|$(((x1 - x0) * 1000000 / tck / n))|$(((s1 - s0) * 1000000 / tck / n))"
    done
  done
done
