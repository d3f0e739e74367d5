#!/bin/bash
# usage: R=3 T=5 C=8 conn.sh "label@port@sslmode ..." : pgbench -C (a new connection per transaction)
R=${R:-3}; T=${T:-5}; C=${C:-8}
for r in $(seq 1 $R); do
  for cp in $1; do
   IFS=@ read l p m <<< "$cp"
   out=$(PGSSLMODE=$m pgbench -n -C -S -M simple -h 127.0.0.1 -p $p -U postgres -T $T -c $C -j 2 postgres 2>&1)
   tps=$(echo "$out" | awk '/^tps/{print int($3)}'); lat=$(echo "$out" | awk '/average connection time/{print $5}')
   echo "r$r C$C conn $l $tps $lat"
  done
done
