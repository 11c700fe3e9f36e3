#!/usr/bin/env bash
# The merged tree on the lent 2-GPU H200, in two calls (device time is scarce):
#   bash benchmarks/h200_final.sh tests   # GPU tests, NCCL sync tests, warm path (old vs new)
#   bash benchmarks/h200_final.sh bench   # torch-dequant recheck, verify, doctor
# Carry .whl and .fi (python benchmarks/h200_carry.py) and .devold (the tree before this
# session's changes, for the side-by-side warm-path measurement). Writes under $OUT.
set -u
MODE=${1:-tests}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.fi:$PWD
export PYTHONUNBUFFERED=1 FP4SELECT_CACHE_DIR=/tmp/fp4select-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-benchmarks/results}
root=$PWD
{
  echo "== $(date -u +%FT%TZ) mode=$MODE"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)"
  if [ "$MODE" = tests ]; then
    echo "== GPU tests"
    timeout 240 python3 -m pytest tests/test_gpu.py tests/test_batch_invariant.py -v -p no:cacheprovider -rs
    echo "== distributed sync over NCCL, one GPU per rank"
    FP4SELECT_TEST_DIST_BACKEND=nccl timeout 150 python3 -m pytest tests/test_distributed.py -v -p no:cacheprovider -rs
    echo "== warm path, this tree"
    (cd benchmarks && timeout 60 python3 bench_warm_path.py --device cuda --batches 100 --calls 1000)
    cp benchmarks/results/warm_path_cuda.json "$OUT/warm_path_cuda.json"
    echo "== warm path, the tree before this session (same machine, same run)"
    (cd .devold/benchmarks && PYTHONPATH=/tmp/site:$PWD/.devold timeout 60 python3 bench_warm_path.py --device cuda --batches 100 --calls 1000)
    cp .devold/benchmarks/results/warm_path_cuda.json "$OUT/warm_path_cuda_before.json"
  elif [ "$MODE" = warm ]; then
    echo "== warm path: before this session / this tree, alternating (same machine, same run)"
    for tree in .devold . .devold .; do
      (cd "$root/$tree/benchmarks" && PYTHONPATH=/tmp/site:$root/$tree timeout 50 python3 bench_warm_path.py --device cuda --batches 100 --calls 1000 | tail -2)
      cp "$root/$tree/benchmarks/results/warm_path_cuda.json" "$OUT/warm_path_cuda_$([ $tree = . ] && echo after || echo before).json"
    done
    echo "== GPU tests"
    timeout 150 python3 -m pytest tests/test_gpu.py -p no:cacheprovider -rs -q
  elif [ "$MODE" = again ]; then
    echo "== warm path: before this session, then this tree (same machine, same run)"
    for tree in .devold .; do
      (cd "$root/$tree/benchmarks" && PYTHONPATH=/tmp/site:$root/$tree timeout 50 python3 bench_warm_path.py --device cuda --batches 100 --calls 1000 | tail -2)
    done
    cp benchmarks/results/warm_path_cuda.json "$OUT/warm_path_cuda.json"
    echo "== GPU tests that failed in the first call"
    timeout 120 python3 -m pytest tests/test_gpu.py -p no:cacheprovider -rs -q -k "proven_candidate or batch_invariant"
    timeout 60 python3 -m pytest tests/test_batch_invariant.py -p no:cacheprovider -q
    echo "== torch-dequant after its float32 epilogue: correctness, then two shapes"
    timeout 90 python3 benchmarks/gpu_check.py --only torch-dequant,triton-gemv --out "$OUT"
    timeout 130 python3 benchmarks/bench_gpu.py --out "$OUT" --skip-cold --max-shapes 2 --name gpu_h200_recheck2 --time-limit-s 80
    echo "== verify"
    timeout 100 python3 -m fp4select verify --m 1 --m 16 --m 256 > "$OUT/verify_h200.txt"; echo "verify exit $?"; tail -15 "$OUT/verify_h200.txt"
    python3 -m fp4select doctor --json > "$OUT/doctor_h200.json"
  else
    echo "== torch-dequant after its float32 epilogue: correctness, then two shapes"
    timeout 100 python3 benchmarks/gpu_check.py --only torch-dequant,triton-gemv --out "$OUT"
    timeout 150 python3 benchmarks/bench_gpu.py --out "$OUT" --skip-cold --max-shapes 2 --name gpu_h200_recheck2
    echo "== verify"
    timeout 150 python3 -m fp4select verify --json > "$OUT/verify_h200.json"; echo "verify exit $?"
    timeout 60 python3 -m fp4select verify --m 1 --m 16 --shape 4096,4096
    python3 -m fp4select doctor
    python3 -m fp4select doctor --json > "$OUT/doctor_h200.json"
  fi
  echo "== $(date -u +%FT%TZ) done"
} 2>&1 | tee "$OUT/h200_final_${MODE}_log.txt"
exit 0
