"""The Triton kernels (and torch-dequant's Triton decode) on the CPU, through Triton's interpreter.

What this covers: every registered tile configuration, the split-K partial-sum path and
torch-dequant, at odd shapes (M, N, K not multiples of any tile; scale columns not a multiple
of 4), NVFP4 and MXFP4, 128x4 and 8x4 scales for a, alpha none / scalar / per-token, bf16 and
fp16 output, fresh output and NaN-poisoned ``out=``, against the exact reference. A planted
layout mix-up must fail, so the check is not vacuous. What only the GPU run checks
(benchmarks/gpu_check.py): compiled code (the interpreter runs NumPy), larger shapes, CUDA
graph capture, the automatic split choice, determinism, and speed.

The interpreter needs TRITON_INTERPRET=1 before triton is imported, so the kernels run in a
child process (tests/_triton_interp_worker.py); this process never imports triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp4select.backends import triton_fp4

pytestmark = [
    pytest.mark.subprocess,  # one interpreter process per case
    pytest.mark.slow,  # about a minute: the interpreter runs every program in NumPy
    pytest.mark.skipif(
        not triton_fp4.triton_installed(), reason="triton is not installed (pip install triton)"
    ),
]

HERE = Path(__file__).parent
ROOT = HERE.parent


def _worker(*args: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_triton_interp_worker.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return _worker()


def test_every_kernel_variant_matches_the_exact_reference(results):
    cases = [r for r in results if r["backend"] not in ("workspace-sharing", "spare-tiles")]
    names = {r["backend"] for r in cases}
    expected = {c.name for c in triton_fp4.CONFIGS} | {"torch-dequant", "hopper-dequant"}
    expected |= {f"{c.name}/split2" for c in triton_fp4.CONFIGS if c.split_k}
    assert names == expected
    assert len(cases) == 4 * len(expected)  # four combinations each: every branch reached
    failed = [r for r in cases if not (r["ok"] and r["same_tensor"])]
    assert not failed, failed
    # Exact operands: only fp32 summation and one output rounding, well inside the bound.
    # Except a Triton kernel's bfloat16 store: Triton 3.6's interpreter converts float32 to
    # bfloat16 by truncation (the GPU rounds to nearest; gpu_check measured <= 0.49 there),
    # which alone can use the whole bound; those cases must still pass.
    rounded = [r for r in cases if r["out"] == "float16" or r["backend"] == "torch-dequant"]
    assert len(rounded) >= len(expected)
    assert max(r["worst_ratio"] for r in rounded) < 0.75


def test_a_scales_with_a_spare_row_tile_are_read_as_the_checks_accept_them(results):
    spare = [r for r in results if r["backend"] == "spare-tiles"]
    assert len(spare) >= len(triton_fp4.CONFIGS) + 2  # every config and both dequants
    assert all(r["ok"] for r in spare), [r for r in spare if not r["ok"]]


def test_split_k_workspaces_are_not_shared_between_configs_of_different_max_m(results):
    (row,) = [r for r in results if r["backend"] == "workspace-sharing"]
    assert row["ok"], row
    assert len(row["workspaces"]) == 2  # one per (N, split, max M), not one for both


def test_a_scale_layout_mix_up_is_caught():
    (row,) = _worker("plant")
    assert not row["ok"] and row["reason"]
