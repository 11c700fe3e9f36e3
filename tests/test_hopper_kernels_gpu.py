"""The Hopper kernels compiled, on a CUDA GPU: every layout, alpha kind and output dtype.

Each case runs the real inline asm (``triton_hopper.ASM``) at shapes that are not multiples of
any tile, against the exact reference (``validate.check``), into a fresh output and into a
NaN-poisoned ``out=``, and once more with a sliced (misaligned) activation that must be handed
to the byte-wise kernel. Run on a GPU machine with
``python -m pytest -m gpu tests/test_hopper_kernels_gpu.py``; the CPU proves the asm's bit logic
(tests/test_hopper_asm.py) and the twins (tests/test_hopper_interpret.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp4select import formats, validate
from fp4select.backends import (
    dequant,
    hopper_args,
    hopper_configs,
    hopper_tactics,
    triton_fp4,
    triton_hopper,
)
from fp4select.keys import Problem, m_bucket

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

COMBOS = [
    ("128x4", "scalar", "bfloat16"),
    ("8x4", "per_token", "float16"),
    ("128x4", "none", "float16"),
    ("8x4", "scalar", "bfloat16"),
]
RUNNERS = {
    "hopper-gemv": (triton_hopper.run_gemv, (1, 2, 3, 5, 8)),
    "hopper-mma": (triton_hopper.run_mma, (1, 7, 16, 33, 128, 256)),
    "hopper-ws": (triton_hopper.run_ws, (1, 64, 200, 515)),
    "hopper-dequant": (dequant.run_hopper, (1, 130, 515, 2100)),
}


@pytest.mark.parametrize("name", sorted(RUNNERS))
@pytest.mark.parametrize("n,k", [(136, 256), (4096, 4096), (520, 2064)])
@pytest.mark.parametrize("layout,alpha,out_dtype", COMBOS)
def test_matches_the_exact_reference(name, n, k, layout, alpha, out_dtype):
    run, ms = RUNNERS[name]
    for m in ms:
        problem = Problem(
            n=n,
            k=k,
            m_bucket=m_bucket(m),
            a_sf_layout=layout,
            alpha_kind=alpha,
            out_dtype=out_dtype,
        )
        inputs = validate.make_inputs(problem, m, "cuda", seed=m + n)
        res = validate.check(run(*inputs.args(problem)), inputs, problem.torch_out_dtype)
        assert res.ok, (name, m, n, k, layout, alpha, out_dtype, res.reason)
        out = torch.full((m, n), float("nan"), dtype=problem.torch_out_dtype, device="cuda")
        got = run(*inputs.args(problem, out))
        assert got is out
        assert validate.check(out, inputs, problem.torch_out_dtype).ok


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
def test_hopper_dequant_takes_mxfp4(out_dtype):
    for m in (3, 300):
        problem = Problem(
            n=520, k=2080, m_bucket=m_bucket(m), use_nvfp4=False, block_size=32, out_dtype=out_dtype
        )
        inputs = validate.make_inputs(problem, m, "cuda", seed=m)
        out = dequant.run_hopper(*inputs.args(problem))
        assert validate.check(out, inputs, problem.torch_out_dtype).ok


def _poison_padding(buffer: torch.Tensor, rows: int, cols: int, layout: str) -> None:
    """Every byte of a swizzled scale buffer outside the (rows, cols) grid set to 0x7F (e4m3
    NaN): the padding belongs to whoever wrote the checkpoint, and may hold anything."""
    flat = buffer.view(torch.uint8).view(-1)  # a view: raises if the buffer is not one block
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    keep[formats.sf_index(rows, cols, layout, flat.device).reshape(-1)] = True
    flat[~keep] = 0x7F


@pytest.mark.parametrize("layout", ["128x4", "8x4"])
def test_the_gemv_ignores_what_the_scale_padding_holds(layout):
    """With an odd number of blocks the GEMV reads its last scale pair into the padding column
    (``_hopper_kernels._scale_cols``); the weight words there are zeros, and no value of the
    padding may change a bit."""
    n, k = 520, 2064  # 129 blocks a row
    for m in (1, 3):
        problem = Problem(n=n, k=k, m_bucket=m_bucket(m), a_sf_layout=layout)
        inputs = validate.make_inputs(problem, m, "cuda", seed=m)
        clean = triton_hopper.run_gemv(*inputs.args(problem))
        _poison_padding(inputs.b_descale.T, n, k // 16, "128x4")
        _poison_padding(inputs.a_descale, m, k // 16, layout)
        out = triton_hopper.run_gemv(*inputs.args(problem))
        assert validate.check(out, inputs, problem.torch_out_dtype).ok
        assert torch.equal(out, clean)


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_a_misaligned_activation_is_served_by_the_byte_kernel(name):
    run, _ = RUNNERS[name]
    m, n, k = 3, 256, 512
    problem = Problem(n=n, k=k, m_bucket=m_bucket(m))
    inputs = validate.make_inputs(problem, m, "cuda", seed=5)
    wide = torch.zeros((m, k // 2 + 1), dtype=torch.uint8, device="cuda")
    wide[:, 1:] = inputs.a
    a = wide[:, 1:]  # same values, rows no longer 8-byte aligned
    args = list(inputs.args(problem))
    args[0] = a
    assert validate.check(run(*args), inputs, problem.torch_out_dtype).ok


@pytest.mark.parametrize(
    "cfg",
    [
        hopper_configs.WsConfig(64, 128, 4, 2),
        hopper_configs.WsConfig(128, 128, 2, 0),
        hopper_configs.WsConfig(256, 128, 2, 3),
        hopper_configs.WsConfig(64, 128, 5, 2, 128),  # one wgmma over the 128 tokens
        hopper_configs.WsConfig(128, 128, 3, 0, 128),
        hopper_configs.WsConfig(128, 256, 3, 2, 256, 0),  # no loader warp: 8 warps
        hopper_configs.WsConfig(256, 128, 3, 3, 128, 0),
    ],
    ids=str,
)
@pytest.mark.parametrize("n,k", [(520, 2080), (4096, 4096)])
@pytest.mark.parametrize("layout,alpha,out_dtype", COMBOS)
def test_hopper_ws_with_k_split(cfg, n, k, layout, alpha, out_dtype):
    """K split across programs, the partial sums reduced with alpha: M within a tile and past
    it, a last step past K (K = 2080), into a NaN-poisoned ``out``."""
    for m in (1, 64, 130, 300):
        problem = Problem(
            n=n, k=k, m_bucket=m_bucket(m), a_sf_layout=layout, alpha_kind=alpha,
            out_dtype=out_dtype,
        )  # fmt: skip
        inputs = validate.make_inputs(problem, m, "cuda", seed=m + n)
        out = torch.full((m, n), float("nan"), dtype=problem.torch_out_dtype, device="cuda")
        got = triton_hopper.run_ws(*inputs.args(problem, out), cfg=cfg)
        res = validate.check(got, inputs, problem.torch_out_dtype)
        assert got is out and res.ok, (cfg, m, n, k, layout, alpha, out_dtype, res.reason)


@pytest.mark.parametrize(
    "cfg",
    [hopper_configs.WsConfig(64, 128, 5, 0, 128)],  # a tactic: alternate steps, odd ring
    ids=str,
)
def test_consumers_taking_alternate_steps_read_each_step_at_a_large_shape(cfg):
    """Where consumers take alternate steps (64-row tiles), one may run ahead of the other: the
    four-consumer experiment (removed) with 3 stages gave 4-7% of outputs wrong at 8192 x 8192,
    M = 64-256, with the automatic K split on the H200, where the smaller shapes above passed."""
    for m in (64, 256):
        problem = Problem(n=8192, k=8192, m_bucket=m_bucket(m), alpha_kind="per_token")
        inputs = validate.make_inputs(problem, m, "cuda", seed=m)
        for _ in range(3):
            got = triton_hopper.run_ws(*inputs.args(problem), cfg=cfg)
            res = validate.check(got, inputs, problem.torch_out_dtype)
            assert res.ok, (cfg, m, res.reason)


@pytest.mark.parametrize(
    "cfg",
    [
        hopper_configs.WsConfig(128, 256, 3, -1, 256, 0),
        hopper_configs.WsConfig(128, 128, 3, -1, 128),  # with the loader warp
    ],
    ids=str,
)
@pytest.mark.parametrize(
    "n,k,m",
    [
        (4608, 7168, 1024),  # 128 x 256: 144 tiles, a whole one each, 12 in runs
        (4608, 7168, 512),  # 128 x 256: 72 tiles, all in runs
        (17024, 2048, 256),  # 133 tiles of 128 x 256 and 16 steps: most programs' runs empty
        (520, 2080, 300),  # a last step past K, M past a tile, 21 programs
        (8192, 8192, 64),  # the tiles fill the SMs: nothing cut, run as ws_split splits them
    ],
)
@pytest.mark.parametrize("layout,alpha,out_dtype", COMBOS[:2])
def test_hopper_ws_over_runs_of_k_steps(cfg, n, k, m, layout, alpha, out_dtype):
    """Stream-K: whole tiles first, the last wave's tiles in runs, shared tiles through the
    fixup, into a NaN-poisoned ``out``; twice, same bits; and captured in a graph."""
    problem = Problem(
        n=n, k=k, m_bucket=m_bucket(m), a_sf_layout=layout, alpha_kind=alpha, out_dtype=out_dtype
    )
    inputs = validate.make_inputs(problem, m, "cuda", seed=m + n)
    out = torch.full((m, n), float("nan"), dtype=problem.torch_out_dtype, device="cuda")
    got = triton_hopper.run_ws(*inputs.args(problem, out), cfg=cfg)
    res = validate.check(got, inputs, problem.torch_out_dtype)
    assert got is out and res.ok, (cfg, m, n, k, layout, alpha, out_dtype, res.reason)
    assert torch.equal(triton_hopper.run_ws(*inputs.args(problem), cfg=cfg), got)
    again = torch.empty_like(out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_hopper.fast_ws(*inputs.args(problem, again), cfg=cfg)
    again.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(again, got)


def test_hopper_ws_hands_a_python_number_alpha_to_the_mma_kernel():
    m = 200
    problem = Problem(n=520, k=2080, m_bucket=m_bucket(m))
    inputs = validate.make_inputs(problem, m, "cuda", seed=7)
    args = list(inputs.args(problem))
    args[4] = float(inputs.alpha.item())  # a number: kind 1, which the Gluon kernel does not take
    assert validate.check(triton_hopper.run_ws(*args), inputs, problem.torch_out_dtype).ok


def test_graph_capture_and_replay_give_the_same_bits():
    for run, m in (
        (triton_hopper.run_gemv, 2),
        (triton_hopper.run_mma, 16),
        (triton_hopper.run_ws, 256),
        (dequant.run_hopper, 600),
    ):
        problem = Problem(n=4096, k=4096, m_bucket=m_bucket(m))
        inputs = validate.make_inputs(problem, m, "cuda", seed=9)
        out = torch.empty((m, 4096), dtype=torch.bfloat16, device="cuda")
        eager = run(*inputs.args(problem)).clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run(*inputs.args(problem, out))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(*inputs.args(problem, out))
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("n,k", [(520, 2064), (4096, 4096)])
def test_every_tactic_candidate_matches_the_exact_reference(n, k):
    cases = [
        (triton_hopper.run_gemv, cfg, m)
        for cfg in hopper_configs.candidates("gemv", None)
        for m in (1, 5)
    ]
    low = 1
    for limit, cfgs in hopper_configs.MMA_TACTICS:
        cases += [(triton_hopper.run_mma, cfg, m) for cfg in cfgs for m in (low, limit)]
        low = limit + 1
    cases += [
        (triton_hopper.run_ws, cfg, m)
        for cfg in hopper_configs.candidates("ws", None)
        for m in (33, 300, 2100)
    ]
    dequant_tiles = (hopper_configs.DEQUANT_LARGE, hopper_configs.DEQUANT_SMALL)
    cases += [(dequant.run_hopper, cfg, 515) for cfg in dequant_tiles]
    for run, cfg, m in cases:
        problem = Problem(n=n, k=k, m_bucket=m_bucket(m), alpha_kind="per_token")
        inputs = validate.make_inputs(problem, m, "cuda", seed=m + k)
        res = validate.check(run(*inputs.args(problem), cfg=cfg), inputs, problem.torch_out_dtype)
        assert res.ok, (cfg, m, n, k, res.reason)


@pytest.mark.parametrize("n,k", [(520, 2064), (4096, 4096)])
def test_every_small_m_tactic_reads_a_weight_re_laid_by_tiles(n, k):
    """``hopper_sweep.py``'s family tiled: each GEMV and mma tactic reading
    ``hopper_args.tiled_words``' copy of the weight (tiles of a program's rows and step, and of
    16 rows x 128 bytes, its ``SHARED``), and each ``hopper-ws`` tile with a loader warp on its
    own tiles, exact, as on the weight itself."""
    cases = [
        (triton_hopper.run_gemv, torch.int64, cfg, tiles, m)
        for cfg in hopper_configs.candidates("gemv", None)
        for tiles in ((cfg.rows_per_program, cfg.blocks_per_step), (16, 16))
        for m in (1, 5)
    ]
    cases += [
        (triton_hopper.run_mma, torch.int32, cfg, tiles, m)
        for cfg in hopper_configs.candidates("mma", None)
        for tiles in ((cfg.block_n, cfg.words_per_step), (16, 32))
        for m in (3, cfg.block_t)
    ]
    cases += [  # hopper-ws's tiles with the loader warp, on their own tiles (where TMA reads
        # the weight: K a multiple of 32; else the call goes to hopper-mma's kernel, untiled)
        (triton_hopper.run_ws, torch.int32, cfg, (cfg.block_n, 16), m)
        for cfg in hopper_configs.candidates("ws", None)
        if cfg.loader_warp and cfg.split != -1 and k % 32 == 0
        for m in (64, 300)
    ]
    for run, word, cfg, tiles, m in cases:
        problem = Problem(n=n, k=k, m_bucket=m_bucket(m), alpha_kind="per_token")
        inputs = validate.make_inputs(problem, m, "cuda", seed=m + k)
        args = inputs.args(problem)
        tiled = hopper_args.tiled_words(args[1].T.view(word), *tiles)
        res = validate.check(run(*args, cfg=cfg, tiled=tiled), inputs, problem.torch_out_dtype)
        assert res.ok, (cfg, tiles, m, n, k, res.reason)


def test_tuning_times_every_candidate_and_its_choice_is_exact():
    kinds = {triton_hopper.run_gemv: "gemv", triton_hopper.run_mma: "mma"}
    kinds[triton_hopper.run_ws] = "ws"
    for run, m in (
        (triton_hopper.run_gemv, 1),
        (triton_hopper.run_mma, 16),
        (triton_hopper.run_ws, 256),
    ):
        problem = Problem(n=4096, k=4096, m_bucket=m_bucket(m))
        inputs = validate.make_inputs(problem, m, "cuda", seed=3)
        record = hopper_tactics.tune(run, problem, inputs.args(problem), name="x")
        candidates = hopper_configs.candidates(kinds[run], m)
        assert len(record["timed_us"]) == len(candidates), record
        assert all(us > 0 for us in record["timed_us"].values())
        pinned = hopper_tactics.pin(run, record)
        assert pinned.keywords["cfg"] in candidates
        assert list(dataclasses.astuple(pinned.keywords["cfg"])) == record["tactic"]
        assert validate.check(pinned(*inputs.args(problem)), inputs, problem.torch_out_dtype).ok


def test_a_candidate_too_large_for_the_gpu_is_skipped_and_named(monkeypatch):
    fits = hopper_configs.MmaConfig(128, 16, 16, 4, 3)
    too_big = hopper_configs.MmaConfig(128, 256, 16, 8, 6)  # about 400 KiB of shared memory
    monkeypatch.setattr(hopper_configs, "candidates", lambda kind, m: (too_big, fits))
    problem = Problem(n=4096, k=4096, m_bucket=m_bucket(16))
    inputs = validate.make_inputs(problem, 16, "cuda", seed=5)
    record = hopper_tactics.tune(triton_hopper.run_mma, problem, inputs.args(problem), name="x")
    key = " ".join(map(str, dataclasses.astuple(too_big)))
    assert key in record["skipped"] and "shared memory" in record["skipped"][key], record
    assert record["tactic"] == list(dataclasses.astuple(fits))


def test_programmatic_dependent_launch_changes_no_bit():
    """enable_pdl=True (the default, PDL on SM90) and False give the same output, eagerly and
    replayed from a graph, where the kernels of a call follow each other without a gap."""
    for run, m in (
        (triton_hopper.run_gemv, 1),
        (triton_hopper.run_mma, 9),
        (triton_hopper.run_ws, 130),  # K split in two: decode, main loop, reduction
    ):
        problem = Problem(n=4096, k=4096, m_bucket=m_bucket(m), alpha_kind="per_token")
        inputs = validate.make_inputs(problem, m, "cuda", seed=7)
        args = inputs.args(problem)
        plain = run(*args[:10], False)
        assert validate.check(plain, inputs, problem.torch_out_dtype).ok
        out = torch.full_like(plain, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(3):  # back to back, each launch overlapping the one before
                run(*inputs.args(problem, out))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(run(*args), plain) and torch.equal(out, plain), run.__name__


def test_the_split_summed_by_the_last_program_gives_the_reduction_kernels_bits():
    """``sum_last`` (each tile's last split program sums the partial sums) against the
    reduction kernel, eagerly and over graph replays of back-to-back calls, which must find
    the arrival counts back at zero each time; and the weight's scales converted by the GPU
    against SM80's integer path, same bits."""
    m = 16
    problem = Problem(n=4096, k=4096, m_bucket=m_bucket(m), alpha_kind="per_token")
    inputs = validate.make_inputs(problem, m, "cuda", seed=5)
    args = inputs.args(problem)
    split = hopper_configs.MmaConfig(128, 16, 32, 4, 3, split=4)
    summed = dataclasses.replace(split, sum_last=1)
    want = triton_hopper.run_mma(*args, cfg=split)
    assert validate.check(want, inputs, problem.torch_out_dtype).ok
    assert torch.equal(triton_hopper.run_mma(*args, cfg=summed), want)
    integer = triton_hopper._run_planes(args, "hopper-mma", summed, hw_e4m3=False)
    assert torch.equal(integer, want)
    outs = [torch.full_like(want, float("nan")) for _ in range(3)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            triton_hopper.run_mma(*inputs.args(problem, out), cfg=summed)
    for _ in range(4):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(out, want) for out in outs)
    counts = [v for key, v in triton_fp4._workspaces.items() if key[0] == "counts"]
    assert counts and all(int(c.abs().sum()) == 0 for c in counts)
