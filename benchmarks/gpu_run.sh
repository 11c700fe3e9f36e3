#!/usr/bin/env bash
# The GPU suite, in one call, on a machine with a GPU and no package registry (a lent H200).
#
# Here, once (with flashinfer-python installed):   python benchmarks/gpu_carry.py
#   -> .whl/ (wheels that machine lacks) and .fi/ (the Python modules `import flashinfer` loads)
# There, from a copy of this working tree, carrying .whl and .fi:
#   bash benchmarks/gpu_run.sh [tests|kernels|bench|all|record|quant|floor|deploy|hazard|wins|stream|tiled|tiledws|final]
#   (default: all)
#
#   tests  the tests marked gpu but the kernel matrix, then the warm path's, the guard's, the
#          C++ key's, batch invariance's and start-up's tests, which take CUDA tensors where
#          there is a GPU (python -m pytest --all, 163 s in one process on the H200); with 2
#          or more GPUs also fp4select.distributed over NCCL
#   kernels the kernel matrix: tests/test_hopper_kernels_gpu.py, every Hopper kernel and tactic
#          against the exact reference (141 tests, stream-K's 20 among them, at e679921:
#          115 s in 6 processes on the H200; the whole gpu mark took about 9 min in
#          one process)
#          Both run in GPU_TEST_WORKERS processes (default 6) where pytest-xdist is installed.
#   bench  benchmarks/bench_gpu.py (the suite the README cites), the warm path (C++ key built
#          first) and verify, doctor's report; with 2 or more GPUs also bench_multi_gpu.py
#   record benchmarks/bench_gpu.py alone, without its tuning-cost part, with time for all 16
#          shapes in one 600 s call (10 took 264 s on the H200); not part of all
#   quant  benchmarks/quant_sweep.py alone (the activation quantizer's tilings, checked and
#          timed, about 30-40 s); not part of all (its tests marked gpu run in tests)
#   floor  benchmarks/hopper_sweep.py --families mma,floor at M = 1 and 16: each small-M
#          tiling beside itself without its decode (about 1-2 min); not part of all
#   deploy benchmarks/bench_deploy.py --serial: `fp4select warm` of Llama-3.1-8B's shapes as a
#          user runs it, from nothing, again with the kernels compiled (the JIT share), and
#          from nothing without compile-ahead (--compile-jobs 1); then
#          benchmarks/bench_cold.py, where that time goes (seconds per backend and phase,
#          kernels compiled); about 5 minutes; not part of all
#   hazard benchmarks/hazard_stress.py: each hopper-mma and hopper-ws tactic many times on the
#          same inputs, under load, compared bit for bit (the wgmma register hazard that
#          tools/wgmma_hazards.py found in hopper-mma's Triton 3.6 SASS); not part of all
#   wins   fp4select warm of the record's 16 shapes to M = 8192 at default settings, then
#          tactic_wins.py over its decisions (which tactics a table could drop: each costs
#          deploying a compile; the decisions come back as decisions_wins.tgz); not part of all
#   stream hopper-ws's last wave of tiles cut into runs of K steps (WsConfig.split = -1,
#          stream-K): its tests in the kernel matrix first (20), then hopper_sweep.py
#          --families stream,tactics on Llama-3.1-8B's four layers and two others at M =
#          512-3072, the buckets between the powers of two among them (about 70 s on the
#          H200: hopper_sweep_stream3.json); not part of all
#   tiled  the GEMV and mma tactics reading the weight re-laid by tiles (each program's step one
#          contiguous run, or tiles of 16 rows x 128 bytes that every tactic reads;
#          hopper_args.tiled_words): their tests in the kernel matrix, then hopper_sweep.py
#          --families tiled,tactics at M = 16, 8, 1 and 4 on four shapes, each tactic beside
#          itself on the plain layout, and the mma tilings' loads alone on each layout (about
#          6-7 min: hopper_sweep_tiled.json; points past its time limit are named as skipped);
#          not part of all
#   tiledws hopper-ws's tiles with a loader warp reading the weight re-laid by their own tiles:
#          hopper_sweep.py --families tiled at M = 64, 128 and 512 on four shapes, beside the
#          same tiles on the plain layout (about 3 min: hopper_sweep_tiled_ws.json; its GPU
#          test is in tiled's); not part of all
#   final  what a release's figures need from one tree, in one 600 s call: the record (as
#          record, about 200 s), then bench_deploy.py (about 150 s), then hazard_stress.py in
#          the time left (each step's limit shrinks to fit 560 s); not part of all. The tests
#          take two calls of their own (tests, kernels).
#
# Results and the log (gpu_run_<mode>_log.txt) go to $OUT (default benchmarks/results).
# Exit status: non-zero if any step failed (the log says which).
set -u
MODE=${1:-all}
case "$MODE" in
  tests|kernels|bench|all|record|quant|floor|deploy|hazard|wins|stream|tiled|tiledws|final) ;;
  *) echo "gpu_run.sh: unknown mode '$MODE' (tests|kernels|bench|all|record|quant|floor|deploy|hazard|wins|stream|tiled|tiledws|final)" >&2
     exit 2 ;;
esac
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fp4select-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/fp4select-site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .fi ] && export PYTHONPATH=$PWD/.fi:${PYTHONPATH:-}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this tree, not an installed fp4select
export PYTHONUNBUFFERED=1 FP4SELECT_CACHE_DIR=/tmp/fp4select-cache
# Shared multi-GPU hosts: NVLink multicast stays off in every process started here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
# The tests compile kernels more than they run them: with pytest-xdist there (the H200 image
# has it), GPU_TEST_WORKERS processes share the GPU and its CPU cores (0: one process).
WORKERS=${GPU_TEST_WORKERS:-6}
XDIST=()
if [ "$WORKERS" -gt 0 ] && python3 -c "import xdist" 2>/dev/null; then XDIST=(-n "$WORKERS"); fi
failed=()
step() {  # step NAME COMMAND...: run it, remember a failure, go on
  local name=$1; shift
  echo "== $name"
  "$@" || failed+=("$name")
}
{
  echo "== $(date -u +%FT%TZ) mode=$MODE gpus=$GPUS"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
    step "tests marked gpu, but the kernel matrix" timeout 250 python3 -m pytest "${XDIST[@]}" -m gpu \
      -p no:cacheprovider -q -rs --ignore=tests/test_hopper_kernels_gpu.py
    step "tests that take CUDA tensors where there is a GPU" timeout 420 python3 -m pytest "${XDIST[@]}" --all \
      -p no:cacheprovider -q -rs tests/test_api.py tests/test_tensor_guard.py \
      tests/test_native_key.py tests/test_batch_invariant.py tests/test_startup.py
    if [ "$GPUS" -ge 2 ]; then
      step "fp4select.distributed over NCCL" env FP4SELECT_TEST_DIST_BACKEND=nccl timeout 200 \
        python3 -m pytest --all -p no:cacheprovider -q -rs tests/test_distributed.py
    fi
  fi
  if [ "$MODE" = kernels ] || [ "$MODE" = all ]; then
    step "the kernel matrix" timeout 570 python3 -m pytest "${XDIST[@]}" -m gpu -p no:cacheprovider -q -rs \
      --durations=5 tests/test_hopper_kernels_gpu.py
  fi
  if [ "$MODE" = bench ] || [ "$MODE" = all ]; then
    step "bench_gpu.py" timeout 420 python3 benchmarks/bench_gpu.py --out "$OUT"
    step "build the warm path's C++ key" timeout 300 python3 -m fp4select native --build
    step "warm path" timeout 120 python3 benchmarks/bench_warm_path.py --device cuda
    cp benchmarks/results/warm_path_cuda.json "$OUT/" 2>/dev/null
    step "verify" timeout 200 python3 -m fp4select verify --m 1 --m 16 --m 256
    python3 -m fp4select doctor --json > "$OUT/doctor_$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 | awk '{print tolower($NF)}').json"
    if [ "$GPUS" -ge 2 ]; then
      step "bench_multi_gpu.py" timeout 300 python3 benchmarks/bench_multi_gpu.py --out "$OUT"
    fi
  fi
  if [ "$MODE" = record ]; then
    step "bench_gpu.py, every shape" timeout 570 python3 benchmarks/bench_gpu.py --out "$OUT" \
      --skip-cold --time-limit-s 470
  fi
  if [ "$MODE" = quant ]; then
    step "quant_sweep.py" timeout 120 python3 benchmarks/quant_sweep.py --out "$OUT"
  fi
  if [ "$MODE" = floor ]; then
    step "hopper_sweep.py floor" timeout 300 python3 benchmarks/hopper_sweep.py \
      --families mma,floor --ms 1,16 --name hopper_sweep_floor --out "$OUT" --time-limit-s 240
  fi
  if [ "$MODE" = deploy ]; then
    step "fp4select warm, from nothing" timeout 300 python3 benchmarks/bench_deploy.py --serial --out "$OUT"
    step "where warm-up time goes" timeout 250 python3 benchmarks/bench_cold.py \
      --device cuda --preset llama3-8b --max-m 8192 --defaults --jit-share --time-limit-s 200
    cp benchmarks/results/cold_llama3-8b_cuda.json "$OUT/" 2>/dev/null
  fi
  if [ "$MODE" = hazard ]; then
    step "hazard_stress.py" timeout 500 python3 benchmarks/hazard_stress.py --out "$OUT"
  fi
  if [ "$MODE" = wins ]; then
    decisions=$(mktemp -d)  # the store's folders nest too deep to come back from the device
    python3 -c "import json, sys; sys.path.insert(0, 'benchmarks'); from bench_gpu import SHAPES
print(json.dumps({'shapes': [[n, k] for _, n, k in SHAPES]}))" > "$decisions.shapes.json"
    step "fp4select warm, the record's shapes" env FP4SELECT_CACHE_DIR="$decisions" timeout 400 \
      python3 -m fp4select warm --quiet --json --max-m 8192 --shapes-file "$decisions.shapes.json" \
      > "$OUT/warm_wins.json"
    step "tactic_wins.py" python3 benchmarks/tactic_wins.py "$decisions" --out "$OUT"
    tar -C "$decisions" -czf "$OUT/decisions_wins.tgz" .
  fi
  if [ "$MODE" = stream ]; then
    step "stream-K's tests" timeout 200 python3 -m pytest "${XDIST[@]}" -m gpu -p no:cacheprovider \
      -q -rs tests/test_hopper_kernels_gpu.py -k runs_of_k
    step "hopper_sweep.py stream" timeout 370 python3 benchmarks/hopper_sweep.py \
      --families stream,tactics --name hopper_sweep_stream3 --out "$OUT" --time-limit-s 330 \
      --shapes 4096x4096,6144x4096,28672x4096,4096x14336,4608x7168,8192x8192 \
      --ms 768,1024,1280,1536,1792,2560,3072,512,2048
  fi
  if [ "$MODE" = tiled ]; then
    step "the tiled weight's tests" timeout 150 python3 -m pytest "${XDIST[@]}" -m gpu -p no:cacheprovider \
      -q -rs tests/test_hopper_kernels_gpu.py -k re_laid_by_tiles
    step "hopper_sweep.py tiled" timeout 420 python3 benchmarks/hopper_sweep.py \
      --families tiled,tactics --name hopper_sweep_tiled --out "$OUT" --time-limit-s 380 \
      --shapes 8192x8192,28672x4096,4096x14336,2560x8192 --ms 16,8,1,4
  fi
  if [ "$MODE" = tiledws ]; then
    step "hopper_sweep.py tiled, hopper-ws" timeout 300 python3 benchmarks/hopper_sweep.py \
      --families tiled --name hopper_sweep_tiled_ws --out "$OUT" --time-limit-s 260 \
      --shapes 8192x8192,28672x4096,4096x14336,4608x7168 --ms 128,64,512
  fi
  if [ "$MODE" = final ]; then
    start=$(date +%s)
    left() { echo $((560 - $(date +%s) + start)); }  # seconds left of the call's 560
    step "bench_gpu.py, every shape" timeout 240 python3 benchmarks/bench_gpu.py --out "$OUT" \
      --skip-cold --time-limit-s 200
    step "fp4select warm, from nothing" timeout "$(( $(left) < 200 ? $(left) : 200 ))" \
      python3 benchmarks/bench_deploy.py --out "$OUT"
    step "hazard_stress.py" timeout "$(left)" python3 benchmarks/hazard_stress.py --out "$OUT"
  fi
  echo "== $(date -u +%FT%TZ) done; failed: ${failed[*]:-none}"
} 2>&1 | tee "$OUT/gpu_run_${MODE}_log.txt"
grep -q "failed: none" "$OUT/gpu_run_${MODE}_log.txt"
