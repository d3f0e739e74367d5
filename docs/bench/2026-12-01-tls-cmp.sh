#!/bin/bash
# usage: R=3 T=5 C=8 cmp.sh "label@port@sslmode ..." "mode ..."
R=${R:-3}; T=${T:-5}; C=${C:-8}
for r in $(seq 1 $R); do
 for M in $2; do
  case $M in S-*) args="-S -M ${M#S-}";; B-*) args="-M ${M#B-}";; esac
  for cp in $1; do
   IFS=@ read l p m <<< "$cp"
   out=$(PGSSLMODE=$m pgbench -n -h 127.0.0.1 -p $p -U postgres -T $T -c $C -j 2 $args postgres 2>&1)
   tps=$(echo "$out" | awk '/^tps/{print int($3)}'); lat=$(echo "$out" | awk '/latency average/{print $4}')
   echo "r$r c$C $M $l $tps $lat"
  done
 done
done
