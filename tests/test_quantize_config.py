"""The activation quantizer's tiling on the CPU: its table by M, its grid, and the two
benchmarks that choose it (benchmarks/quant_sweep.py) and measure it against the GEMM it
feeds (benchmarks/bench_gpu.py). Its bytes are proven in tests/test_quantize.py (under the
Triton interpreter) and tests/test_hopper_gpu.py (on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4select import quantize as q
from fp4select import validate
from fp4select.backends import emulation
from fp4select.keys import Problem

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def test_each_m_gets_the_configuration_its_table_names():
    table = (
        (1, q.QuantConfig(1, 8, 1)),
        (16, q.QuantConfig(4, 8, 2)),
        (None, q.QuantConfig(32, 16, 4)),
    )
    assert q.config_for(1, table) == table[0][1]
    assert q.config_for(2, table) == q.config_for(16, table) == table[1][1]
    assert q.config_for(17, table) == q.config_for(100_000, table) == table[2][1]
    assert q.config_for(5) == q.config_for(5, q.QUANT_BY_M)
    assert q.config_for(5, q.QUANT_BEFORE).label == "m16 c8 w2 pairs tiles-pad"
    with pytest.raises(ValueError, match="power of two"):
        q.QuantConfig(3, 8, 2)
    with pytest.raises(ValueError, match="power of two"):
        q.QuantConfig(4, 8, 0)


def test_the_grid_quantizes_only_rows_that_exist_and_zeroes_the_padding_apart():
    kernel = pytest.importorskip("fp4select._quantize_triton", reason="triton is not installed")
    cfg = q.QuantConfig(16, 8, 2)
    # M = 1: one row per tile, one tile, one row of programs that only store padding zeros.
    assert kernel.grid(1, 256, cfg) == (1, 2, 32)
    assert kernel.grid(3, 256, cfg) == (4, 2, 32)
    assert kernel.grid(16, 260, cfg) == (16, 2, 33)
    assert kernel.grid(128, 256, cfg) == (16, 8, 32)  # no padding rows: no padding programs
    assert kernel.grid(130, 256, cfg) == (16, 10, 32)
    # The kernel before the table: tiles over the whole padded grid, padding computed.
    before = q.QuantConfig(16, 8, 2, split=False, pad_programs=False)
    assert kernel.grid(1, 256, before) == (16, 8, 32)


def test_bench_gpu_times_the_quantizer_beside_the_pick_and_reports_its_share():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(BENCH))
    row = {"shape": "s", "n": 64, "k": 64, "m": 4, "backend_us": {"x": 8.0}, "picked": "x"}
    row |= {"oracle": "x", "regret": 1.0, "bf16_us": 16.0, "floor_us": 1.0}
    # On the CPU fp4_quantize runs the PyTorch path; the bench's code is the same.
    problem = Problem(n=64, k=64, m_bucket=4)
    sets = [validate.make_inputs(problem, 4, torch.device("cpu"), seed=s) for s in (1, 2)]
    seen = []

    def pick(*args):  # the pick: emulation, after checking what the layer hands it
        seen.append((args[0].shape, args[2].shape, args[10]))
        return emulation.make_runner(problem)(*args)

    row |= bench_gpu.quantizer_point(4, 64, torch.device("cpu"), row, problem, pick, sets)
    assert row["quantize_exact"] is True and row["quantize_us"] > 0
    assert row["quantize_config"] == q.config_for(4).label
    assert row["quantize_share_of_pick"] == pytest.approx(row["quantize_us"] / 8.0)
    assert row["layer_us"] == pytest.approx(row["quantize_us"] + 8.0)
    assert row["layer_over_bf16"] == pytest.approx(row["layer_us"] / 16.0)
    assert row["quantize_share_of_layer"] == pytest.approx(row["quantize_us"] / row["layer_us"])
    # The layer chain: the pick alone, and fed by the quantizer with PDL and without.
    gemm = row["chain_gemm_us"]
    assert row["quantize_in_chain_us"] == pytest.approx(row["chain_layer_us"] - gemm)
    assert row["quantize_in_chain_share"] == pytest.approx(row["quantize_in_chain_us"] / gemm)
    plain = (row["chain_layer_no_pdl_us"] - gemm) / gemm
    assert row["quantize_in_chain_no_pdl_share"] == pytest.approx(plain)
    assert {(a, sf) for a, sf, _ in seen} == {((4, 32), q.scale_shape(4, 64))}
    assert {pdl for *_, pdl in seen} == {True, False}
    summary = bench_gpu.summarize([row], 1e12)["quantize_decode"]
    assert summary["rows"] == 1 and summary["share_of_pick_worst"] == row["quantize_share_of_pick"]
    assert summary["rows_over_target"] == int(row["quantize_share_of_pick"] > 0.10)
    text = bench_gpu.quantizer_table([row, {**row, "m": 64}])
    assert "quant/pick" in text and len(text.splitlines()) == 3  # header, rule, the M <= 16 row


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.skipif(q.triton_available() is not None, reason="triton is not installed")
def test_the_sweep_runs_checks_and_suggests_a_table_under_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    args = ["--device", "cpu", "--ms", "1,17", "--ks", "64", "--out", str(tmp_path)]
    args += ["--time-limit-s", "1e9"]  # both points whatever this machine's speed today
    proc = subprocess.run(
        [sys.executable, "quant_sweep.py", *args],
        cwd=BENCH,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "quant_sweep.json").read_text())
    assert record["all_exact"] and {"machine", "date", "timing"} <= set(record)
    assert [(r["m"], r["k"]) for r in record["rows"]] == [(1, 64), (17, 64)]
    for r in record["rows"]:
        assert {"table", "before", "table pairs", "table tiles-pad"} <= set(r["us"])
        assert len(r["us"]) > 4 and r["best"] in r["us"]
    # The suggestion is a table fp4select.quantize can take as it is.
    scope = {"QuantConfig": q.QuantConfig}
    exec(record["suggested_python"], scope)
    table = scope["QUANT_BY_M"]
    assert table[-1][0] is None and all(isinstance(c, q.QuantConfig) for _, c in table)
    assert q.config_for(1, table).label == record["suggested"]["1"]["config"]
    assert "QUANT_BY_M = (" in proc.stdout


def test_the_serving_call_is_checked_without_creating_a_tensor():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    gs = torch.tensor([3.0])
    assert q._check(x, gs) is gs  # attribute reads only: no torch op in eager mode
    for other in (3.0, torch.tensor(3.0), torch.tensor([3.0], dtype=torch.float64)):
        checked = q._check(x, other)
        assert checked.dtype == torch.float32 and checked.shape == (1,) and float(checked) == 3.0
    with pytest.raises(ValueError, match="multiple of 16"):
        q._check(torch.zeros(2, 40), gs)
    with pytest.raises(TypeError, match="bfloat16"):
        q._check(torch.zeros(2, 32, dtype=torch.float64), gs)
    q.triton_available()
    before = q.triton_available.cache_info().hits
    q.triton_available()
    assert q.triton_available.cache_info().hits == before + 1  # looked up once per process
