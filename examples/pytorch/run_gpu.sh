#!/usr/bin/env bash
# On the GPU machine (docs/gpu-suite.md, docs/pytorch.md): builds the extension with its CUDA
# layers (TORCH_CUDA_ARCH_LIST, default 9.0; MAX_JOBS, default all cores), runs the extension's
# tests on CUDA tensors and on CPU tensors, then gpu_check.py. Eigen from .device-deps (carried);
# pytest from .whl wheels when the machine lacks it. Writes under $OUT: torch_build.log,
# torch_tests_cuda.xml, torch_tests_cpu.xml, gpu_check.json, torch_log.txt.
# SPDX-License-Identifier: Apache-2.0
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out="${OUT:-/tmp/kvmosaic-out}"
mkdir -p "$out"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export KVMOSAIC_TORCH_BUILD="${KVMOSAIC_TORCH_BUILD:-$PWD/build-torch}" PYTHONUNBUFFERED=1
[[ -d .device-deps/include/eigen3 ]] && export KVMOSAIC_EIGEN_INCLUDE="$PWD/.device-deps/include/eigen3"
if ! python3 -c "import pytest" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
log="$out/torch_log.txt"
status=0
step() { local name=$1; shift; local t0=$SECONDS; "$@" >>"$log" 2>&1; local rc=$?; ((rc)) && status=1
         printf '%-12s rc=%d %4ds\n' "$name" "$rc" $((SECONDS - t0)) | tee -a "$log"; }
step build python3 -c "import sys; sys.path.insert(0, 'examples/pytorch'); import kvmosaic_torch; kvmosaic_torch.load(cuda=True)"
step tests_cuda env KVMOSAIC_TORCH_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider examples/pytorch/test_torch.py \
  --junitxml="$out/torch_tests_cuda.xml"
step tests_cpu env KVMOSAIC_TORCH_DEVICE=cpu python3 -m pytest -q -p no:cacheprovider examples/pytorch/test_torch.py \
  --junitxml="$out/torch_tests_cpu.xml"
step gpu_check python3 examples/pytorch/gpu_check.py --out "$out/gpu_check.json" ${GPU_CHECK_ARGS:-}
grep -E "passed|failed|error|Error" "$log" | tail -20
exit $status
