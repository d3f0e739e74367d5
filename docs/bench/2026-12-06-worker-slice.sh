#!/bin/bash
# 2026-12-06: PgBouncer against pgfence --threads 2 with the kernel's default EEVDF slice
# and with a 0.1 ms slice on its worker threads (sched_setattr with sched_runtime, which
# Linux 6.12 and later take as the slice a SCHED_OTHER task asks for; the default here is
# 1.4 ms). Fence on, no token, all three in this script's session, rotated order. Prints
# round|workload|proxy|tps|mean latency ms|proxy CPU us/txn|server CPU us/txn|
# voluntary|involuntary context switches of the proxy per transaction.
# Usage: [SLICE=us] [CLIENTS=n] bash docs/bench/2026-12-06-worker-slice.sh [ROUNDS] [SECONDS]
# (as root; needs pgbouncer, pgbench, python3 and a release build of pgfence)
set -euo pipefail
rounds=${1:-5}; secs=${2:-5}; slice=${SLICE:-100}; clients=${CLIENTS:-8}
base=${BASE:-39432}
here=$(dirname "$0")
source "$here/three-proxies.sh"
sl=$((base + 4000))
RUST_LOG=warn "$pgfence" --listen 127.0.0.1:$sl --upstream 127.0.0.1:$pg --threads 2 &
pid_of[$sl]=$!; pids+=($!)
sleep 1
python3 "$here/2026-12-06-setslice.py" ${pid_of[$sl]} $slice pgfence-worker
names[$sl]="pgfence-slice"
ports=($bouncer $two $sl)
ics() { local s=0; for f in /proc/$1/task/*/status; do s=$((s + $(awk '/^nonvoluntary/ {print $2}' $f))); done; echo $s; }
vcs() { local s=0; for f in /proc/$1/task/*/status; do s=$((s + $(awk '/^voluntary_ctxt/ {print $2}' $f))); done; echo $s; }
warm_up "${ports[@]}"
for r in $(seq 1 "$rounds"); do
  for w in "-S -M prepared" "-S -M simple" "-M prepared" "-M simple"; do
    for i in 0 1 2; do
      p=${ports[$(((i + r) % 3))]}; pp=${pid_of[$p]}
      s0=$(server_ticks) x0=$(proxy_ticks $pp) i0=$(ics $pp) v0=$(vcs $pp)
      out=$(pgbench -n -h 127.0.0.1 -p "$p" -U postgres -T "$secs" -c $clients -j $(( clients > 1 ? 2 : 1 )) $w postgres 2>&1)
      sleep 0.3
      s1=$(server_ticks) x1=$(proxy_ticks $pp) i1=$(ics $pp) v1=$(vcs $pp)
      n=$(echo "$out" | awk '/^number of transactions actually processed/ {split($NF, a, "/"); print a[1]}')
      tps=$(echo "$out" | awk '/^tps/ {print int($3)}'); lat=$(echo "$out" | awk '/^latency average/ {print $4}')
      echo "$r|$w|${names[$p]}|$tps|$lat|$(((x1-x0)*1000000/tck/n))|$(((s1-s0)*1000000/tck/n))|$(awk -v a=$v0 -v b=$v1 -v n=$n 'BEGIN{printf "%.2f",(b-a)/n}')|$(awk -v a=$i0 -v b=$i1 -v n=$n 'BEGIN{printf "%.2f",(b-a)/n}')"
    done
  done
done
