#!/usr/bin/env bash
# Session 16 device run: select GPU tests (quest and mean_keys), then bench_decode new vs old.
set -u
R=$OUT/r; mkdir -p $R
cd build-carry
for f in *.xz; do xz -dk $f && chmod +x ${f%.xz}; done
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv >> $R/env.txt
echo "== tests"; date
timeout 270 ./gpu_select "[select]" -r junit -o $R/gpu_select.xml > $R/gpu_select.txt 2>&1; echo "tests rc $?" >> $R/env.txt
tail -3 $R/gpu_select.txt
echo "== bench new"; date
F='^(hbm_read|dense_decode/batch:(1|8)/context:(32768|131072)/|quant2_decode/batch:8/context:131072/group:4/head_dim:128/partition:64|dense_quest_decode/.*page:0|dense_quest_blocks_decode|dense_mean_keys_decode|quant2_quest_decode|quant2_mean_keys_decode)'
timeout 210 ./bench_new --benchmark_filter="$F" --benchmark_out=$R/bench_new.json --benchmark_out_format=json > $R/bench_new.txt 2>&1; echo "new rc $?" >> $R/env.txt
echo "== bench old"; date
FO='^(hbm_read|dense_decode/batch:8/context:131072/|dense_quest_decode/.*page:0|dense_quest_blocks_decode/batch:8|quant2_quest_decode/batch:8)'
timeout 90 ./bench_old --benchmark_filter="$FO" --benchmark_out=$R/bench_old.json --benchmark_out_format=json > $R/bench_old.txt 2>&1; echo "old rc $?" >> $R/env.txt
date
cd $OUT && tar czf r.tgz r
