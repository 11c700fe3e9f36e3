#!/usr/bin/env bash
# Everything that needs the lent H200, in one call (device time is scarce).
# Prepare here: python benchmarks/h200_carry.py; then run there, carrying .whl and .fi:
#   bash benchmarks/h200_run.sh   (writes logs and JSON under $OUT)
set -u
# .whl: wheels the image lacks (platformdirs, apache-tvm-ffi); .fi: the Python modules that
# `import flashinfer` loads, copied from a CPU install (flashinfer's whole wheel is too big to
# carry, and it has no SM90 FP4 kernels anyway: this is for its runtime listing and answers).
export PYTHONPATH=.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
if [ -d .fi ]; then export PYTHONPATH=.fi:$PYTHONPATH; fi
export PYTHONUNBUFFERED=1 FP4SELECT_CACHE_DIR=/tmp/fp4select-cache
OUT=${OUT:-benchmarks/results}
LOG=$OUT/h200_log.txt
{
  echo "== nvidia-smi"; nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  echo "== flashinfer"; python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__, 'imports')"
  echo "== doctor"; python3 -m fp4select doctor
  python3 -m fp4select doctor --json > "$OUT/doctor_h200.json"
  echo "== GPU tests"; python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -rs
  echo "== quickstart"; python3 examples/quickstart.py
  echo "== explain on this GPU"; python3 -m fp4select explain --n 4096 --k 4096 --m 128 --tune
  echo "== warm path"; python3 benchmarks/bench_warm_path.py --device cuda
  echo "== cold cost"; timeout 200 python3 benchmarks/bench_cold.py --device cuda --preset llama3-8b --max-m 256
  cp benchmarks/results/cold_llama3-8b_cuda.json "$OUT/cold_llama3-8b_m256_cuda.json"
  timeout 240 python3 benchmarks/bench_cold.py --device cuda --preset llama3-8b --max-m 4096
  echo "== sandbox"; python3 benchmarks/bench_sandbox.py --device cuda
  echo "== GPU memory after all processes ended"; nvidia-smi --query-gpu=memory.used --format=csv
} 2>&1 | tee "$LOG"
cp benchmarks/results/*_cuda.json "$OUT/" 2>/dev/null
exit 0
