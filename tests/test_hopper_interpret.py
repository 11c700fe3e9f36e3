"""The Hopper kernels' pure-Triton twins, run by Triton's CPU interpreter against the reference.

The interpreter cannot run inline asm, so ``triton_hopper.ASM = False`` selects each decode's
twin; tests/test_hopper_asm.py proves the asm computes the same bits, and
tests/test_hopper_kernels_gpu.py runs the asm itself on a GPU. TRITON_INTERPRET must be set before
triton is imported, so the kernels run in a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp4select.backends import triton_fp4

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.slow,
    pytest.mark.skipif(not triton_fp4.triton_installed(), reason="triton is not installed"),
]

ROOT = Path(__file__).parent.parent

# The GEMV's twins are the interpreter's slowest kernels (seconds per program): its cases
# keep few programs and steps, each still covering what it is there for.
CHILD = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
from fp4select import validate
from fp4select.backends import dequant
from fp4select.backends import triton_hopper as th
from fp4select.keys import Problem, m_bucket
th.ASM = False
cases = [
    (th.run_gemv, th.GemvConfig(2, 4, 1), 8, 64, (1, 3), "128x4", "scalar", "bfloat16"),
    (th.run_gemv, th.GemvConfig(2, 4, 1), 6, 96, (2,), "8x4", "per_token", "float16"),
    (th.run_gemv, th.GemvConfig(2, 2, 1, 1), 6, 96, (1, 3), "8x4", "scalar", "bfloat16"),
    (th.run_gemv, th.GemvConfig(2, 2, 1, 0, 1), 6, 96, (4,), "128x4", "none", "float16"),
    # an odd number of blocks: the last scale pair reaches into the padding column
    (th.run_gemv, th.GemvConfig(2, 2, 1), 6, 48, (1, 2), "8x4", "scalar", "bfloat16"),
    (th.run_gemv, th.GemvConfig(2, 4, 1, 1), 6, 80, (1,), "128x4", "none", "float16"),
    # a decoded once per call (gemv_a_words), its workspace's planes padded past K
    (th.run_gemv, th.GemvConfig(2, 4, 1, pre=1), 6, 96, (3,), "8x4", "per_token", "bfloat16"),
    (th.run_gemv, th.GemvConfig(2, 2, 1, 1, pre=1), 6, 48, (4,), "128x4", "scalar", "float16"),
    (th.run_mma, th.MmaConfig(16, 16, 16, 1, 1, 2), 40, 512, (5,), "128x4", "none", "bfloat16"),
    (th.run_mma, th.MmaConfig(16, 16, 16, 1, 1, 0), 24, 160, (17,), "8x4", "per_token", "float16"),
    (th.run_mma, th.MmaConfig(16, 16, 16, 1, 1, 1, 2), 40, 288, (19,), "128x4", "scalar", "float16"),
    # the K split summed by each tile's last program, not a kernel of its own
    (th.run_mma, th.MmaConfig(16, 16, 16, 1, 1, 2, 8, 1), 40, 512, (5,), "8x4", "per_token", "bfloat16"),
    (th.run_mma, th.MmaConfig(16, 16, 16, 1, 1, 3, 8, 1), 24, 288, (17,), "128x4", "scalar", "float16"),
]
for run, cfg, n, k, ms, layout, alpha, out_dtype in cases:
    for m in ms:
        p = Problem(n=n, k=k, m_bucket=m_bucket(m), a_sf_layout=layout, alpha_kind=alpha, out_dtype=out_dtype)
        inputs = validate.make_inputs(p, m, "cpu", seed=m + n)
        res = validate.check(run(*inputs.args(p), cfg=cfg), inputs, p.torch_out_dtype)
        print(run.__name__, n, k, m, layout, alpha, out_dtype, "ok" if res.ok else "WRONG " + res.reason)
# The warm path's runners keep a plan per kind of call: a second call with other values (same
# shapes) must read its own tensors, not the first call's.
fast = [
    (th.fast_gemv, th.GemvConfig(2, 2, 1, 1, pre=1), 6, 48, 4, "128x4", "per_token", "float16"),
    (th.fast_mma, th.MmaConfig(16, 16, 16, 1, 1, 2), 40, 512, 5, "8x4", "scalar", "bfloat16"),
    (dequant.fast_hopper, None, 40, 256, 5, "8x4", "per_token", "bfloat16"),
]
for run, cfg, n, k, m, layout, alpha, out_dtype in fast:
    p = Problem(n=n, k=k, m_bucket=m_bucket(m), a_sf_layout=layout, alpha_kind=alpha, out_dtype=out_dtype)
    for seed in (1, 2):
        inputs = validate.make_inputs(p, m, "cpu", seed=seed)
        res = validate.check(run(*inputs.args(p), cfg=cfg), inputs, p.torch_out_dtype)
        print("fast", run.__name__, seed, "ok" if res.ok else "WRONG " + res.reason)
# The weight re-laid by tiles (hopper_args.tiled_words, hopper_sweep.py's family tiled): N, K
# not whole tiles or steps, a K split; the row-major words read as tiles must come out wrong.
import torch
from fp4select.backends import hopper_args
# The weight re-laid by tiles (hopper_args.tiled_words): a program's own tiles, and tiles of
# other rows and runs (a program reads several a step, a step crosses runs, or a run holds
# several steps); N, K not whole tiles, a K split. The same copy with each tile's rows in
# reverse order must come out wrong: the kernels read the copy, not the caller's weight.
import torch
from fp4select.backends import hopper_args
tiled = [
    (th.run_gemv, th.GemvConfig(2, 2, 1, 1), torch.int64, 2, 2, 5, 96, 3, "8x4", "scalar", "bfloat16"),
    (th.run_gemv, th.GemvConfig(2, 4, 1, 1), torch.int64, 4, 2, 5, 144, 3, "8x4", "scalar", "bfloat16"),
    (th.run_mma, th.MmaConfig(16, 16, 16, 1, 1, 3, 8, 1), torch.int32, 16, 16, 24, 288, 17, "128x4", "per_token", "float16"),
    (th.run_mma, th.MmaConfig(16, 16, 16, 1, 1, 2), torch.int32, 8, 32, 20, 288, 5, "8x4", "none", "bfloat16"),
    (th.run_mma, th.MmaConfig(16, 16, 16, 1, 1, 0), torch.int32, 4, 8, 37, 160, 2, "8x4", "scalar", "bfloat16"),
]
for run, cfg, word, rows, cols, n, k, m, layout, alpha, out_dtype in tiled:
    p = Problem(n=n, k=k, m_bucket=m_bucket(m), a_sf_layout=layout, alpha_kind=alpha, out_dtype=out_dtype)
    inputs = validate.make_inputs(p, m, "cpu", seed=m + n)
    t = hopper_args.tiled_words(hopper_args.words(inputs.args(p)[1].T, word), rows, cols)
    for name, words in (("tiles", t), ("flipped", t.flip(2).contiguous())):
        got = run(*inputs.args(p), cfg=cfg, tiled=words)
        ok = validate.check(got, inputs, p.torch_out_dtype).ok
        print("tiled", run.__name__, rows, cols, name, "ok" if ok else "WRONG")
if len(sys.argv) > 1:
    p = Problem(n=40, k=64, m_bucket=4)
    inputs = validate.make_inputs(p, 3, "cpu", seed=1)
    args = list(inputs.args(p))
    args[3] = inputs.b_descale.T.flip(0).T  # weight rows given the wrong rows of scales
    res = validate.check(th.run_mma(*args, cfg=th.MmaConfig(16, 16, 16, 1, 1, 1)), inputs, p.torch_out_dtype)
    print("planted", "ok" if res.ok else "WRONG")
"""


def _child(*args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.fixture(scope="module")
def child_lines() -> list[str]:
    """One interpreter child for both tests (each start costs Triton's import and compiles)."""
    return _child("plant")


def test_every_twin_matches_the_exact_reference(child_lines):
    lines = [line for line in child_lines if not line.startswith(("planted", "fast", "tiled"))]
    assert len(lines) == 16, child_lines
    assert all(line.endswith(" ok") for line in lines), lines


def test_the_warm_paths_planned_runners_read_each_calls_own_tensors(child_lines):
    lines = [line for line in child_lines if line.startswith("fast")]
    assert len(lines) == 6, child_lines
    assert all(line.endswith(" ok") for line in lines), lines


def test_a_planted_layout_mix_up_fails(child_lines):
    assert child_lines[-1] == "planted WRONG", child_lines


def test_the_kernels_read_a_weight_re_laid_by_tiles(child_lines):
    """W_TILE_ROWS reads hopper_args.tiled_words' layout exactly, and only that layout."""
    lines = [line for line in child_lines if line.startswith("tiled")]
    assert lines == [
        f"tiled {run} {rows} {cols} {name} {'ok' if name == 'tiles' else 'WRONG'}"
        for run, rows, cols in [
            ("run_gemv", 2, 2),
            ("run_gemv", 4, 2),
            ("run_mma", 16, 16),
            ("run_mma", 8, 32),
            ("run_mma", 4, 8),
        ]
        for name in ("tiles", "flipped")
    ], child_lines
