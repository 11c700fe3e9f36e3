#!/usr/bin/env bash
# warm --devices and distributed.sync on a 2-GPU machine, in one call (device time is scarce).
# Run from the repository root there, with platformdirs installed (see h200_run.sh):
#   bash benchmarks/multi_gpu_h200.sh   (writes its JSON and log under $OUT)
set -u
# KINDS.md: NVLink multicast stays off on these shared hosts, in every process we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-benchmarks/results}
{
  echo "== machine"; nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
  echo "== warm: 2 GPUs vs 1, then the NCCL tests"
  timeout 280 python3 benchmarks/bench_multi_gpu.py --out "$OUT" --budget-s 270
  echo "== examples/torchrun_sync.py over NCCL"
  FP4SELECT_CACHE_DIR=/tmp/fp4select-torchrun timeout 50 \
    python3 -m torch.distributed.run --nproc_per_node 2 examples/torchrun_sync.py --max-m 64
  echo "== GPU memory after all processes ended"; nvidia-smi --query-gpu=memory.used --format=csv
} 2>&1 | tee "$OUT/multi_gpu_h200x2_log.txt"
