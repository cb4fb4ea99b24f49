# The GPU tests on the final code: the search sums' bit-for-bit case, the packed cases that plan,
# encode and attend (fixed and searched), and the packed eviction cases (compaction re-encodes
# rows with the encode kernel). Each binary's result is written as it ends.
set -e
D=$(mktemp -d); tar -C $D -xJf build-carry/s47/d.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name --format=csv,noheader
($D/t_pk "*search's sums on the device equal*" 2>&1 | tail -2) | tee $OUT/tests-final.txt
($D/t_pe 2>&1 | tail -2) | tee -a $OUT/tests-final.txt
($D/t_pk "*records within rounding*" 2>&1 | tail -2) | tee -a $OUT/tests-final.txt
