"""Wall time of ``fp4select warm`` for one model's shapes: 2 GPUs against 1, and NCCL agreement.

Each mode runs the real command line (``python -m fp4select warm --model ... --json``) in a
fresh cache, so every key is tuned:

* ``devices 0,1``: the worker pool on both GPUs;
* ``devices 0``: the same pool on one GPU (same per-process overheads, half the workers);
* ``serial``: plain ``warm`` without a pool, on cuda:0.

The model is Llama-3.1-70B at TP1 (published shape; 35 GB in NVFP4, a one-GPU deployment),
every M bucket up to --max-m. Then tests/test_distributed.py runs with NCCL, one GPU per rank.
Writes benchmarks/results/multi_gpu_h200x2.json (or --out), rewritten after each step so a
cut-off run keeps what it measured.

    python benchmarks/bench_multi_gpu.py [--max-m 8192] [--out DIR] [--budget-s 300]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, dumps, machine, table

ROOT = Path(__file__).resolve().parent.parent
LLAMA_31_70B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 80,
    "head_dim": 128,
}
NCCL_SAFE = {  # KINDS.md: NVLink multicast must stay off on shared hosts
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _env(**extra: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        **NCCL_SAFE,
        "PYTHONPATH": f"{ROOT}:{path}" if path else str(ROOT),
        **extra,
    }


def warm(model: Path, max_m: int, devices: str | None, timeout: float) -> dict[str, Any]:
    cache = tempfile.mkdtemp(prefix="fp4select-bench-")
    cmd = [sys.executable, "-m", "fp4select", "warm", "--model", str(model)]
    cmd += ["--max-m", str(max_m), "--json"] + (["--devices", devices] if devices else [])
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            env=_env(FP4SELECT_CACHE_DIR=cache),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        shown = [a if a != str(model) else "<model dir>" for a in cmd[3:]]
        return {"command": shown, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - started
    shown = [a if a != str(model) else "<model dir>" for a in cmd[3:]]  # no local paths
    row: dict[str, Any] = {"command": shown, "returncode": proc.returncode}
    row["process_wall_s"] = round(wall, 2)
    if proc.returncode not in (0, 1):
        row["error"] = proc.stderr[-2000:]
        return row
    report = json.loads(proc.stdout)
    results = report["results"]
    per_device: dict[str, dict[str, float]] = {}
    for r in results:
        d = per_device.setdefault(r.get("device") or report["devices"][0], {"keys": 0, "s": 0.0})
        d["keys"] += 1
        d["s"] += r.get("wall_seconds", r.get("seconds", 0.0))
    row.update(
        keys=len(results),
        tunings=report["stats"].get("tunings"),
        undecided=sum(1 for r in results if r["winner"] is None),
        winners=sorted({str(r["winner"]) for r in results}),
        warm_wall_s=report["wall_seconds"],
        per_device={
            k: {"keys": v["keys"], "key_s": round(v["s"], 2)} for k, v in per_device.items()
        },
    )
    return row


def nccl_tests(timeout: float) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/test_distributed.py",
        "-v",
        "-p",
        "no:cacheprovider",
    ]
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=_env(FP4SELECT_TEST_DIST_BACKEND="nccl"),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if "::" in ln and ("PASS" in ln or "FAIL" in ln)]
    return {
        "returncode": proc.returncode,
        "tests": lines,
        "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "",
        "tail": "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-m", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting steps after")
    args = parser.parse_args()
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "multi_gpu_h200x2.json"
    model = Path(tempfile.mkdtemp(prefix="fp4select-model-"))
    (model / "config.json").write_text(json.dumps(LLAMA_31_70B))
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    record: dict[str, Any] = {
        "benchmark": "multi_gpu_warm",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "model": "Llama-3.1-70B (published config), tp=1, no quantization config",
        "max_m": args.max_m,
        "isolation": os.environ.get("FP4SELECT_ISOLATION", "subprocess"),
        "modes": {},
    }

    def save() -> None:
        path.write_text(dumps(record))

    steps = [
        ("devices 0,1", lambda left: warm(model, args.max_m, "0,1", left)),
        ("devices 0", lambda left: warm(model, args.max_m, "0", left)),
        ("nccl", nccl_tests),
        ("serial", lambda left: warm(model, args.max_m, None, left)),
    ]
    for name, step in steps:
        left = args.budget_s - (time.perf_counter() - started)
        if left < 20:
            record["modes"][name] = {"skipped": "out of time budget"}
            continue
        print(f"== {name}", flush=True)
        result = step(left - 5)
        if name == "nccl":
            record["nccl_sync_tests"] = result
        else:
            record["modes"][name] = result
        print(json.dumps(result, default=str)[:1500], flush=True)
        save()
    modes = record["modes"]
    rows = [
        [
            m,
            r.get("keys", "-"),
            r.get("warm_wall_s", "-"),
            r.get("process_wall_s", "-"),
            r.get("per_device", r.get("error", r.get("skipped", ""))),
        ]
        for m, r in modes.items()
    ]
    one, two = modes.get("devices 0", {}), modes.get("devices 0,1", {})
    if "warm_wall_s" in one and "warm_wall_s" in two:
        record["speedup_2_vs_1"] = round(one["warm_wall_s"] / two["warm_wall_s"], 2)
    save()
    print(table(rows, ["mode", "keys", "warm wall s", "process wall s", "per device"]))
    print(f"speedup 2 GPUs vs 1: {record.get('speedup_2_vs_1')}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
