#!/usr/bin/env bash
# Issue 9 on the lent H200, in one call: GPU correctness of the built-in GPU backends (+ tile
# sweep), then the benchmark suite. Run from a copy of the working tree (see HELPER notes):
#   bash benchmarks/h200_issue9.sh check   # correctness + sweep + a short suite
#   bash benchmarks/h200_issue9.sh suite   # the full suite (cold/warm tuning, all shapes)
# Writes logs and JSON/PNG under $OUT (default benchmarks/results).
set -u
MODE=${1:-suite}
export PYTHONPATH=.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONUNBUFFERED=1 FP4SELECT_CACHE_DIR=/tmp/fp4select-cache
# A fresh Triton cache, so the cold tuning time includes JIT compilation.
export TRITON_CACHE_DIR=/tmp/triton-cache-$$
OUT=${OUT:-benchmarks/results}
{
  echo "== $(date -u +%FT%TZ) mode=$MODE"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  if [ "$MODE" = recheck ]; then
    # After fixing the kernels measured slow by the suite: their correctness, then two shapes.
    timeout 100 python3 benchmarks/gpu_check.py --only triton-gemv,torch-dequant --out "$OUT"
    timeout 120 python3 benchmarks/bench_gpu.py --out "$OUT" --skip-cold --max-shapes 2 --name gpu_h200_recheck
  elif [ "$MODE" = check ]; then
    timeout 300 python3 benchmarks/gpu_check.py --sweep --out "$OUT"
    timeout 150 python3 benchmarks/bench_gpu.py --out "$OUT" --skip-cold --time-limit-s 20
  else
    timeout 150 python3 benchmarks/gpu_check.py --sweep --out "$OUT"
    timeout 400 python3 benchmarks/bench_gpu.py --out "$OUT" --time-limit-s 200
    python3 -m fp4select doctor
  fi
  echo "== $(date -u +%FT%TZ) done"
} 2>&1 | tee "$OUT/h200_issue9_${MODE}_log.txt"
exit 0
