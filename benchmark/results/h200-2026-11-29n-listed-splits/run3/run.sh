#!/bin/bash
# s39 run 3: the committed build (listed splits, block-query kernel a thread per (channel, head)):
# every packed_bitmap row at batch 1 and 8, 32K and 128K, with our dense and hbm_read in the same run.
cd "$(dirname "$0")"
mkdir -p /tmp/s39r3 && tar xJf bins3.tar.xz -C /tmp/s39r3
cd /tmp/s39r3
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='hbm_read|dense_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/|packed_bitmap_g4_(decode|page16_decode|mean_keys_decode/.*page:16)'
timeout 420 ./bench_final --benchmark_filter="$F" --benchmark_out=$R/bench_final.json --benchmark_out_format=json > $R/bench_final.txt 2>&1
python3 -c "
import json
for b in json.load(open('$R/bench_final.json'))['benchmarks']: print(b['name'].split('/iter')[0].replace('/group:4/head_dim:128',''), round(b.get('time_us',0),1), 'sel', round(b.get('select_us',0),1))"
cd $OUT && tar czf results.tgz results && rm -rf results
