"""The Hopper kernels' host side on the CPU: configuration by M, the split-K rule, word views."""

from __future__ import annotations

import torch

from fp4select.backends import triton_hopper as th


def test_each_m_gets_the_configuration_its_table_names():
    assert th._for_m(th.GEMV_BY_M, 1) == th.GEMV_BY_M[0][1]
    assert th._for_m(th.GEMV_BY_M, 5) == th.GEMV_BY_M[1][1]
    assert th._for_m(th.MMA_BY_M, 32).block_t == 16
    assert th._for_m(th.MMA_BY_M, 33).block_t == 64
    assert th._for_m(th.MMA_BY_M, 100_000) == th.MMA_BY_M[-1][1]


def test_split_k_aims_at_two_programs_per_sm():
    cfg = th.MmaConfig(128, 16, 32, 4, 3, 0)
    kw = 8192 // 8
    # The H200 sweep's best splits at M = 16: 4 at N = 8192, 8 at N = 4096, none at N = 28672.
    assert th._mma_split(16, 8192, kw, cfg, 132) == 4
    assert th._mma_split(16, 4096, 14336 // 8, cfg, 132) == 8
    assert th._mma_split(16, 28672, 4096 // 8, cfg, 132) == 1
    assert th._mma_split(16, 128, kw, cfg, 132) == 16  # capped
    assert th._mma_split(16, 128, 32, cfg, 132) == 1  # never more splits than K steps
    assert th._mma_split(16, 8192, kw, th.MmaConfig(128, 16, 32, 4, 3, 3), 132) == 3  # pinned


def test_word_views_refuse_rows_that_are_not_aligned():
    a = torch.zeros((3, 33), dtype=torch.uint8)
    assert th._words(a[:, 1:], torch.int64) is None  # 4-byte rows from an odd offset
    words = th._words(torch.zeros((3, 32), dtype=torch.uint8), torch.int64)
    assert words is not None and words.shape == (3, 4)
