"""The decoded weight reaches the tensor cores from registers, never through shared memory.

Triton keeps a decode in the wgmma register layout only when every input of the decode is a
32-bit (or wider) load: an 8-bit scale load, or a byte index computed from ``tl.arange``,
silently sends the whole decoded tile through shared memory, one store per value, and the
kernel stays correct but runs at half speed (docs/hopper_kernels.md). Correctness tests cannot
see that, so this compiles ``mma_planes`` for sm90 on the CPU (Triton ships ptxas; no GPU is
needed) and reads the TTGIR: no float16 tile of the weight's shape may be stored to shared
memory. A planted kernel with an 8-bit scale load shows the check can fail.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
compiler = pytest.importorskip("triton.compiler")
backends_compiler = pytest.importorskip("triton.backends.compiler")

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
    "ALPHA": "constexpr",
    "PARTIALS": "constexpr",
    "BN": "constexpr",
    "BT": "constexpr",
    "BKW": "constexpr",
    "GROUP": "constexpr",
    "ASM": "constexpr",
}
# What a real launch specializes on: 16-aligned pointers, sizes and strides divisible by 16.
DIVISIBLE = {"N", "KW", "MP", "stride_wn", "stride_om", "cp"}


def _ttgir(fn, signature: dict, constexprs: dict, warps: int, stages: int) -> str:
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, kind) in enumerate(signature.items())
        if kind.startswith("*") or name in DIVISIBLE
    }
    source = compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    target = backends_compiler.GPUTarget("cuda", 90, 32)
    try:
        kernel = triton.compile(
            source, target=target, options={"num_warps": warps, "num_stages": stages}
        )
    except Exception as exc:  # a Triton without an sm90 backend or its ptxas here
        pytest.skip(f"cannot compile for sm90 here: {type(exc).__name__}: {exc}")
    return kernel.asm["ttgir"]


def _weight_tiles_in_shared_memory(ttgir: str, block_n: int, words: int) -> list[str]:
    tile = f"tensor<{block_n}x{words}xf16"
    return [line.strip() for line in ttgir.splitlines() if "local_alloc %" in line and tile in line]


@pytest.mark.parametrize(
    "cfg",
    [
        hopper_configs.MMA_TACTICS[0][1][0],
        hopper_configs.MMA_TACTICS[2][1][1],
        hopper_configs.PREFILL,
    ],
    ids=str,
)
def test_the_decoded_weight_never_goes_through_shared_memory(cfg):
    ttgir = _ttgir(
        hk.mma_planes,
        SIGNATURE,
        {
            "ALPHA": 2,
            "PARTIALS": cfg.split != 1,
            "BN": cfg.block_n,
            "BT": cfg.block_t,
            "BKW": cfg.words_per_step,
            "GROUP": cfg.group,
            "ASM": True,
        },
        cfg.num_warps,
        cfg.num_stages,
    )
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
