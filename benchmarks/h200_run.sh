#!/usr/bin/env bash
# Everything that needs the lent H200, in one call (device time is scarce).
# Usage there: bash benchmarks/h200_run.sh   (writes logs and JSON under $OUT)
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 FP4SELECT_CACHE_DIR=/tmp/fp4select-cache
OUT=${OUT:-benchmarks/results}
LOG=$OUT/h200_log.txt
{
  echo "== nvidia-smi"; nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  echo "== doctor"; python3 -m fp4select doctor
  python3 -m fp4select doctor --json > "$OUT/doctor_h200.json"
  echo "== GPU tests"; python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -rs
  echo "== quickstart"; python3 examples/quickstart.py
  echo "== warm path"; python3 benchmarks/bench_warm_path.py --device cuda
  echo "== cold cost"; timeout 300 python3 benchmarks/bench_cold.py --device cuda --preset llama3-8b --max-m 256
  echo "== sandbox"; python3 benchmarks/bench_sandbox.py --device cuda
  echo "== GPU memory after all processes ended"; nvidia-smi --query-gpu=memory.used --format=csv
} 2>&1 | tee "$LOG"
cp benchmarks/results/*_cuda.json "$OUT/" 2>/dev/null
exit 0
