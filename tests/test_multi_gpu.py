"""warm --devices: device lists, one-kind check, and the worker pool (real spawned processes).

The pool is exercised with CPU "devices" here; the GPU run and its wall times are in
benchmarks/results/multi_gpu_h200x2.json.
"""

from __future__ import annotations

import pytest
import torch

from fp4select.keys import Problem
from fp4select.multi_gpu import (
    DeviceError,
    check_same_environment,
    parse_devices,
    tuning_order,
    warm_parallel,
)
from fp4select.store import Store
from fp4select.timing import TimingOptions

FAST_TIMING = TimingOptions(budget_s=0.02, min_rounds=3, max_rounds=20, target_sample_s=1e-4)


def test_parse_devices():
    assert parse_devices("all", 4) == [0, 1, 2, 3]
    assert parse_devices(" 2,0 ", 4) == [2, 0]
    for spec, count, message in [
        ("all", 0, "no CUDA GPU is visible"),
        ("0,x", 2, "must be 'all' or GPU indices"),
        ("", 2, "must be 'all' or GPU indices"),
        ("0,2", 2, "names GPU 2, but GPUs 0..1 are visible"),
        ("-1", 2, "names GPU -1"),
        ("1,1", 2, "names a GPU twice"),
    ]:
        with pytest.raises(DeviceError, match=message):
            parse_devices(spec, count)


def _env(gpu, cc):
    return {"device": "cuda", "gpu": gpu, "cc": cc, "sm_count": 132, "torch": "2.11"}


def test_mixed_gpu_kinds_are_refused_naming_the_difference():
    devices = [torch.device("cuda", i) for i in range(3)]
    kinds = {0: _env("NVIDIA H200", 90), 1: _env("NVIDIA H200", 90), 2: _env("NVIDIA B200", 100)}
    with pytest.raises(DeviceError, match="mixes GPU kinds") as info:
        check_same_environment(devices, env_of=lambda d: kinds[d.index])
    assert "gpu: 'NVIDIA H200' on cuda:0, 'NVIDIA B200' on cuda:2" in str(info.value)
    assert "cc: 90 on cuda:0, 100 on cuda:2" in str(info.value)
    same = check_same_environment(devices[:2], env_of=lambda d: kinds[d.index])
    assert same == kinds[0]


def test_tuning_order_puts_the_largest_gemms_first():
    small, big, mid = (
        Problem(n=64, k=128, m_bucket=1),
        Problem(n=4096, k=4096, m_bucket=8192),
        Problem(n=4096, k=4096, m_bucket=16),
    )
    assert tuning_order([small, big, mid]) == [big, mid, small]


PROBLEMS = [Problem(n=n, k=128, m_bucket=b) for n in (32, 64, 96) for b in (1, 2, 4, 8)]


@pytest.mark.subprocess
def test_two_workers_decide_every_key_once_into_one_store(tmp_path):
    rows, counters = warm_parallel(
        PROBLEMS,
        [torch.device("cpu"), torch.device("cpu")],
        store_root=tmp_path,
        isolation="inprocess",
        timing=FAST_TIMING,
    )
    assert [r["problem"] for r in rows] == [p.describe() for p in PROBLEMS]  # input order
    assert all(r["winner"] == "emulation" and r["source"] == "tuned" for r in rows)
    assert counters["tunings"] == len(PROBLEMS)  # each key tuned once, by one worker
    assert len(list(Store(tmp_path).iter_entries(None))) == len(PROBLEMS)


@pytest.mark.subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_worker_that_dies_leaves_its_keys_to_the_others(tmp_path):
    # The cuda:0 worker dies at start on this CPU-only machine; the CPU worker does it all.
    rows, counters = warm_parallel(
        PROBLEMS[:4],
        [torch.device("cuda", 0), torch.device("cpu")],
        store_root=tmp_path,
        isolation="inprocess",
        timing=FAST_TIMING,
    )
    assert all(r["winner"] == "emulation" and r["device"] == "cpu" for r in rows)
    assert counters["tunings"] == 4


@pytest.mark.subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_when_every_worker_dies_each_key_is_reported_failed(tmp_path):
    rows, counters = warm_parallel(
        PROBLEMS[:2],
        [torch.device("cuda", 0)],
        store_root=tmp_path,
        isolation="inprocess",
        timing=FAST_TIMING,
    )
    assert [r["winner"] for r in rows] == [None, None]
    assert all("every worker died" in r["error"] for r in rows)
    assert counters == {}
