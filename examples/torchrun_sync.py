"""Every rank of a torchrun job serves the FP4 GEMMs with rank 0's decisions.

Rank 0 decides each key (from the disk cache, or by tuning); the other ranks adopt its
decisions without tuning, and all ranks prove by a hash that they agree, before any CUDA
graph is captured. Runs on GPUs (NCCL) or, for a try-out, on CPUs (gloo):

    torchrun --nproc_per_node 2 examples/torchrun_sync.py [--model PATH] [--max-m 64]

Without --model it uses the published shape of Llama-3.1-8B, split over the job's ranks.
Rank 0 prints one line per key as it decides it: a first run tunes every key, which takes
minutes on a CPU. The decisions go to a temporary folder per rank, removed at the end, unless
--cache-dir names one to keep them in (a deployment leaves the option out of its own code and
uses the user cache).
"""

from __future__ import annotations

import argparse
import os
import tempfile

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
    parser.add_argument("--cache-dir", help="keep the decisions here (default: a temporary folder)")
    args = parser.parse_args()
    scratch = None
    if args.cache_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="fp4select-example-")
    fp4select.configure(cache_dir=args.cache_dir or scratch.name)

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

    if rank == 0:  # decide here first, one line per key, so that a long first run shows progress
        for i, problem in enumerate(problems, 1):
            record = fp4select.explain(problem=problem, device=device, tune=True)
            print(
                f"rank 0: [{i}/{len(problems)}] {problem.describe()}: "
                f"{record['winner']} ({record['source']})",
                flush=True,
            )
    report = distributed.sync(problems=problems, device=device)
    print(
        f"rank {rank}/{world}: {report.keys} keys agreed (table {report.digest}); "
        f"adopted {report.adopted} from rank 0, tuned {fp4select.stats()['tunings']} here",
        flush=True,
    )
    tunings_before = fp4select.stats()["tunings"]

    # Serving: the first call binds the agreed winner; nothing is tuned on any rank now.
    n, k = shapes.shapes()[0]
    x, w = torch.randn(1, k, device=device), torch.randn(n, k, device=device)
    a, b = formats.quantize_nvfp4(x), formats.quantize_nvfp4(w)
    alpha = (1.0 / (a.global_scale * b.global_scale)).reshape(1).float()
    fp4select.best_mm_fp4(a.data, b.data.T, a.scales, b.scales.T, alpha, torch.bfloat16)
    tunings = fp4select.stats()["tunings"] - tunings_before
    print(f"rank {rank}: first GEMM N={n} K={k} served; tunings after sync: {tunings}", flush=True)
    dist.destroy_process_group()
    if scratch is not None:
        fp4select.configure()  # closes the sandbox worker before its folder goes
        scratch.cleanup()


if __name__ == "__main__":
    main()
