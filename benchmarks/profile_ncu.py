"""Hardware counters of the Hopper kernels beside bf16 cuBLAS, read with Nsight Compute.

Timing says how long a kernel takes; the counters say what bounds it (DRAM throughput, issue
slots, occupancy, the stall that dominates). On the lent H200 (Firecracker) ``ncu`` reads them
with ``--clock-control none``. Each case runs once to compile, then once inside the profiled
range, each beside ``torch.mm`` of bf16 operands of the same shape:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \\
        python benchmarks/profile_ncu.py [--cases small] > ncu.txt
    python benchmarks/profile_ncu.py --summarize ncu.txt   # -> results/ncu_h200.json

``--cases small``: the small-M picks of the record of 8a88f9f at N = K = 8192 beside
other tactics of the same M (add ``--section InstructionStats`` for the instruction counts,
and ``--metrics`` with this module's ``STALLS`` for each warp stall reason's share).

ncu flushes the caches before each kernel, so every operand comes from HBM.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
from pathlib import Path

from _common import RESULTS, dumps

METRICS = (
    "Duration",
    "DRAM Throughput",
    "Compute (SM) Throughput",
    "SM Active Cycles",
    "Elapsed Cycles",
    "Executed Ipc Active",
    "Issue Slots Busy",
    "Registers Per Thread",
    "Dynamic Shared Memory Per Block",
    "Theoretical Occupancy",
    "Achieved Occupancy",
    "Active Warps Per Scheduler",
    "Eligible Warps Per Scheduler",
    "Warp Cycles Per Issued Instruction",
    "Executed Instructions",
    "Memory Throughput",
    "L1/TEX Hit Rate",
    "L2 Hit Rate",
)


# Warp stall reasons, cycles per issued instruction (ask ncu for them with --metrics STALLS).
STALL_REASONS = (
    "long_scoreboard", "short_scoreboard", "wait", "math_pipe_throttle", "mio_throttle",
    "lg_throttle", "barrier", "not_selected", "selected", "no_instruction", "dispatch_stall",
    "drain", "imc_miss", "branch_resolving", "tex_throttle", "membar", "misc", "sleeping",
)  # fmt: skip
STALLS = ",".join(
    f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio" for r in STALL_REASONS
)
STALL_METRIC = re.compile(
    r"^\s+smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio\s+\S*\s+([\d.,]+)\s*$",
    re.M,
)


def run_cases(which: str) -> None:
    import torch

    from fp4select import validate
    from fp4select.backends import triton_hopper as th
    from fp4select.keys import Problem, m_bucket

    gemv, mma = th.GemvConfig, th.MmaConfig
    small = [  # 8a88f9f's picks at N = K = 8192 (M = 1, 2, 4, 16) and a rival of each M
        (8192, 8192, 1, th.run_gemv, gemv(4, 256, 4)),
        (8192, 8192, 1, th.run_gemv, gemv(4, 128, 2, late=1)),
        (8192, 8192, 2, th.run_gemv, gemv(8, 128, 2, late=1)),
        (8192, 8192, 2, th.run_gemv, gemv(8, 256, 4, late=1)),
        (8192, 8192, 4, th.run_gemv, gemv(8, 64, 1, 1, late=1)),
        (8192, 8192, 4, th.run_mma, mma(128, 16, 32, 4, 3, sum_last=1)),
        (8192, 8192, 16, th.run_mma, mma(128, 16, 32, 4, 3, sum_last=1)),
    ]
    record = [  # the record's picks at N = K = 8192 (benchmarks/results/gpu_h200.json)
        (8192, 8192, 1, th.run_gemv, th.GemvConfig(8, 128, 2)),
        # the GEMV with its scale tiles in the weight's layout (e9917bd) at M = 2 and 4, beside
        # hopper-mma, which it now beats at M = 4 on some shapes
        (8192, 8192, 2, th.run_gemv, th.GemvConfig(8, 128, 2)),
        (8192, 8192, 4, th.run_gemv, th.GemvConfig(8, 64, 1, 1)),
        (8192, 8192, 4, th.run_mma, th.MmaConfig(128, 16, 32, 4, 3)),
        (8192, 8192, 16, th.run_mma, th.MmaConfig(128, 16, 32, 4, 3)),
        (8192, 8192, 128, th.run_mma, th.MmaConfig(64, 128, 16, 4, 4, 1)),
        (8192, 8192, 256, th.run_mma, th.MmaConfig(128, 128, 16, 4, 3, 1)),
        # hopper-ws, the pick at M = 128-512 since its record (ea1753a), with its tiles there
        (8192, 8192, 128, th.run_ws, th.WsConfig(64, 128, 4, 0)),
        (8192, 8192, 256, th.run_ws, th.WsConfig(128, 128, 2, 0)),
        (8192, 8192, 512, th.run_ws, th.WsConfig(256, 128, 2, 0)),
    ]
    cases = small if which == "small" else record
    runs = []
    for n, k, m, run, cfg in cases:
        problem = Problem(n=n, k=k, m_bucket=m_bucket(m))
        args = validate.make_inputs(problem, m, "cuda", seed=1, with_reference=False).args(problem)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        run(*args, cfg=cfg)  # compiles outside the profiled range
        torch.mm(a, w.T)
        runs.append((run, args, cfg, a, w))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for run, args, cfg, a, w in runs:
        run(*args, cfg=cfg)
        torch.mm(a, w.T)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def summarize(text: str) -> list[dict[str, object]]:
    """One row per profiled kernel: its name, grid, block and the METRICS ncu printed."""
    rows = []
    heading = re.compile(r"^  (\S+) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)", re.M)
    starts = list(heading.finditer(text))
    for i, match in enumerate(starts):
        body = text[match.end() : starts[i + 1].start() if i + 1 < len(starts) else len(text)]
        row: dict[str, object] = {
            "kernel": match.group(1),
            "grid": [int(match.group(j)) for j in (2, 3, 4)],
            "block": [int(match.group(j)) for j in (5, 6, 7)],
        }
        for name in METRICS:
            found = re.search(rf"^\s+{re.escape(name)}\s+(\S+)?\s+([\d.,]+)\s*$", body, re.M)
            if found:
                unit = found.group(1) or ""
                row[f"{name} ({unit})" if unit else name] = float(found.group(2).replace(",", ""))
        for reason, value in STALL_METRIC.findall(body):  # --metrics, where asked for
            row[f"stall {reason}"] = float(value.replace(",", ""))
        stall = re.search(r"spends ([\d.]+) cycles being stalled (.*?)\.", " ".join(body.split()))
        if stall:
            row["top stall"] = f"{stall.group(1)} cycles {stall.group(2)}"
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summarize", metavar="NCU_TXT", help="ncu's text output to summarize")
    parser.add_argument("--out", default=str(RESULTS / "ncu_h200.json"))
    parser.add_argument("--cases", choices=("record", "small"), default="record")
    args = parser.parse_args()
    if not args.summarize:
        run_cases(args.cases)
        return
    rows = summarize(Path(args.summarize).read_text())
    record = {
        "benchmark": "profile_ncu",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": "NVIDIA H200 (CC 9.0), ncu --clock-control none",
        "rows": rows,
    }
    Path(args.out).write_text(dumps(record))
    for row in rows:
        print(
            f"{row['kernel'][:40]:40s} {row.get('Duration (us)', 0):7.2f} us "
            f"DRAM {row.get('DRAM Throughput (%)', 0):5.1f}% "
            f"SM {row.get('Compute (SM) Throughput (%)', 0):5.1f}% "
            f"occupancy {row.get('Achieved Occupancy (%)', 0):5.1f}%"
        )


if __name__ == "__main__":
    main()
