#!/usr/bin/env bash
# The warm path on the lent H200, in one call: the tree before the strict warm path (.devold,
# `git archive 542ca01`) and this tree, alternating in one run; the per-property costs on CUDA
# tensors; then the GPU tests. Carry .whl, .fi (python benchmarks/h200_carry.py) and .devold.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 FP4SELECT_CACHE_DIR=/tmp/fp4select-cache
OUT=${OUT:-benchmarks/results}
root=$PWD
{
  echo "== $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "== warm path: before / this tree, alternating"
  for tree in .devold . .devold .; do
    echo "-- $tree"
    (cd "$root/$tree/benchmarks" && PYTHONPATH=/tmp/site:$root/$tree timeout 60 python3 bench_warm_path.py --device cuda --batches 100 --calls 1000 | tail -9)
    cp "$root/$tree/benchmarks/results/warm_path_cuda.json" "$OUT/warm_path_cuda_$([ $tree = . ] && echo after || echo ${tree#.}).json"
  done
  echo "== per-property costs on CUDA tensors"
  PYTHONPATH=/tmp/site:$root timeout 60 python3 benchmarks/diag_warm_path.py --device cuda
  echo "== candidate warm keys as whole call paths"
  PYTHONPATH=/tmp/site:$root timeout 120 python3 benchmarks/diag_warm_key.py --device cuda
  echo "== the guard and the warm path's tests on this torch"
  PYTHONPATH=/tmp/site:$root/.fi:$root timeout 200 python3 -m pytest tests/test_tensor_guard.py tests/test_api.py tests/test_gpu.py -p no:cacheprovider -q -rs
  echo "== $(date -u +%FT%TZ) done"
} 2>&1 | tee "$OUT/h200_warm_log.txt"
