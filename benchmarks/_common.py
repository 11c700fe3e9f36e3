"""What every benchmark records next to its numbers: the machine, the versions, the date."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"


def machine(device: torch.device) -> dict[str, Any]:
    from fp4select.keys import environment_for

    info: dict[str, Any] = {
        "host_cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "environment": environment_for(device),
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["host_cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def dumps(record: dict[str, Any]) -> str:
    """A result as JSON that reads and diffs by the row: one line per top-level field, and a
    field holding a list of objects (the rows of a table) one line per row."""

    def one(value: Any) -> str:
        return json.dumps(value, sort_keys=True, default=str)

    def field(value: Any) -> str:
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            return "[\n" + ",\n".join(f"  {one(v)}" for v in value) + "\n ]"
        return one(value)

    body = ",\n".join(f" {json.dumps(k)}: {field(v)}" for k, v in sorted(record.items()))
    return "{\n" + body + "\n}\n"


def write(name: str, device: torch.device, payload: dict[str, Any], out: Path = RESULTS) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_{device.type}.json"
    record = {
        "benchmark": name,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        **payload,
    }
    path.write_text(dumps(record))
    return path


def graph_replay_us(fn, calls: int = 100) -> float:
    """Median time a call of ``fn`` takes replayed from a CUDA graph of ``calls`` back-to-back
    calls (captured after one warm-up call on a side stream, as torch asks)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    samples = []
    for _ in range(15):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(samples)


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=10) if len(ordered) >= 10 else [ordered[0]] * 9
    return {"p10": q[0], "p50": statistics.median(ordered), "p90": q[-1]}


def table(rows: list[list[Any]], header: list[str]) -> str:
    from fp4select.cli._common import table as _table

    return _table([[str(c) for c in r] for r in rows], header)


def activations(m: int, k: int, device: torch.device, seed: int) -> torch.Tensor:
    """bf16 ``(m, k)`` activations as LLM hidden states have them: channels whose scales span
    four decades, and one channel in 64 an outlier 60x larger (as tests/test_quantize.py)."""
    g = torch.Generator(device=device).manual_seed(seed)
    scale = torch.logspace(-3, 1, k, device=device)[torch.randperm(k, generator=g, device=device)]
    scale[torch.randperm(k, generator=g, device=device)[: max(1, k // 64)]] *= 60.0
    x = torch.randn(m, k, generator=g, device=device) * scale
    return x.to(torch.bfloat16)


def calibrated_scale(x: torch.Tensor) -> torch.Tensor:
    """flashinfer's global scale for ``x``, as a calibrated checkpoint's ``1 / input_scale``."""
    return (448.0 * 6.0 / x.abs().max().float()).reshape(1)


def sweep_points(shapes: str, ms: str, time_limit_s: float) -> Iterator[tuple[int, int, int]]:
    """(N, K, M) for each ``NxK`` of ``shapes`` and each M of ``ms`` (comma-separated), until
    ``time_limit_s`` has passed since the first; the points left are named as skipped."""
    started = time.perf_counter()
    for shape in shapes.split(","):
        n, k = map(int, shape.split("x"))
        for m in map(int, ms.split(",")):
            if time.perf_counter() - started > time_limit_s:
                print(f"time limit: skipped {n}x{k} M={m}")
                continue
            yield n, k, m
