"""The decoded weight reaches the tensor cores from registers, never through shared memory,
and the main loop's wgmma run asynchronously.

Triton keeps a decode in the wgmma register layout only when every input of the decode is a
32-bit (or wider) load: an 8-bit scale load, or a byte index computed from ``tl.arange``,
silently sends the whole decoded tile through shared memory, one store per value, and the
kernel stays correct but runs at half speed (docs/hopper_kernels.md). Correctness tests cannot
see that, so this compiles ``mma_planes`` for sm90 on the CPU (Triton ships ptxas; no GPU is
needed) and reads the TTGIR: no float16 tile of the weight's shape may be stored to shared
memory. A planted kernel with an 8-bit scale load shows the check can fail.

ptxas (also shipped with Triton) serializes every wgmma of a loop, waiting for each before
the next, when it finds the accumulator set outside the MMA inside a pipeline stage; a loop
that may run zero times is such a case. It says so only in its own output ("C7515"), so the
second check runs it on the kernel's PTX; a planted loop without ``tl.assume`` shows the check
can fail.

Each step's wgmma must be waited for (``wgmma.wait_group 0``) before the next step writes a
register: left in flight, they read their left operand while the next step's loads and
decode reuse those registers under Triton 3.6 (``_hopper_kernels.retired``). The third check
reads every tactic's SASS with ``tools/wgmma_hazards.py``; without ``retired`` the waits it
finds leave groups in flight (Triton 3.6: 7; 3.9: 1), so it can fail on either. The same
holds ``hopper-ws``'s Gluon kernel, which also shows that it compiles with this Triton.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
compiler = pytest.importorskip("triton.compiler")
backends_compiler = pytest.importorskip("triton.backends.compiler")

import functools  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

from fp4select.backends import _hopper_kernels as hk  # noqa: E402
from fp4select.backends import hopper_configs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]  # ptxas runs as a child process

SIGNATURE = {
    "x_ptr": "*fp16",
    "w_ptr": "*i32",
    "sw_ptr": "*i32",
    "shift_ptr": "*i32",
    "alpha_ptr": "*fp32",
    "out_ptr": "*bf16",
    "part_ptr": "*fp32",
    "M": "i32",
    "N": "i32",
    "KW": "i32",
    "MP": "i32",
    "stride_wn": "i32",
    "stride_om": "i32",
    "stride_on": "i32",
    "cp": "i32",
    "iters_per_split": "i32",
    "alpha_value": "fp32",
    "count_ptr": "*i32",
    "ALPHA": "constexpr",
    "PARTIALS": "constexpr",
    "BN": "constexpr",
    "BT": "constexpr",
    "BKW": "constexpr",
    "GROUP": "constexpr",
    "ASM": "constexpr",
    "HW_E4M3": "constexpr",
    "SUM_LAST": "constexpr",
    "PDL": "constexpr",
    "W_TILE_ROWS": "constexpr",
    "W_COLS": "constexpr",
}
# What a real launch specializes on: 16-aligned pointers, sizes and strides divisible by 16.
DIVISIBLE = {"N", "KW", "MP", "stride_wn", "stride_om", "cp"}


def _compile(fn, signature: dict, constexprs: dict, warps: int, stages: int, divisible=DIVISIBLE):
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, kind) in enumerate(signature.items())
        if kind.startswith("*") or name in divisible
    }
    _skip_without_sm90_toolchain()
    source = compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    target = backends_compiler.GPUTarget("cuda", 90, 32)
    # Not caught: with the toolchain present, a kernel that does not compile is a failure.
    return triton.compile(source, target=target, options={"num_warps": warps, "num_stages": stages})


@triton.jit
def _trivial(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


@functools.cache
def _sm90_unavailable() -> str:
    """Why this Triton cannot compile a trivial kernel for sm90 (no NVIDIA backend, no ptxas),
    or "" where it can."""
    source = compiler.ASTSource(fn=_trivial, signature={"x_ptr": "*i32"}, constexprs={})
    try:
        triton.compile(source, target=backends_compiler.GPUTarget("cuda", 90, 32))
    except Exception as exc:  # no sm90 backend or ptxas in this Triton
        return f"{type(exc).__name__}: {exc}"
    return ""


def _skip_without_sm90_toolchain() -> None:
    """Only a toolchain that cannot compile for sm90 at all is a reason to skip."""
    if _sm90_unavailable():
        pytest.skip(f"cannot compile for sm90 here: {_sm90_unavailable()}")


def _ttgir(fn, signature: dict, constexprs: dict, warps: int, stages: int) -> str:
    return _compile(fn, signature, constexprs, warps, stages).asm["ttgir"]


def _compile_mma(cfg):
    """``mma_planes`` as ``cfg`` launches it (scalar alpha)."""
    partials = cfg.split != 1
    constexprs = {"ALPHA": 2, "PARTIALS": partials, "GROUP": cfg.group, "ASM": True}
    # as launched on SM90 (mm_fp4's enable_pdl defaults to True)
    constexprs |= {"PDL": True, "HW_E4M3": True, "SUM_LAST": partials and bool(cfg.sum_last)}
    constexprs |= {"BN": cfg.block_n, "BT": cfg.block_t, "BKW": cfg.words_per_step}
    return _compile(hk.mma_planes, SIGNATURE, constexprs, cfg.num_warps, cfg.num_stages)


def _weight_tiles_in_shared_memory(ttgir: str, block_n: int, words: int) -> list[str]:
    """Shared-memory copies of a decoded plane (block_n x words) or of the joined operand."""
    tiles = (f"tensor<{block_n}x{words}xf16", f"tensor<{block_n}x{8 * words}xf16")
    return [
        line.strip()
        for line in ttgir.splitlines()
        if "local_alloc %" in line and any(t in line for t in tiles)
    ]


@pytest.mark.parametrize(
    "cfg",
    [
        hopper_configs.MMA_TACTICS[0][1][0],
        hopper_configs.MMA_TACTICS[2][1][0],
        hopper_configs.MMA_TACTICS[-1][1][0],
    ],
    ids=str,
)
def test_the_decoded_weight_never_goes_through_shared_memory(cfg):
    ttgir = _compile_mma(cfg).asm["ttgir"]
    assert "warp_group_dot" in ttgir  # wgmma, with the weight as the register operand
    assert "opIdx = 0" in ttgir
    assert _weight_tiles_in_shared_memory(ttgir, cfg.block_n, cfg.words_per_step) == []


@triton.jit
def _byte_scales(
    w_ptr, s_ptr, x_ptr, o_ptr, KW, BN: tl.constexpr, BT: tl.constexpr, BKW: tl.constexpr
):
    n = tl.arange(0, BN)
    t = tl.arange(0, BT)
    kw = tl.arange(0, BKW)
    acc = tl.zeros((BN, BT), tl.float32)
    for i in range(0, KW, BKW):
        q = tl.load(w_ptr + n[:, None] * KW + i + kw[None, :])
        s = tl.load(s_ptr + n[:, None] * KW + (i + kw[None, :]) // 2)  # 8-bit scales
        w0 = hk.word_to_f16(q, s.to(tl.int32), True)[0]
        acc = tl.dot(w0, tl.load(x_ptr + (i + kw)[:, None] * BT + t[None, :]), acc)
    tl.store(o_ptr + n[:, None] * BT + t[None, :], acc)


def test_a_planted_byte_load_is_caught():
    ttgir = _ttgir(
        _byte_scales,
        {"w_ptr": "*i32", "s_ptr": "*u8", "x_ptr": "*fp16", "o_ptr": "*fp32", "KW": "i32"}
        | {"BN": "constexpr", "BT": "constexpr", "BKW": "constexpr"},
        {"BN": 64, "BT": 16, "BKW": 16},
        4,
        3,
    )
    assert _weight_tiles_in_shared_memory(ttgir, 64, 16)


def _serialization_report(ptx: str, tmp_path) -> str:
    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    ptxas = nvidia.get_ptxas(90).path  # the one Triton itself runs for sm90
    if not ptxas or not os.path.exists(ptxas):
        pytest.skip("this Triton ships no ptxas for sm90")
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    run = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "kernel.o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return "\n".join(line for line in run.stderr.splitlines() if "C7515" in line)


@pytest.mark.parametrize(
    "cfg", [hopper_configs.MMA_TACTICS[0][1][0], hopper_configs.MMA_TACTICS[-1][1][0]], ids=str
)
def test_the_main_loop_wgmma_are_not_serialized(cfg, tmp_path):
    assert _serialization_report(_compile_mma(cfg).asm["ptx"], tmp_path) == ""


@triton.jit
def _maybe_empty_loop(w_ptr, x_ptr, o_ptr, KW, BN: tl.constexpr, BT: tl.constexpr):
    n = tl.arange(0, BN)
    t = tl.arange(0, BT)
    kw = tl.arange(0, 16)
    kx = tl.arange(0, 128)
    acc = tl.zeros((BN, BT), tl.float32)
    for i in range(0, KW, 16):  # no tl.assume(KW > 0): the loop may not run
        q = tl.load(w_ptr + n[:, None] * KW + i + kw[None, :])
        w = hk.plane_major(*hk.pair_to_f16(q, q & 0xFF, True), BN, 16)
        acc = tl.dot(w, tl.load(x_ptr + (i * 8 + kx)[:, None] * BT + t[None, :]), acc)
    tl.store(o_ptr + n[:, None] * BT + t[None, :], acc)


def test_a_planted_loop_that_may_not_run_is_caught(tmp_path):
    kernel = _compile(
        _maybe_empty_loop,
        {"w_ptr": "*i32", "x_ptr": "*fp16", "o_ptr": "*fp32", "KW": "i32"}
        | {"BN": "constexpr", "BT": "constexpr"},
        {"BN": 128, "BT": 16},
        4,
        3,
    )
    assert "C7515" in _serialization_report(kernel.asm["ptx"], tmp_path)


GEMV_SIGNATURE = {
    "a_ptr": "*i64",
    "w_ptr": "*i64",
    "sa_ptr": "*u8",
    "sw_ptr": "*u8",
    "alpha_ptr": "*fp32",
    "out_ptr": "*bf16",
    "M": "i32",
    "N": "i32",
    "KW": "i32",
    "stride_am": "i32",
    "stride_wn": "i32",
    "stride_om": "i32",
    "stride_on": "i32",
    "cp": "i32",
    "alpha_value": "fp32",
} | {
    name: "constexpr"
    for name in (
        "A_8X4", "ALPHA", "BM", "R", "BK", "ASM", "PREFETCH", "PDL", "EVICT_FIRST", "HW_E4M3",
        "LATE_TRIGGER", "PRE", "W_TILE_ROWS", "W_COLS",
    )
}  # fmt: skip


def _compile_gemv(
    cfg, m: int, a_8x4: bool = False, m_constant: bool = False, plane_aligned: bool = True
):
    """``gemv_dp4a`` as ``run_gemv`` launches ``cfg`` at M = m on SM90, the scales float8_e4m3fn
    (as validate.make_inputs and flashinfer's quantizer hand them). With ``pre``, stride_am is
    the workspace's plane, a multiple of 16 words, which Triton then knows (``plane_aligned``
    False: as if it were not); ``m_constant``: M a constant 1, as Triton would make it were the
    kernel specialized on M."""
    constexprs = {"A_8X4": a_8x4, "ALPHA": 3, "BM": m, "R": cfg.rows_per_program, "ASM": True}
    constexprs |= {"BK": cfg.blocks_per_step, "PREFETCH": bool(cfg.prefetch), "PDL": True}
    constexprs |= {"EVICT_FIRST": bool(cfg.evict_first), "HW_E4M3": True}
    constexprs |= {"LATE_TRIGGER": bool(cfg.late), "PRE": bool(cfg.pre)}
    signature = GEMV_SIGNATURE | {"sa_ptr": "*fp8e4nv", "sw_ptr": "*fp8e4nv"}
    if m_constant:
        signature["M"] = "constexpr"
        constexprs["M"] = 1
    divisible = DIVISIBLE | ({"stride_am"} if cfg.pre and plane_aligned else set())
    return _compile(hk.gemv_dp4a, signature, constexprs, cfg.num_warps, 3, divisible)


def _gemv_loop_conversions(cfg, m: int, a_8x4: bool, plane_aligned: bool = True) -> list[str]:
    """The layout conversions inside the GEMV's K loop, compiled as ``run_gemv`` launches
    ``cfg`` at M = m on SM90 (each goes through shared memory behind barriers)."""
    ttgir = _compile_gemv(cfg, m, a_8x4, plane_aligned=plane_aligned).asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for") : ttgir.index("scf.yield")]
    return [line.strip() for line in loop.splitlines() if "convert_layout" in line]


@pytest.mark.parametrize("cfg", hopper_configs.candidates("gemv", None), ids=str)
def test_the_gemv_loop_keeps_every_tile_in_the_weight_s_register_layout(cfg):
    """The scale bytes are declared in pairs (``_hopper_kernels._scale_cols``) so that they load
    in the weight's layout; lose the declaration and every step converts the scale tile and the
    products through shared memory (measured: up to 1.7x the time)."""
    for m in (1, 2, 4, 8):
        for a_8x4 in (False, True):
            assert _gemv_loop_conversions(cfg, m, a_8x4) == [], (m, a_8x4)


def test_the_conversion_check_can_fail_and_the_a_words_planes_must_be_padded():
    """With a's decoded words ``gemv_a_words``' planes apart and that stride not known to be a
    multiple of 16 (K / 16 unpadded), Triton loads them in a layout of their own and converts
    the weight's tiles to it every step: so ``run_gemv`` pads the planes."""
    pre = hopper_configs.GemvConfig(4, 64, 1, late=1, pre=1)
    assert _gemv_loop_conversions(pre, 4, False, plane_aligned=False) != []


def _gemv_loop_table_copies(cfg, m: int, m_constant: bool = False) -> int:
    """Copies of a lookup table's word from a uniform register into a register in the GEMV's K
    loop: ptxas' way of handing an immediate table to each ``prmt``, which ``lane_tables``
    exists to avoid (the loop's other uniform copies, pointers, are not counted). Compiled
    as ``_compile_gemv`` says."""
    sass = _hazard_tool()._sass(_compile_gemv(cfg, m, m_constant=m_constant))
    lines = sass.splitlines()
    loops = []  # each backward branch's span of lines
    for i, line in enumerate(lines):
        branch = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        start = branch and next(
            (j for j, x in enumerate(lines) if x.startswith(branch[1] + ":")), None
        )
        if start is not None and start < i:
            loops.append(lines[start:i])
    k_loop = max(loops, key=lambda body: sum(" IDP." in x for x in body))
    tables = "|".join(f"{word:#x}" for word in (hk.TABLE_POS[0], hk.TABLE_NEG[0]))
    held = set(re.findall(rf"UMOV (UR\d+), (?:{tables}) ;", sass))  # a table's word, uniform
    copy = re.compile(r"(?:IMAD\.U32|IMAD\.MOV\.U32|MOV) R\d+, (?:RZ, RZ, )?(UR\d+) ;")
    return sum(bool(m) and m[1] in held for m in map(copy.search, k_loop))


@pytest.mark.parametrize(
    ("cfg", "m"),
    [(c, m) for c in hopper_configs.candidates("gemv", 1) for m in (1, 2)]
    + [(c, 4) for c in hopper_configs.candidates("gemv", 4)],
    ids=str,
)
def test_the_gemv_loop_holds_its_decode_tables_in_registers(cfg, m):
    """Copied before every ``prmt`` they cost up to 1 instruction in 6 of the loop (measured:
    docs/hopper_kernels.md, 'The GEMV's decode in fewer instructions')."""
    assert _gemv_loop_table_copies(cfg, m) == 0


def test_the_table_check_can_fail_and_the_kernel_is_not_specialized_on_m():
    """With M a constant 1 ptxas folds ``lane_tables``' trick and copies the tables again: so
    the kernel must not let Triton specialize M."""
    assert _gemv_loop_table_copies(hopper_configs.GemvConfig(4, 256, 4), 1, m_constant=True) > 0
    assert "M" in hk.gemv_dp4a.do_not_specialize


def test_the_gemv_layout_check_can_fail():
    """A program whose threads span more than one weight row per 16-byte column (8 rows x 128
    blocks on 4 warps) gets its a-row tiles in another layout: the check sees the conversions."""
    assert _gemv_loop_conversions(hopper_configs.GemvConfig(8, 128, 4), 1, False)


@pytest.mark.parametrize("pdl", [True, False])
def test_pdl_puts_the_grid_dependency_wait_first_and_nothing_without_it(pdl):
    """With PDL the kernels wait for the kernel before them (griddepcontrol.wait) before they
    read anything and let the next launch (launch_dependents): ``mma_planes`` and a ``late``
    GEMV only after their K loop (its last wgmma or dp4a), so that the next kernel's programs
    do not wait on the SMs the loop streams through; without PDL neither is there (it would
    fail to assemble below SM90, where nothing asks for PDL)."""
    cfg = hopper_configs.MMA_TACTICS[0][1][0]
    constexprs = {"ALPHA": 2, "PARTIALS": True, "GROUP": cfg.group, "ASM": True, "PDL": pdl}
    constexprs |= {"BN": cfg.block_n, "BT": cfg.block_t, "BKW": cfg.words_per_step}
    mma = _compile(hk.mma_planes, SIGNATURE, constexprs, cfg.num_warps, cfg.num_stages)
    kernels = {"mma": mma}
    for late in (False, True):
        gemv_constexprs = {"A_8X4": False, "ALPHA": 2, "BM": 4, "R": 8, "BK": 64, "ASM": True}
        gemv_constexprs |= {"PREFETCH": True, "PDL": pdl, "EVICT_FIRST": False, "HW_E4M3": True}
        gemv_constexprs |= {"LATE_TRIGGER": late}
        gemv = _compile(hk.gemv_dp4a, GEMV_SIGNATURE, gemv_constexprs, 1, 3)
        kernels["gemv late" if late else "gemv"] = gemv
    for name, kernel in kernels.items():
        ptx = kernel.asm["ptx"]
        body = ptx[ptx.index("{", ptx.index(".entry")) :]
        if not pdl:
            assert "griddepcontrol" not in body
            continue
        wait = body.index("griddepcontrol.wait")
        trigger = body.index("griddepcontrol.launch_dependents")
        assert "ld.global" not in body[:wait] and "cp.async" not in body[:wait]
        loop_op = "wgmma.mma_async" if name == "mma" else "dp4a.s32"
        last_loop_op = body.rindex(loop_op)
        if name == "gemv":
            assert trigger < body.index(loop_op), name  # at the start
        else:
            assert last_loop_op < trigger < body.index("st.global"), name


QUANT_SIGNATURE = {
    "x_ptr": "*bf16", "gs_ptr": "*fp32", "out_ptr": "*u8", "sf_ptr": "*u8", "M": "i32",
    "K": "i32", "stride_xm": "i32", "stride_xk": "i32", "CP": "i32", "TILES_M": "i32",
} | {name: "constexpr" for name in ("BLOCK_M", "BLOCK_C", "SPLIT", "PAD_PROGRAMS", "PDL")}  # fmt: skip


@pytest.mark.parametrize("pdl", [True, False])
def test_the_quantizer_lets_the_gemm_launch_before_it_waits_for_the_layer_before(pdl):
    """With PDL the activation quantizer triggers its dependents (the GEMM it feeds) first,
    then waits for the kernel before it, before it reads anything; without PDL, neither."""
    from fp4select import _quantize_triton

    constexprs = {"BLOCK_M": 1, "BLOCK_C": 16, "SPLIT": True, "PAD_PROGRAMS": True, "PDL": pdl}
    ptx = _compile(_quantize_triton._quantize_kernel, QUANT_SIGNATURE, constexprs, 1, 3)
    body = ptx.asm["ptx"][ptx.asm["ptx"].index("{", ptx.asm["ptx"].index(".entry")) :]
    if pdl:
        trigger, wait = (
            body.index("griddepcontrol.launch_dependents"),
            body.index("griddepcontrol.wait"),
        )
        assert trigger < wait
        assert "ld.global" not in body[:wait]
    else:
        assert "griddepcontrol" not in body


@pytest.mark.parametrize("evict_first", [True, False])
def test_the_gemv_asks_l2_to_evict_the_weight_first_only_when_told(evict_first):
    """``GemvConfig.evict_first`` reaches the weight's loads as an eviction hint (measured
    faster at M = 4 on the H200), and the tactics without it load as before."""
    constexprs = {"A_8X4": False, "ALPHA": 2, "BM": 4, "R": 8, "BK": 128, "ASM": True}
    constexprs |= {"PREFETCH": False, "PDL": False, "EVICT_FIRST": evict_first, "HW_E4M3": True}
    ptx = _compile(hk.gemv_dp4a, GEMV_SIGNATURE, constexprs, 2, 3).asm["ptx"]
    assert ("evict_first" in ptx) is evict_first


def _hazard_tool():
    path = Path(__file__).resolve().parent.parent / "tools" / "wgmma_hazards.py"
    spec = importlib.util.spec_from_file_location("wgmma_hazards", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


EVERY_TACTIC = sorted(
    {c for _, cs in hopper_configs.MMA_TACTICS for c in cs},
    key=str,
)


@pytest.mark.parametrize("cfg", EVERY_TACTIC, ids=str)
def test_every_step_waits_for_its_wgmma_before_the_next_writes_a_register(cfg):
    kernel = _compile_mma(cfg)
    tool = _hazard_tool()
    loop = tool.main_loop(tool._sass(kernel))
    waits = [line for line in loop if line.startswith("WARPGROUP.DEPBAR")]
    assert waits, "no wgmma wait in the main loop"
    assert all(line.endswith("gsb0, 0x0") for line in waits), waits
    assert tool.hazards(loop) == []


def _compile_ws(cfg, alpha: int, pdl: bool = False, tiled: bool = False):
    """``hopper-ws``'s kernel as ``run_ws`` launches ``cfg`` with alpha of kind ``alpha``
    (Gluon, for sm90), under PDL or not (``tiled``: reading a re-laid weight, an experiment)."""
    gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")
    gl = pytest.importorskip("triton.experimental.gluon.language")
    from fp4select.backends import _hopper_ws

    _skip_without_sm90_toolchain()
    bn, words = cfg.block_n, _hopper_ws.STEP_WORDS
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, words], gl.int32)
    xw = cfg.mma_tokens
    x_layout = gl.NVMMASharedLayout.get_default_for([8 * words, xw], gl.float16)
    signature = {
        "w_desc": f"tensordesc<i32[{bn}, {words}],{w_layout!r}>",
        "x_desc": f"tensordesc<fp16[{8 * words}, {xw}],{x_layout!r}>",
        "sw_ptr": "*i32", "alpha_ptr": "*fp32", "out_ptr": "*bf16",
        "M": "i32", "N": "i32", "KW": "i32", "cp": "i32", "stride_om": "i32",
        "stride_on": "i32", "alpha_stride": "i32", "per_split": "i32", "split_stride": "i32",
    } | dict.fromkeys(("BN", "BT", "BKW", "STAGES", "GROUP"), "constexpr")  # fmt: skip
    constexprs = {"BN": bn, "BT": cfg.block_t, "BKW": words, "STAGES": cfg.stages, "GROUP": 8}
    signature["OWN_LOADS"] = "constexpr"
    constexprs["OWN_LOADS"] = not cfg.loader_warp
    signature["PDL"] = "constexpr"
    constexprs["PDL"] = pdl
    signature["W_TILED"] = "constexpr"
    constexprs["W_TILED"] = tiled
    stride = _hopper_ws.ALPHA_STRIDE[alpha]
    if stride == 1:  # Triton specializes an int argument of 1 into a constant
        signature["alpha_stride"] = "constexpr"
        constexprs["alpha_stride"] = 1
    source = gluon_runtime.GluonASTSource(
        fn=_hopper_ws.mma_ws, signature=signature, constexprs=constexprs
    )
    target = backends_compiler.GPUTarget("cuda", 90, 32)
    return triton.compile(
        source,
        target=target,
        options={
            "num_warps": 4,
            "maxnreg": _hopper_ws.launch_regs(cfg.loader_warp),
            "launch_pdl": pdl,
        },
    )


# and tiles the sweep times that no tactic uses
WS_TILES = (
    *hopper_configs.candidates("ws", None),
    hopper_configs.WsConfig(256, 128, 3),
    hopper_configs.WsConfig(128, 128, 2),
    hopper_configs.WsConfig(64, 128, 4),
)


@pytest.mark.parametrize("cfg", WS_TILES, ids=str)
@pytest.mark.parametrize("alpha", [0, 2, 3])
def test_hopper_ws_compiles_and_waits_for_each_steps_wgmma(cfg, alpha):
    tool = _hazard_tool()
    sass = tool._sass(_compile_ws(cfg, alpha, pdl=True))  # as SM90 runs it by default
    loops = tool.mma_loops(sass)
    assert len(loops) == 2  # the two consumer partitions

    def spills(lines):
        return [line for line in lines if re.search(r"\b(STL|LDL)\b", line)]

    # within the registers run_ws launches it with: nothing spilled to local memory, but
    # around the loops of the 256-token tiles and of 256 x 128 with alpha per token (its
    # prologue holds the first stages' loads across PDL's wait); none in any loop
    in_loops = [line for loop in loops for line in loop]
    around_loops = cfg.block_t == 256 or (not cfg.loader_warp and alpha == 3)
    assert not spills(in_loops if around_loops else sass.splitlines())
    for loop in loops:
        # 8 planes x the token halves (or the whole tile) x the consumer's 64-row MMA tiles
        rows = cfg.block_n // 2 if cfg.block_n >= 128 else cfg.block_n
        wgmma = [line for line in loop if "HGMMA" in line]
        assert len(wgmma) == 8 * cfg.block_t // cfg.mma_tokens * rows // 64
        assert all(f"HGMMA.64x{cfg.mma_tokens}x16" in line for line in wgmma), wgmma[:2]
        waits = [line for line in loop if line.startswith("WARPGROUP.DEPBAR")]
        assert waits and all(line.endswith("gsb0, 0x0") for line in waits), waits
        assert tool.hazards(loop) == []
        # The 64-row tiles' consumers take turns: each hands the other its turn (an mbarrier
        # arrive) once its step's wgmma is issued, before waiting for it; the others do not.
        last = max(i for i, line in enumerate(loop) if "HGMMA" in line)
        wait = next(i for i, line in enumerate(loop) if line.startswith("WARPGROUP.DEPBAR"))
        handed = [line for line in loop[last:wait] if "SYNCS.ARRIVE" in line]
        assert bool(handed) == (cfg.block_n == 64), loop[last:wait]


@pytest.mark.parametrize(
    "cfg", [c for c in hopper_configs.candidates("ws", None) if c.loader_warp], ids=str
)
def test_hopper_ws_reading_tiles_loads_and_waits_as_on_rows(cfg):
    """``W_TILED`` (hopper_sweep.py's family tiled) moves only the weight's TMA coordinates:
    the same TMA loads and wgmma in the same loops, each step's wgmma still waited for."""
    tool = _hazard_tool()
    rows, tiles = (_compile_ws(cfg, 2, pdl=True, tiled=t) for t in (False, True))

    def tma(kernel):
        return re.findall(r"cp\.async\.bulk\.tensor\S*", kernel.asm["ptx"])

    assert tma(tiles) == tma(rows) and tma(rows)
    loops = tool.mma_loops(tool._sass(tiles))
    assert len(loops) == 2
    assert [sum("HGMMA" in x for x in loop) for loop in loops] == [
        sum("HGMMA" in x for x in loop) for loop in tool.mma_loops(tool._sass(rows))
    ]
    assert all(tool.hazards(loop) == [] for loop in loops)


@pytest.mark.parametrize("cfg", hopper_configs.candidates("ws", None), ids=str)
def test_hopper_ws_under_pdl_waits_for_as_decode_before_anything_reads_it(cfg):
    """Launched under PDL, a program runs while a's decode still writes its workspace: every
    TMA load of a's tiles (float16) must come after the wait (griddepcontrol.wait), and the
    weight's first stages (int32 words) are asked for before it. Read in TTGIR, where each
    partition's code keeps its program order (the prologue before ``warp_specialize``, whose
    partitions start after it). Without PDL there is no wait at all."""
    ttgir = _compile_ws(cfg, 2, pdl=True).asm["ttgir"].splitlines()
    waits = [i for i, line in enumerate(ttgir) if "griddepcontrol.wait" in line]
    loads = [i for i, line in enumerate(ttgir) if "async_tma_copy_global_to_local" in line]
    a_tiles = [i for i in loads if "xf16" in ttgir[i]]
    words = [i for i in loads if "xsi32" in ttgir[i]]
    assert len(waits) == 1 and a_tiles and words
    assert min(a_tiles) > waits[0]
    assert min(words) < waits[0]  # the weight asked for while the decode runs
    assert "griddepcontrol" not in _compile_ws(cfg, 2).asm["ptx"]


def _compile_ws_stream(cfg, alpha: int):
    """``hopper-ws``'s stream-K kernel (``_hopper_ws_stream``) as ``_ws_stream`` launches
    ``cfg``, with alpha of kind ``alpha``; its fixup compiled too."""
    gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")
    gl = pytest.importorskip("triton.experimental.gluon.language")
    from fp4select.backends import _hopper_ws, _hopper_ws_stream

    _skip_without_sm90_toolchain()
    bn, words, xw = cfg.block_n, _hopper_ws.STEP_WORDS, cfg.mma_tokens
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, words], gl.int32)
    x_layout = gl.NVMMASharedLayout.get_default_for([8 * words, xw], gl.float16)
    signature = {
        "w_desc": f"tensordesc<i32[{bn}, {words}],{w_layout!r}>",
        "x_desc": f"tensordesc<fp16[{8 * words}, {xw}],{x_layout!r}>",
        "sw_ptr": "*i32", "alpha_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32",
        "M": "i32", "N": "i32", "KW": "i32", "cp": "i32", "stride_om": "i32",
        "stride_on": "i32", "alpha_stride": "i32", "S": "i32", "whole": "i32", "q": "i32",
        "r": "i32",
    } | dict.fromkeys(("BN", "BT", "BKW", "STAGES", "GROUP", "OWN_LOADS"), "constexpr")  # fmt: skip
    constexprs = {"BN": bn, "BT": cfg.block_t, "BKW": words, "STAGES": cfg.stages, "GROUP": 8}
    constexprs["OWN_LOADS"] = not cfg.loader_warp
    if _hopper_ws.ALPHA_STRIDE[alpha] == 1:  # Triton specializes an int argument of 1
        signature["alpha_stride"] = "constexpr"
        constexprs["alpha_stride"] = 1
    source = gluon_runtime.GluonASTSource(
        fn=_hopper_ws_stream.mma_ws_stream, signature=signature, constexprs=constexprs
    )
    target = backends_compiler.GPUTarget("cuda", 90, 32)
    fixup = gluon_runtime.GluonASTSource(
        fn=_hopper_ws_stream.stream_fixup,
        signature={
            "part_ptr": "*fp32", "alpha_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32",
            "N": "i32", "stride_om": "i32", "stride_on": "i32", "alpha_stride": "i32",
            "S": "i32", "first_tile": "i32", "q": "i32", "r": "i32", "BN": "constexpr",
            "BT": "constexpr", "CT": "constexpr", "GROUP": "constexpr",
        },
        constexprs={"BN": bn, "BT": cfg.block_t, "CT": _hopper_ws_stream.FIXUP_COLUMNS, "GROUP": 8},
    )  # fmt: skip
    triton.compile(fixup, target=target, options={"num_warps": 4})
    options = {"num_warps": 4, "maxnreg": _hopper_ws.launch_regs(cfg.loader_warp)}
    return triton.compile(source, target=target, options=options)


STREAM_TILES = (
    hopper_configs.WsConfig(128, 256, 3, -1, 256, 0),
    hopper_configs.WsConfig(128, 128, 3, -1, 128),  # with the loader warp
)


@pytest.mark.parametrize("cfg", STREAM_TILES, ids=str)
@pytest.mark.parametrize("alpha", [0, 3])
def test_hopper_ws_over_runs_of_k_steps_compiles_and_waits_for_each_steps_wgmma(cfg, alpha):
    """Stream-K's consumers run ``mma_ws``'s step in loops over their whole tiles and their
    run's tiles: each step's wgmma waited for, nothing spilled inside the steps' loops (the
    256-token tile spills around them, as ``mma_ws``'s does); its fixup compiles too."""
    tool = _hazard_tool()
    sass = tool._sass(_compile_ws_stream(cfg, alpha))
    loops = tool.mma_loops(sass)
    assert len(loops) == 4  # two a consumer partition: its whole tiles' steps, its run's
    for loop in loops:
        assert not [line for line in loop if re.search(r"\b(STL|LDL)\b", line)]
        wgmma = [line for line in loop if "HGMMA" in line]
        assert len(wgmma) == 8 * cfg.block_t // cfg.mma_tokens * cfg.block_n // 128
        waits = [line for line in loop if line.startswith("WARPGROUP.DEPBAR")]
        assert waits and all(line.endswith("gsb0, 0x0") for line in waits), waits
        assert tool.hazards(loop) == []
