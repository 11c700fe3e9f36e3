"""Every rank of a torchrun job serves the FP4 GEMMs with rank 0's decisions.

Rank 0 decides each key (from the disk cache, or by tuning); the other ranks adopt its
decisions without tuning, and all ranks prove by a hash that they agree, before any CUDA
graph is captured. Runs on GPUs (NCCL) or, for a try-out, on CPUs (gloo):

    torchrun --nproc_per_node 2 examples/torchrun_sync.py [--model PATH] [--max-m 64]

Without --model it uses the published shape of Llama-3.1-8B, split over the job's ranks.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fp4select
from fp4select import distributed, formats
from fp4select.model_shapes import model_shapes, shapes_from_path

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "head_dim": 128,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model folder or config.json")
    parser.add_argument("--max-m", type=int, default=64, help="largest batch to cover")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    # The keys this rank's model will call with: its tensor-parallel shard of every FP4 layer.
    shapes = (
        shapes_from_path(args.model, tp=world)
        if args.model
        else model_shapes(LLAMA_31_8B, tp=world)
    )
    problems = shapes.problems(args.max_m)

    report = distributed.sync(problems=problems, device=device)
    print(
        f"rank {rank}/{world}: {report.keys} keys agreed (table {report.digest}); "
        f"adopted {report.adopted} from rank 0, tuned {report.tuned} here",
        flush=True,
    )

    # Serving: the first call binds the agreed winner; nothing is tuned on any rank now.
    n, k = shapes.shapes()[0]
    x, w = torch.randn(1, k, device=device), torch.randn(n, k, device=device)
    a, b = formats.quantize_nvfp4(x), formats.quantize_nvfp4(w)
    alpha = (1.0 / (a.global_scale * b.global_scale)).reshape(1).float()
    fp4select.best_mm_fp4(a.data, b.data.T, a.scales, b.scales.T, alpha, torch.bfloat16)
    tunings = fp4select.stats()["tunings"] - report.tuned
    print(f"rank {rank}: first GEMM N={n} K={k} served; tunings after sync: {tunings}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
