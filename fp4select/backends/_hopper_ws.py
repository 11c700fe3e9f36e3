"""``hopper-ws``'s kernel: ``mma_planes``' product, warp-specialized, in Gluon (SM90 only).

One loader warp streams the weight's words and a's decoded tiles into shared memory by TMA,
several stages ahead; the consumer warpgroups decode the weight in the registers the MMA reads
and multiply. The arithmetic is ``mma_planes``': a step of 16 words is decoded into 8 planes
(``_PAIR_TO_F16``), plane p multiplies rows 16p .. 16p + 15 of a's workspace
(``decode_planes``' order), so each plane is one k16 wgmma and a step one wgmma group per 64
tokens. The 8 planes are joined in the registers the MMA reads; ``convert_layout(...,
assert_trivial=True)`` holds that at compile time.

Design rules:

* Each step's wgmma are waited for before the next step's decode writes a register: a wgmma
  reads its register operand while it runs (``_hopper_kernels.retired`` says why Triton's own
  schedule is not trusted with that). ``tests/test_hopper_layout.py`` reads the SASS for it.
* Gluon's API moves between Triton releases; the one name that differs between 3.6 (the
  H200's) and 3.9 is aliased below, and both compile this for sm90 (the same test).
* Imported only by ``triton_hopper.ws_kernels()``: importing fp4select never imports triton.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fp4select.backends._hopper_kernels import _PAIR_TO_F16

# Triton 3.6's name for a TMA load is async_copy_global_to_shared; 3.9 renamed it (and the old
# name raises there).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
STEP_WORDS = 16  # words per step: one k16 wgmma per plane


@gluon.jit
def _loader(w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, steps, BKW: gl.constexpr):
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    HALVES: gl.constexpr = x_bufs.type.shape[0] // STAGES
    nbytes: gl.constexpr = w_desc.block_type.nbytes + HALVES * x_desc.block_type.nbytes
    for i in range(steps):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        _tma_load(w_desc, [off_n, i * BKW], ready.index(s), w_bufs.index(s))
        for h in gl.static_range(HALVES):
            _tma_load(
                x_desc, [i * 8 * BKW, off_t + 64 * h], ready.index(s), x_bufs.index(s * HALVES + h)
            )


@gluon.jit
def _planes(wq, sb):
    return gl.inline_asm_elementwise(
        _PAIR_TO_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [wq, sb],
        dtype=(gl.float16,) * 8, is_pure=True, pack=2,
    )  # fmt: skip


@gluon.jit
def _scale_words(sw_ptr, row_part, kw, i, KW, BKW: gl.constexpr):
    """For each word of step i, the 128x4 scale word holding its block's scale (block
    (i * BKW + w) // 2 of its row; block 0's past K). L2 serves these: an eighth of the
    weight's bytes."""
    blk = (i * BKW + kw) // 2
    blk = gl.where(blk * 2 < KW, blk, 0)
    return gl.load(sw_ptr + ((row_part[:, None] + (blk >> 2)[None, :] * 512) >> 2))


@gluon.jit
def _rows(off_n, N, cp, BN: gl.constexpr, BKW: gl.constexpr, op: gl.constexpr):
    """The tile's rows' part of their 128x4 scale offsets, and the words of a step."""
    rows = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, op))
    rows = gl.where(rows < N, rows, 0)
    row_part = (rows // 128) * cp * 128 + (rows % 32) * 16 + ((rows % 128) // 32) * 4
    return row_part, gl.arange(0, BKW, layout=gl.SliceLayout(0, op))


@gluon.jit
def _decode(w_bufs, ready, sw, i, kw, op: gl.constexpr, BKW: gl.constexpr):
    """Step i's weight words (waiting for the loader) decoded into one MMA operand: plane p
    at columns p * BKW .. p * BKW + BKW, joined in the registers the MMA reads."""
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    s = i % STAGES
    sb = (sw >> ((((i * BKW + kw) // 2) & 3) * 8)[None, :]) & 0xFF
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    p0, p1, p2, p3, p4, p5, p6, p7 = _planes(w_bufs.index(s).load(op), sb)
    w = gl.join(
        gl.join(gl.join(p0, p4), gl.join(p2, p6)), gl.join(gl.join(p1, p5), gl.join(p3, p7))
    )  # [BN, BKW, 2, 2, 2]: plane p at index (p >> 2, (p >> 1) & 1, p & 1)
    BN: gl.constexpr = w.shape[0]
    w = gl.reshape(gl.permute(gl.reshape(w, [BN, BKW, 8]), [0, 2, 1]), [BN, 8 * BKW])
    return gl.convert_layout(w, op, assert_trivial=True)


@gluon.jit
def _consumer(
    w_bufs, x_bufs, ready, empty, sw_ptr, off_n, N, KW, cp, steps,
    BN: gl.constexpr, BKW: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Each step: decode, issue the step's wgmma (one group a token half), wait for them, and
    free the stage they read for the loader."""
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    HALVES: gl.constexpr = x_bufs.type.shape[0] // STAGES
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 64, 16]
    )
    op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    row_part, kw = _rows(off_n, N, cp, BN, BKW, op)
    acc0 = gl.zeros((BN, 64), gl.float32, mma)
    acc1 = gl.zeros((BN, 64), gl.float32, mma)
    sw = _scale_words(sw_ptr, row_part, kw, 0, KW, BKW)
    for i in range(steps):
        s = i % STAGES
        a = _decode(w_bufs, ready, sw, i, kw, op, BKW)
        sw = _scale_words(sw_ptr, row_part, kw, i + 1, KW, BKW)  # a step ahead of its use
        acc0 = warpgroup_mma(a, x_bufs.index(s * HALVES), acc0, is_async=True)
        if HALVES == 2:
            acc1 = warpgroup_mma(a, x_bufs.index(s * HALVES + 1), acc1, is_async=True)
        acc0, acc1, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, a))
        fence_async_shared()  # the stage's words were read by ld.shared; TMA writes it next
        mbarrier.arrive(empty.index(s))
    return acc0, acc1


@gluon.jit
def _tile(M, N, BN: gl.constexpr, BT: gl.constexpr, GROUP: gl.constexpr):
    """This program's (first weight row, first token), visited in groups of GROUP weight tiles
    so that programs running together share a's tiles in L2 (as ``mma_planes``)."""
    pid = gl.program_id(0)
    grid_n = gl.cdiv(N, BN)
    in_group = GROUP * gl.cdiv(M, BT)
    first_n = (pid // in_group) * GROUP
    size = gl.minimum(grid_n - first_n, GROUP)
    return (first_n + (pid % in_group) % size) * BN, ((pid % in_group) // size) * BT


@gluon.jit
def mma_ws(
    w_desc,  # int32 words of the weight (N, K/8), blocks [BN, BKW]
    x_desc,  # float16 (XK, MP) from decode_planes (same BKW), blocks [8 * BKW, 64]
    sw_ptr,  # int32 view of the weight's 128x4 scales
    alpha_ptr, out_ptr, M, N, KW, cp, stride_om, stride_on, alpha_value,
    ALPHA: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, BKW: gl.constexpr,
    STAGES: gl.constexpr, GROUP: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """out^T = W . A^T for one [BN, BT] tile (see the module docstring)."""
    HALVES: gl.constexpr = BT // 64
    off_n, off_t = _tile(M, N, BN, BT, GROUP)
    steps = gl.cdiv(KW, BKW)
    w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BKW], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(gl.float16, [STAGES * HALVES, 8 * BKW, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    # The arguments written out in place: in a tuple variable they lose being constexpr.
    acc0, acc1 = gl.warp_specialize(
        [
            (
                _consumer,
                (w_bufs, x_bufs, ready, empty, sw_ptr, off_n, N, KW, cp, steps,
                 BN, BKW, num_warps),
            ),
            (_loader, (w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, steps, BKW)),
        ],
        [1],
        [40],
    )  # fmt: skip
    _store(acc0, acc1, alpha_ptr, out_ptr, off_n, off_t, M, N, stride_om, stride_on,
           alpha_value, ALPHA, BN, HALVES)  # fmt: skip


@gluon.jit
def _store(
    acc0, acc1, alpha_ptr, out_ptr, off_n, off_t, M, N, stride_om, stride_on, alpha_value,
    ALPHA: gl.constexpr, BN: gl.constexpr, HALVES: gl.constexpr,
):  # fmt: skip
    """The tile's two token halves scaled (2**28 undoes both operands' 2**-14; alpha) and
    stored, masked to N and M."""
    mma: gl.constexpr = acc0.type.layout
    offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    for h in gl.static_range(HALVES):
        acc = acc0 if h == 0 else acc1
        offs_t = off_t + 64 * h + gl.arange(0, 64, layout=gl.SliceLayout(0, mma))
        mask_t = offs_t < M
        scale = gl.full([64], 268435456.0, gl.float32, gl.SliceLayout(0, mma))  # 2**28
        if ALPHA == 1:
            scale = scale * alpha_value
        elif ALPHA == 2:
            scale = scale * gl.load(alpha_ptr).to(gl.float32)
        elif ALPHA == 3:
            scale = scale * gl.load(alpha_ptr + offs_t, mask=mask_t, other=0.0).to(gl.float32)
        val = acc * scale[None, :]
        ptrs = out_ptr + offs_t[None, :] * stride_om + offs_n[:, None] * stride_on
        mask = (offs_n < N)[:, None] & mask_t[None, :]
        gl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=mask)
