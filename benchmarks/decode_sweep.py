"""Sweep the word decode kernel's tiles against the byte kernel and a copy, in one GPU run.

What ``_decode_into`` costs: torch-dequant and hopper-dequant decode the weight (N x K) and a
into bfloat16 before their GEMM. For each shape (rows R, K), NVFP4 with 128x4 scales, random
bytes and random valid scales: every tile configuration of ``dequant_bf16_words`` (rows per
program, words per program, warps, WIDE) is first compared with ``dequant_bf16`` bit for bit
(int32 views; a mismatch is printed, recorded, and that variant not timed), then each is
timed alone: CUDA events around one launch, L2 flushed before each (a 256 MB write), the
median of ``--runs`` after warm-up. The references read R*K/2 and write R*K*2 bytes, as the
decode does: ``copy+fill`` (a uint8 copy of the packed bytes into the output's first bytes,
then a fill of the rest: two contiguous kernels, the bandwidth to reach) and ``expand`` (each
int32 word written 4 times: one kernel, the decode's access pattern with no arithmetic).
TB/s counts the bytes read (data and scales) plus the bytes written; ``x`` is the byte
kernel's time over the variant's. Prints a table per shape and the configuration with the
lowest geometric-mean time over the shapes (to put in ``dequant.WORDS_TILE``); writes
``decode_sweep_cuda.json`` (machine, versions, date, every point) under ``--out``. About a
minute on an H200, most of it Triton compiling the configurations.

    PYTHONPATH=$PWD python benchmarks/decode_sweep.py [--shapes 8192x8192,...] [--runs 25]
        [--out DIR] [--time-limit-s 150]
    PYTHONPATH=$PWD python benchmarks/decode_sweep.py --smoke --out /tmp  # CPU, untimed

(PYTHONPATH: this tree's fp4select, not an installed one, as benchmarks/gpu_run.sh does.)
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import dumps, machine, table

from fp4select import formats
from fp4select.backends import dequant

SHAPES = [(8192, 8192), (28672, 4096), (4096, 14336), (4096, 8192), (2048, 8192)]
SMOKE_SHAPE = (37, 320)  # R not a multiple of any tile, K/2 = 160 bytes: partial words tiles
# (rows per program, words per program, warps, WIDE); every tile holds at least one word
# per thread, so no thread repeats another's work.
CONFIGS = [
    (1, 256, 2, False),
    (1, 512, 4, False),
    (2, 128, 2, False),
    (2, 256, 4, False),
    (4, 128, 4, False),
    (4, 256, 4, False),
    (4, 256, 8, False),
    (8, 64, 2, False),
    (8, 128, 4, False),
    (8, 256, 8, False),
    (16, 64, 4, False),
    (16, 128, 4, False),
    (16, 256, 8, False),
    (1, 256, 2, True),
    (2, 256, 4, True),
    (4, 128, 4, True),
    (4, 256, 4, True),
    (8, 128, 4, True),
    (8, 256, 8, True),
    (16, 128, 8, True),
]
FLUSH_BYTES = 256 << 20  # five times the H200's 50 MB L2


def label(cfg: tuple[int, int, int, bool]) -> str:
    br, bw, warps, wide = cfg
    return f"words {br}x{bw} w{warps}" + (" wide" if wide else "")


def inputs(
    r: int, k: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random packed bytes, random valid e4m3 scale bytes (0..0x7E, either sign) and the
    scale buffer's padded column count."""
    g = torch.Generator(device=device).manual_seed(seed)
    data = torch.randint(0, 256, (r, k // 2), dtype=torch.uint8, device=device, generator=g)
    rp, cp = formats.padded_sf_shape(r, k // 16, "128x4")
    scales = torch.randint(0, 0x7F, (rp * cp,), dtype=torch.uint8, device=device, generator=g)
    sign = torch.randint(0, 2, (rp * cp,), dtype=torch.uint8, device=device, generator=g)
    return data, scales | (sign << 7), cp


def decoders(kernels: Any, data: torch.Tensor, scales: torch.Tensor, cp: int) -> dict:
    """name -> (launch(out), tile config or None): the byte kernel, then every word config."""
    r, kh = data.shape
    words = data.view(torch.int32)

    def byte_kernel(out: torch.Tensor) -> None:
        kernels.dequant_bf16[(kernels.cdiv(r, 32), kernels.cdiv(kh, 64))](
            data, scales, out.view(torch.int32), r, kh, kh, cp,
            NVFP4=True, SF_8X4=False, BR=32, BKH=64, num_warps=4,
        )  # fmt: skip

    def word_kernel(cfg: tuple[int, int, int, bool]) -> Callable[[torch.Tensor], None]:
        br, bw, warps, wide = cfg

        def launch(out: torch.Tensor) -> None:
            kernels.dequant_bf16_words[(kernels.cdiv(r, br), kernels.cdiv(kh // 4, bw))](
                words, scales, out, r, kh // 4, words.stride(0), cp,
                NVFP4=True, SF_8X4=False, BR=br, BW=bw, WIDE=wide, num_warps=warps,
            )  # fmt: skip

        return launch

    found = {"dequant_bf16": (byte_kernel, None)}
    found.update({label(c): (word_kernel(c), c) for c in CONFIGS})
    return found


def references(data: torch.Tensor, out: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Plain copies that read the packed bytes and write the output's bytes."""
    n_in = data.numel()
    dst = out.view(-1).view(torch.uint8)
    src = data.reshape(-1)

    def copy_fill() -> None:
        dst[:n_in].copy_(src)
        dst[n_in:].zero_()

    def expand() -> None:
        out.view(-1).view(torch.int32).view(-1, 4).copy_(
            src.view(torch.int32)[:, None].expand(-1, 4)
        )

    return {"copy+fill": copy_fill, "expand": expand}


def median_us(fn: Callable[[], Any], flush: torch.Tensor, runs: int) -> float:
    """Median GPU time of ``fn`` with a cold L2, events recorded back to back and read at the
    end (no host sync between runs, so the host stays ahead of the GPU)."""
    for _ in range(3):
        fn()
    marks = []
    for _ in range(runs):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        marks.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in marks)


def point(kernels: Any, r: int, k: int, device: torch.device, runs: int) -> list[dict]:
    """Every variant at one shape: checked (word kernels), then timed (not on the CPU)."""
    data, scales, cp = inputs(r, k, device, seed=r + k)
    moved = data.numel() + scales.numel() + 2 * r * k
    expected = torch.empty((r, k), dtype=torch.bfloat16, device=device)
    out = torch.empty_like(expected)
    found = decoders(kernels, data, scales, cp)
    found["dequant_bf16"][0](expected)
    timed = device.type == "cuda"
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if timed else None
    rows = []
    for name, (launch, cfg) in found.items():
        row: dict[str, Any] = {"r": r, "k": k, "variant": name, "config": cfg}
        if cfg is not None:
            out.view(torch.int32).fill_(-1)  # poisoned: a word left unwritten mismatches
            launch(out)
            same = out.view(torch.int32) == expected.view(torch.int32)
            row["exact"] = bool(same.all())
            if not row["exact"]:
                bad = (~same).nonzero()[0].tolist()
                row["mismatches"] = int((~same).sum())
                row["first_mismatch"] = bad
                print(f"{r}x{k} {name}: {row['mismatches']} words differ, first at {bad}")
        if timed and row.get("exact", True):
            row["us"] = median_us(lambda launch=launch: launch(out), flush, runs)
        rows.append(row)
    for name, fn in references(data, out).items():
        rows.append({"r": r, "k": k, "variant": name, "config": None})
        if timed:
            rows[-1]["us"] = median_us(fn, flush, runs)
        else:
            fn()  # the smoke run only checks that it runs
    base = rows[0].get("us")
    for row in rows:
        if "us" in row:
            row["TBps"] = moved / row["us"] / 1e6
            row["x_vs_bytes"] = base / row["us"] if base else None
    return rows


def show(rows: list[dict]) -> str:
    def num(row: dict, key: str, fmt: str) -> str:
        return format(row[key], fmt) if row.get(key) is not None else "-"

    body = [
        [
            row["variant"] + (" <- _decode_into" if _is_default(row["config"]) else ""),
            {True: "yes", False: "NO"}.get(row.get("exact"), "-"),
            num(row, "us", ".1f"),
            num(row, "TBps", ".2f"),
            num(row, "x_vs_bytes", ".2f"),
        ]
        for row in rows
    ]
    return table(body, ["variant", "exact", "us", "TB/s", "x"])


def _is_default(cfg: Any) -> bool:
    return cfg is not None and tuple(cfg) == (*dequant.WORDS_TILE, False)


def fastest(rows: list[dict], shapes: int) -> tuple[str, float] | None:
    """The word configuration with the lowest geometric-mean time over the shapes, among those
    exact and timed at every shape."""
    times: dict[str, list[float]] = {}
    for row in rows:
        if row["config"] is not None and "us" in row:
            times.setdefault(row["variant"], []).append(row["us"])
    full = {n: t for n, t in times.items() if len(t) == shapes}
    if not full:
        return None
    name = min(full, key=lambda n: sum(map(math.log, full[n])))
    return name, math.exp(sum(map(math.log, full[name])) / shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(f"{r}x{k}" for r, k in SHAPES))
    parser.add_argument("--runs", type=int, default=25, help="timed runs per variant (median)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--time-limit-s", type=float, default=150.0, help="start no shape after")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny, untimed")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        from fp4select.backends import _triton_interpret

        _triton_interpret.enable()
        device, shapes = torch.device("cpu"), [SMOKE_SHAPE]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("decode_sweep needs a CUDA GPU (or --smoke)")
        device = torch.device("cuda")
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    from fp4select.backends import _triton_kernels as kernels

    if not hasattr(kernels, "dequant_bf16_words"):
        raise SystemExit(f"{kernels.__file__} has no word kernel: PYTHONPATH=<this tree>")
    started = time.perf_counter()
    rows: list[dict] = []
    skipped, failed = [], []
    for r, k in shapes:
        if time.perf_counter() - started > args.time_limit_s:
            skipped.append([r, k])
            continue
        try:
            here = point(kernels, r, k, device, args.runs)
        except Exception:
            failed.append({"r": r, "k": k, "error": traceback.format_exc()})
            print(f"{r}x{k} failed:\n{failed[-1]['error']}")
            continue
        rows += here
        print(f"\nR x K = {r} x {k}\n{show(here)}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    best = fastest(rows, len(shapes) - len(skipped) - len(failed))
    if best:
        print(f"\nfastest over the shapes (geometric mean): {best[0]}, {best[1]:.1f} us")
    if skipped:
        print(f"time limit: skipped {skipped}")
    record = {
        "benchmark": "decode_sweep",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "format": "nvfp4, 128x4 scales, random bytes and valid scales",
        "smoke": args.smoke,
        "runs": args.runs,
        "flush_bytes": FLUSH_BYTES,
        "words_tile": list(dequant.WORDS_TILE),
        "fastest": best[0] if best else None,
        "rows": rows,
        "skipped_shapes": skipped,
        "failed": failed,
        "seconds": time.perf_counter() - started,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"decode_sweep_{device.type}.json"
    path.write_text(dumps(record))
    print(f"wrote {path} in {record['seconds']:.0f} s")
    wrong = [row["variant"] for row in rows if row.get("exact") is False]
    if wrong or failed:
        raise SystemExit(f"not exact: {sorted(set(wrong))}; failed shapes: {len(failed)}")


if __name__ == "__main__":
    main()
