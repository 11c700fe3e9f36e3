#!/usr/bin/env bash
# The GPU tests of this tree on the lent H200 (one call): everything marked gpu, the warm path's
# and the guard's tests, the sandbox's fault tests with a real CUDA fault. Carry .whl and .fi
# (python benchmarks/h200_carry.py). Writes its log under $OUT.
set -u
. benchmarks/h200_env.sh
{
  echo "== $(date -u +%FT%TZ) (the tree the device tool sent; its git HEAD there is not that tree)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  timeout 400 python3 -m pytest --all -p no:cacheprovider -q -rs tests/test_gpu.py tests/test_batch_invariant.py tests/test_api.py tests/test_tensor_guard.py tests/test_native_key.py tests/test_startup.py
  echo "== $(date -u +%FT%TZ) done"
} 2>&1 | tee "$OUT/h200_tests_log.txt"
