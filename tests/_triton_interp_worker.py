"""Runs the Triton kernels under Triton's CPU interpreter and reports each check as JSON lines.

TRITON_INTERPRET must be set before triton is imported, so this runs in its own process
(tests/test_backends_triton.py starts it). Each case is an odd shape (M, N, K not multiples of
any tile), checked against the exact float64 reference by fp4select.validate, once into a
fresh output and once into a NaN-poisoned ``out=``.

Usage: python _triton_interp_worker.py [plant]
``plant`` runs one deliberately wrong call (8x4 scales read as 128x4), which must fail.
"""

from __future__ import annotations

import functools
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch

from fp4select import validate
from fp4select.backends import _triton_interpret, dequant, triton_fp4
from fp4select.keys import Problem

_triton_interpret.enable()

# (format nvfp4?, a scale layout, alpha kind, out dtype): together they reach every branch.
COMBOS = [
    (True, "128x4", "scalar", "bfloat16"),
    (True, "8x4", "per_token", "float16"),
    (False, "128x4", "none", "bfloat16"),
    (False, "8x4", "scalar", "float16"),
]


def runners():
    for cfg in triton_fp4.CONFIGS:
        yield cfg.name, functools.partial(triton_fp4._run, cfg=cfg), cfg.max_m
        if cfg.split_k:  # force the partial-sum path: K is too short for the SM heuristic
            yield (
                f"{cfg.name}/split2",
                functools.partial(triton_fp4._run, cfg=cfg, split=2),
                cfg.max_m,
            )
    yield "torch-dequant", dequant.run_torch, None
    yield "hopper-dequant", dequant.run_hopper, None


def case(name, run, nv, layout, alpha, out_dtype, m):
    bs = 16 if nv else 32
    k = 224 if nv else 160  # 14 / 5 scale blocks: not a multiple of 4 (padded columns)
    problem = Problem(
        n=72,
        k=k,
        m_bucket=1,
        use_nvfp4=nv,
        block_size=bs,
        a_sf_layout=layout,
        alpha_kind=alpha,
        out_dtype=out_dtype,
    )
    inputs = validate.make_inputs(problem, m, "cpu", seed=m)
    out = run(*inputs.args(problem))
    first = validate.check(out, inputs, problem.torch_out_dtype)
    poisoned = torch.full((m, problem.n), float("nan"), dtype=problem.torch_out_dtype)
    returned = run(*inputs.args(problem, out=poisoned))
    second = validate.check(poisoned, inputs, problem.torch_out_dtype)
    return {
        "backend": name,
        "format": problem.format,
        "a_sf": layout,
        "alpha": alpha,
        "out": out_dtype,
        "m": m,
        "ok": first.ok and second.ok,
        "same_tensor": returned.data_ptr() == poisoned.data_ptr(),
        "reason": first.reason or second.reason,
        "worst_ratio": first.worst_ratio,
    }


def plant():
    problem = Problem(n=72, k=224, m_bucket=1, a_sf_layout="8x4")
    inputs = validate.make_inputs(problem, 11, "cpu")
    args = list(inputs.args(problem))
    args[8] = False  # claim 128x4 while the buffer is 8x4 (and 128-row padded size mismatches)
    padded = torch.zeros(128 * 16, dtype=torch.uint8)
    padded[: inputs.a_descale.numel()] = inputs.a_descale.view(torch.uint8).flatten()
    args[2] = padded.view(torch.float8_e4m3fn).reshape(128, 16)
    out = triton_fp4._run(*args, cfg=triton_fp4.CONFIGS[2])
    result = validate.check(out, inputs, torch.bfloat16)
    print(json.dumps({"backend": "planted", "ok": result.ok, "reason": result.reason}))


def main():
    if sys.argv[1:] == ["plant"]:
        plant()
        return
    for name, run, max_m in runners():
        for nv, layout, alpha, out_dtype in COMBOS:
            m = 3 if max_m is not None and max_m < 19 else 19
            print(json.dumps(case(name, run, nv, layout, alpha, out_dtype, m)), flush=True)
    # a_descale with a whole spare row tile, as engines allocate it: the checks accept it, so
    # every kernel must read the tiles M needs and ignore the rest.
    problem = Problem(n=72, k=224, m_bucket=1)
    for name, run, max_m in runners():
        m = 3 if max_m is not None and max_m < 19 else 19
        inputs = validate.make_inputs(problem, m, "cpu", seed=m)
        args = list(inputs.args(problem))
        spare = torch.zeros(128, args[2].shape[-1], dtype=torch.uint8)
        args[2] = torch.cat([args[2].view(torch.uint8), spare]).view(args[2].dtype)
        try:
            result = validate.check(run(*args), inputs, torch.bfloat16)
            ok, reason = result.ok, result.reason
        except ValueError as exc:
            ok, reason = False, str(exc)
        print(json.dumps({"backend": "spare-tiles", "of": name, "ok": ok, "reason": reason}))
    # Regression: two split-K configs with different max M share N and split; the smaller
    # workspace must not be handed to the larger config (it overflowed before the fix).
    triton_fp4.clear_workspaces()
    problem = Problem(n=72, k=224, m_bucket=1)
    small = validate.make_inputs(problem, 3, "cpu")
    big = validate.make_inputs(problem, 40, "cpu")
    gemv, m16 = triton_fp4.CONFIGS[0], triton_fp4.CONFIGS[1]
    triton_fp4._run(*small.args(problem), cfg=gemv, split=2)
    out = triton_fp4._run(*big.args(problem), cfg=m16, split=2)
    result = validate.check(out, big, torch.bfloat16)
    sizes = sorted(ws.numel() for ws in triton_fp4._workspaces.values())
    print(
        json.dumps(
            {
                "backend": "workspace-sharing",
                "ok": result.ok,
                "reason": result.reason,
                "workspaces": sizes,
            }
        )
    )


if __name__ == "__main__":
    main()
