"""Runs fp4select's Triton NVFP4 quantizer under Triton's CPU interpreter; one JSON line per case.

TRITON_INTERPRET must be set before triton is imported, so tests/test_quantize.py runs this in
its own process. Each case compares the kernel's bytes with fp4select.quantize.quantize_torch,
under every configuration in CONFIGS (the tables', the kernel before them, and tilings that
cover each code path: split or paired loads, padding rows by their own programs or by tiles,
tiles larger than M and smaller than it).
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch

from fp4select import formats
from fp4select import quantize as q
from fp4select.backends import _triton_interpret

_triton_interpret.enable()


def activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 1, k)[torch.randperm(k, generator=g)]
    x[:, torch.randperm(k, generator=g)[: max(1, k // 64)]] *= 60.0
    return x.to(dtype)


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))


CONFIGS = [
    None,  # the table's choice for this M
    *dict.fromkeys(
        [cfg for _, cfg in q.QUANT_BY_M + q.QUANT_BEFORE]
        + [
            q.QuantConfig(1, 16, 1),
            q.QuantConfig(2, 16, 4, split=False),
            q.QuantConfig(8, 32, 1),
            q.QuantConfig(16, 4, 4, pad_programs=False),
        ]
    ),
]


def report(case: str, x: torch.Tensor, gs: torch.Tensor, configs=CONFIGS) -> None:
    torch_path = q.quantize_torch(x, gs)
    for cfg in configs:
        kernel = q.fp4_quantize(x, gs, implementation="triton", config=cfg)
        print(
            json.dumps(
                {
                    "case": case,
                    "config": cfg.label if cfg else "table",
                    "shape": list(x.shape),
                    "dtype": str(x.dtype),
                    "same": same(kernel, torch_path),
                }
            )
        )


def main() -> None:
    # Odd shapes: M not a multiple of any tile (1, 17, 129), K/16 not a multiple of 4.
    for m, k, dtype in [
        (1, 64, torch.bfloat16),
        (3, 48, torch.float16),
        (17, 272, torch.bfloat16),
        (129, 96, torch.float32),
        (16, 512, torch.bfloat16),
        (20, 528, torch.float16),  # 33 blocks a row: a long loop at the interpreter's cost
    ]:
        x = activations(m, k, dtype, seed=m + k)
        gs = (448.0 * 6.0 / x.abs().max().float()).reshape(1)
        report(f"{m}x{k}", x, gs)
        report(f"{m}x{k}/saturating", x, gs * 4, [None])
        report(f"{m}x{k}/subnormal-scales", x, gs * 1e-3, [None])
    x = activations(4, 96, torch.float32, seed=1)
    x[0, :16] = 0.0
    x[0, 16] = -0.0
    x[1, 3] = float("nan")
    x[1, 16:32] = float("nan")
    x[2, 5] = float("inf")
    x[2, 40] = float("-inf")
    x[3, 48:64] = 1e-30
    report("special values", x, torch.tensor([2.5]))
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.5, 0.0, 0.5, 1.0])
    rows = [
        torch.cat([mids / 6.0 * a, torch.tensor([a, -a, 0.1, -0.3])])
        for a in (1.0, 1.0625, 0.0146484375, 464.0)
    ]
    report("ties", torch.stack(rows + [-r for r in rows]), torch.tensor([6.0]))
    wide = activations(5, 128, torch.bfloat16, seed=9)
    report("strided rows and columns", wide[::2, ::2], torch.tensor([3.0]))
    report("no rows", activations(1, 64, torch.bfloat16, seed=3)[:0], torch.tensor([1.0]), [None])
    # An infinite global scale (input_scale 0): zero blocks get NaN scales, padding stays 0.
    report(
        "infinite global scale",
        activations(3, 80, torch.bfloat16, seed=4),
        torch.tensor([float("inf")]),
    )
    # The kernel writes every output byte: allocations filled with 0xAB must not show through.
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(0xAB)

    torch.empty = poisoned
    try:
        report(
            "outputs allocated full of 0xAB",
            activations(5, 208, torch.bfloat16, seed=5),
            torch.tensor([9.0]),
        )
    finally:
        torch.empty = empty
    # Plant: the scales laid out linearly instead of swizzled must not pass for the kernel's.
    x = activations(130, 128, torch.bfloat16, seed=2)
    gs = torch.tensor([10.0])
    kernel = q.fp4_quantize(x, gs, implementation="triton")
    packed, scales = q.quantize_torch(x, gs)
    linear = formats.unswizzle_sf(scales, 130, 8, "128x4")
    planted = torch.zeros_like(scales.view(torch.uint8)).reshape(-1)
    planted[: linear.numel()] = linear.view(torch.uint8).reshape(-1)
    print(
        json.dumps(
            {
                "case": "plant",
                "same": True,
                "plant_same": same(kernel, (packed, planted.view(scales.shape))),
            }
        )
    )


if __name__ == "__main__":
    main()
