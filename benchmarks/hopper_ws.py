"""Experiment: the warp-specialized Gluon kernel's forms that fp4select does not ship.

``hopper-ws`` (``fp4select/backends/_hopper_ws.py``, whose loader, decode and tile order this
imports) is the safe form: each step's wgmma waited for before the next decode. Here:

* ``mma_ws``: the next step is decoded while this step's wgmma run, which rewrites the
  registers a wgmma in flight reads (PTX: undefined; Gluon's ``deps`` keep the float16 values
  alive, not the packed registers the wgmma reads). Faster at some points, and a race.
* ``mma_ws`` with ``SMEM_A``: the decoded operand staged through shared memory (two buffers),
  so the overlap is safe; slower (docs/hopper_kernels.md).
* ``mma_pp``: each consumer warpgroup a partition of its own, which would overlap them
  safely; Triton 3.6's LLVM lowering fails with alpha kinds 1-2.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fp4select.backends._hopper_ws import (
    _decode,
    _loader,
    _planes,
    _rows,
    _scale_words,
    _store,
    _tile,
)


@gluon.jit
def _consumer(
    w_bufs, x_bufs, ready, empty, sw_ptr, off_n, N, KW, cp, steps,
    BN: gl.constexpr, BKW: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Step i is decoded while step i - 1's MMAs run; step i's are then issued (one group a
    token half) and the wait leaves them in flight, which frees step i - 1's stage."""
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
    # The operand of the MMAs in flight: its registers must outlive them, so it is carried to
    # the wait that sees them done (a wgmma reads its register operand while it runs).
    a_prev = gl.zeros((BN, 8 * BKW), gl.float16, op)
    for i in range(steps):
        s = i % STAGES
        a = _decode(w_bufs, ready, sw, i, kw, op, BKW)
        sw = _scale_words(sw_ptr, row_part, kw, i + 1, KW, BKW)  # a step ahead of its use
        acc0 = warpgroup_mma(a, x_bufs.index(s * HALVES), acc0, is_async=True)
        if HALVES == 2:
            acc1 = warpgroup_mma(a, x_bufs.index(s * HALVES + 1), acc1, is_async=True)
        acc0, acc1, a_prev = warpgroup_mma_wait(
            num_outstanding=HALVES, deps=(acc0, acc1, a_prev)
        )  # step i - 1's MMAs are done: a_prev and its stage are free
        fence_async_shared()  # the stage's words were read by ld.shared; TMA writes it next
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
        a_prev = a
    acc0, acc1, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, a_prev))
    return acc0, acc1


@gluon.jit
def _consumer_smem(
    w_bufs, x_bufs, a_bufs, ready, empty, sw_ptr, off_n, N, KW, cp, steps,
    BN: gl.constexpr, BKW: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """As ``_consumer``, the decoded operand staged through shared memory (two buffers): the
    wgmma reads it there, so decoding the next step into the other buffer while it runs is
    safe, which the register operand is not."""
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
        sw = _scale_words(sw_ptr, row_part, kw, i + 1, KW, BKW)
        ab = a_bufs.index(i % 2)  # step i - 2's MMAs, which read it, are done
        ab.store(a)
        fence_async_shared()
        acc0 = warpgroup_mma(ab, x_bufs.index(s * HALVES), acc0, is_async=True)
        if HALVES == 2:
            acc1 = warpgroup_mma(ab, x_bufs.index(s * HALVES + 1), acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=HALVES, deps=(acc0, acc1))
        fence_async_shared()  # step i - 1's stage: its words were read by ld.shared
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    return acc0, acc1


@gluon.jit
def mma_ws(
    w_desc,  # int32 words of the weight (N, K/8), blocks [BN, BKW]
    x_desc,  # float16 (XK, MP) from decode_planes (same BKW), blocks [8 * BKW, 64]
    sw_ptr,  # int32 view of the weight's 128x4 scales
    alpha_ptr, out_ptr, M, N, KW, cp, stride_om, stride_on, alpha_value,
    ALPHA: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, BKW: gl.constexpr,
    STAGES: gl.constexpr, GROUP: gl.constexpr, num_warps: gl.constexpr,
    SMEM_A: gl.constexpr = False,
):  # fmt: skip
    """out^T = W . A^T for one [BN, BT] tile (see the module docstring). SMEM_A: the decoded
    operand reaches the wgmma through shared memory (``_consumer_smem``)."""
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
    if SMEM_A:
        a_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16)
        a_bufs = gl.allocate_shared_memory(gl.float16, [2, BN, 8 * BKW], a_layout)
        acc0, acc1 = gl.warp_specialize(
            [
                (
                    _consumer_smem,
                    (w_bufs, x_bufs, a_bufs, ready, empty, sw_ptr, off_n, N, KW, cp, steps,
                     BN, BKW, num_warps),
                ),
                (_loader, (w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, steps, BKW)),
            ],
            [1],
            [40],
        )  # fmt: skip
    else:
        acc0, acc1 = gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        w_bufs,
                        x_bufs,
                        ready,
                        empty,
                        sw_ptr,
                        off_n,
                        N,
                        KW,
                        cp,
                        steps,
                        BN,
                        BKW,
                        num_warps,
                    ),
                ),
                (_loader, (w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, steps, BKW)),
            ],
            [1],
            [40],
        )
    _store(acc0, acc1, alpha_ptr, out_ptr, off_n, off_t, M, N, stride_om, stride_on,
           alpha_value, ALPHA, BN, HALVES)  # fmt: skip


_BKW = gl.constexpr(16)  # words per step of the ping-pong kernel (one k16 MMA per plane)


@gluon.jit
def _pp_loader(
    w_desc, x_desc, w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr,
    off_n, off_t, M, N, KW, cp, steps, stride_om, stride_on, alpha_value, alpha_kind,
):  # fmt: skip
    _loader(w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, steps, _BKW)


@gluon.jit
def _pp_wg0(
    w_desc, x_desc, w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr,
    off_n, off_t, M, N, KW, cp, steps, stride_om, stride_on, alpha_value, alpha_kind,
):  # fmt: skip
    _pp_consume(
        w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr, off_n, off_t, M, N, KW, cp,
        steps, stride_om, stride_on, alpha_value, alpha_kind, _BKW, 0,
    )  # fmt: skip


@gluon.jit
def _pp_wg1(
    w_desc, x_desc, w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr,
    off_n, off_t, M, N, KW, cp, steps, stride_om, stride_on, alpha_value, alpha_kind,
):  # fmt: skip
    _pp_consume(
        w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr, off_n, off_t, M, N, KW, cp,
        steps, stride_om, stride_on, alpha_value, alpha_kind, _BKW, 1,
    )  # fmt: skip


@gluon.jit
def _pp_consume(
    w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr,
    off_n, off_t, M, N, KW, cp, steps, stride_om, stride_on, alpha_value, alpha_kind,
    BKW: gl.constexpr, ROLE: gl.constexpr,
):  # fmt: skip
    """One warpgroup, 64 weight rows: decode, MMA, wait, in turn. The registers the MMA reads
    are rewritten only after its wait; the other warpgroup decodes while this one multiplies."""
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    HALVES: gl.constexpr = x_bufs.type.shape[0] // STAGES
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]
    )
    op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    off_n = off_n + 64 * ROLE
    rows = off_n + gl.arange(0, 64, layout=gl.SliceLayout(1, op))
    rows = gl.where(rows < N, rows, 0)
    row_part = (rows // 128) * cp * 128 + (rows % 32) * 16 + ((rows % 128) // 32) * 4
    kw = gl.arange(0, BKW, layout=gl.SliceLayout(0, op))
    acc0 = gl.zeros((64, 64), gl.float32, mma)
    acc1 = gl.zeros((64, 64), gl.float32, mma)
    sw = _scale_words(sw_ptr, row_part, kw, 0, KW, BKW)
    for i in range(steps):
        s = i % STAGES
        sb = (sw >> ((((i * BKW + kw) // 2) & 3) * 8)[None, :]) & 0xFF
        sw = _scale_words(sw_ptr, row_part, kw, i + 1, KW, BKW)  # a step ahead of its use
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        words = w_bufs.index(s).slice(64 * ROLE, 64).load(op)
        p0, p1, p2, p3, p4, p5, p6, p7 = _planes(words, sb)
        w = gl.join(
            gl.join(gl.join(p0, p4), gl.join(p2, p6)), gl.join(gl.join(p1, p5), gl.join(p3, p7))
        )
        w = gl.reshape(gl.permute(gl.reshape(w, [64, BKW, 8]), [0, 2, 1]), [64, 8 * BKW])
        a = gl.convert_layout(w, op, assert_trivial=True)
        acc0 = warpgroup_mma(a, x_bufs.index(s * HALVES), acc0, is_async=True)
        if HALVES == 2:
            acc1 = warpgroup_mma(a, x_bufs.index(s * HALVES + 1), acc1, is_async=True)
        acc0, acc1, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, a))
        fence_async_shared()
        mbarrier.arrive(empty.index(s))
    offs_n = off_n + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    for h in gl.static_range(HALVES):
        acc = acc0 if h == 0 else acc1
        offs_t = off_t + 64 * h + gl.arange(0, 64, layout=gl.SliceLayout(0, mma))
        mask_t = offs_t < M
        # alpha_kind at run time (a worker partition takes no constexpr of its own):
        # 0 none, 1 a number, 2 a device scalar, 3 one per token.
        scale = gl.full([64], 268435456.0, gl.float32, gl.SliceLayout(0, mma))  # 2**28
        if alpha_kind == 1:
            scale = scale * alpha_value
        if alpha_kind == 2:
            scale = scale * gl.load(alpha_ptr).to(gl.float32)
        if alpha_kind == 3:
            scale = scale * gl.load(alpha_ptr + offs_t, mask=mask_t, other=0.0).to(gl.float32)
        val = acc * scale[None, :]
        ptrs = out_ptr + offs_t[None, :] * stride_om + offs_n[:, None] * stride_on
        mask = (offs_n < N)[:, None] & mask_t[None, :]
        gl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def mma_pp(
    w_desc, x_desc, sw_ptr, alpha_ptr, out_ptr, M, N, KW, cp, stride_om, stride_on, alpha_value,
    ALPHA: gl.constexpr, BT: gl.constexpr, BKW: gl.constexpr, STAGES: gl.constexpr,
    GROUP: gl.constexpr,
):  # fmt: skip
    """``mma_ws`` with its two consumer warpgroups in partitions of their own (128 rows).

    Triton 3.6 lowers it only for alpha kinds 0 and 3: with 1 or 2 (a number, a device
    scalar) ``ConvertTritonGPUToLLVM`` asserts, on the CPU as on the H200, and loading the
    scalar as a vector did not avoid it. Its buffers and epilogue repeat ``mma_ws``', whose
    code was measured, rather than share helpers with it.
    """
    BN: gl.constexpr = 128
    HALVES: gl.constexpr = BT // 64
    off_n, off_t = _tile(M, N, BN, BT, GROUP)
    steps = gl.cdiv(KW, BKW)
    w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BKW], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(gl.float16, [STAGES * HALVES, 8 * BKW, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumers give the stage back
    fence_async_shared()
    gl.static_assert(BKW == _BKW)
    args = (
        w_desc, x_desc, w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr,
        off_n, off_t, M, N, KW, cp, steps, stride_om, stride_on, alpha_value, ALPHA,
    )  # fmt: skip
    gl.warp_specialize([(_pp_wg0, args), (_pp_wg1, args), (_pp_loader, args)], [4, 1], [232, 40])
