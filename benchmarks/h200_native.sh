#!/usr/bin/env bash
# The warm path's C++ key on the lent H200, in one call: build it with that machine's compiler
# and torch, time the warm path (C++ key and Python path side by side, twice), then the GPU
# tests and the warm path's tests on both paths. Carry .whl and .fi (python
# benchmarks/h200_carry.py). Writes its log and the benchmark's JSON under $OUT.
set -u
. benchmarks/h200_env.sh
{
  echo "== $(date -u +%FT%TZ) (the tree the device tool sent; its git HEAD there is not that tree)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
  echo "compiler: $(command -v c++ || command -v g++) $(c++ --version 2>/dev/null | head -1)"
  echo "== build the C++ key"
  time timeout 300 python3 -m fp4select native --build
  echo "== warm path, C++ key and Python path side by side (two runs)"
  for run in 1 2; do
    (cd benchmarks && timeout 120 python3 bench_warm_path.py --device cuda --batches 100 --calls 1000 | tail -13)
    cp benchmarks/results/warm_path_cuda.json "$OUT/warm_path_cuda_run$run.json"
  done
  echo "== GPU tests and the warm path's tests, both paths"
  timeout 420 python3 -m pytest --all -p no:cacheprovider -q -rs tests/test_gpu.py tests/test_api.py tests/test_native_key.py tests/test_tensor_guard.py tests/test_batch_invariant.py tests/test_startup.py
  echo "== $(date -u +%FT%TZ) done"
} 2>&1 | tee "$OUT/h200_native_log.txt"
