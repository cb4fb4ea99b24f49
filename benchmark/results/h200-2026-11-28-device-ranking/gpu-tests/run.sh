#!/bin/bash
# GPU tests after the device ranking: the token-score tests and the regression suites whose steps
# the change touches (the step metadata's layout, the score kernel, snapkv's logits).
cd "$(dirname "$0")" && tar xzf tests.tgz && cd ..
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
for t in scores snapkv eviction select dense exact_tokens; do
  timeout 240 build-gpuA/test_$t > $R/test_$t.txt 2>&1; echo "test_$t rc=$?" >> $R/tests.txt
  tail -2 $R/test_$t.txt >> $R/tests.txt
done
cd $OUT && tar czf results.tgz r && rm -rf r
