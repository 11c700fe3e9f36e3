"""EXPERIMENT: hopper-ws with a decoder partition.

A warpgroup of its own decodes each step's weight words (TMA-loaded) into a float16 tile in
shared memory; the two consumer warpgroups only multiply (wgmma with both operands in shared
memory, so no register hazard) and so never wait on a decode; a loader warp feeds the words
and a's planes by TMA. Same arithmetic as hopper-ws (value * 2**-14 * scale, planes).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fp4select.backends import _hopper_ws as W
from fp4select.backends import triton_fp4
from fp4select.backends import triton_hopper as th
from fp4select.backends._hopper_ws import _decode, _rows, _scale_words, _store, _tma_load, tile_at


@gluon.jit
def _loader(w_desc, x_desc, w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, off_n, off_t,
            first, steps, BKW: gl.constexpr):  # fmt: skip
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    for j in range(steps):
        s = j % STAGES
        ph = ((j // STAGES) & 1) ^ 1
        i = first + j
        mbarrier.wait(w_empty.index(s), ph)
        mbarrier.expect(w_ready.index(s), w_desc.block_type.nbytes)
        _tma_load(w_desc, [off_n, i * BKW], w_ready.index(s), w_bufs.index(s))
        mbarrier.wait(x_empty.index(s), ph)
        mbarrier.expect(x_ready.index(s), x_desc.block_type.nbytes)
        _tma_load(x_desc, [i * 8 * BKW, off_t], x_ready.index(s), x_bufs.index(s))


@gluon.jit
def _decoder(w_bufs, a_bufs, w_ready, w_empty, a_ready, a_empty, sw_ptr, off_n, N, KW, cp,
             first, steps, XW: gl.constexpr, ROLE: gl.constexpr, DECODERS: gl.constexpr):  # fmt: skip
    BN: gl.constexpr = w_bufs.type.shape[1]
    BKW: gl.constexpr = w_bufs.type.shape[2]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    ASTAGES: gl.constexpr = a_bufs.type.shape[0]
    ROWS: gl.constexpr = BN // DECODERS
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, XW, 16]
    )
    op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    row_part, kw = _rows(off_n + ROWS * ROLE, N, cp, ROWS, BKW, op)
    for j in range(steps):
        s = j % STAGES
        d = j % ASTAGES
        i = first + j
        sw = _scale_words(sw_ptr, row_part, kw, i, KW, BKW)
        mbarrier.wait(w_ready.index(s), (j // STAGES) & 1)
        a = _decode(w_bufs.index(s).slice(ROWS * ROLE, ROWS), sw, i, kw, op, BKW)
        fence_async_shared()
        mbarrier.arrive(w_empty.index(s))
        mbarrier.wait(a_empty.index(d), ((j // ASTAGES) & 1) ^ 1)
        a_bufs.index(d).slice(ROWS * ROLE, ROWS).store(a)
        fence_async_shared()
        mbarrier.arrive(a_ready.index(d))


@gluon.jit
def _consumer(a_bufs, x_bufs, a_ready, a_empty, x_ready, x_empty, alpha_ptr, out_ptr, off_n,
              off_t, M, N, steps, stride_om, stride_on, alpha_stride, ROLE: gl.constexpr,
              INFLIGHT: gl.constexpr):  # fmt: skip
    BN: gl.constexpr = a_bufs.type.shape[1]
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    ASTAGES: gl.constexpr = a_bufs.type.shape[0]
    XW: gl.constexpr = x_bufs.type.shape[2]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, XW, 16]
    )
    ROWS: gl.constexpr = BN // 2
    acc = gl.zeros((ROWS, XW), gl.float32, mma)
    for j in range(steps):
        s = j % STAGES
        d = j % ASTAGES
        mbarrier.wait(a_ready.index(d), (j // ASTAGES) & 1)
        mbarrier.wait(x_ready.index(s), (j // STAGES) & 1)
        acc = warpgroup_mma(
            a_bufs.index(d).slice(ROWS * ROLE, ROWS), x_bufs.index(s), acc, is_async=True
        )
        acc = warpgroup_mma_wait(num_outstanding=INFLIGHT, deps=(acc,))
        if INFLIGHT == 0:
            mbarrier.arrive(a_empty.index(d))
            mbarrier.arrive(x_empty.index(s))
        else:
            if j > 0:  # the step before's wgmma is done: its buffers go back
                mbarrier.arrive(a_empty.index((j - 1) % ASTAGES))
                mbarrier.arrive(x_empty.index((j - 1) % STAGES))
    if INFLIGHT != 0:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(a_empty.index((steps - 1) % ASTAGES))
        mbarrier.arrive(x_empty.index((steps - 1) % STAGES))
    _store(acc, acc, alpha_ptr, out_ptr, off_n + ROWS * ROLE, off_t, M, N, stride_om, stride_on,
           alpha_stride, 1)  # fmt: skip


@gluon.jit(do_not_specialize=["M", "per_split"])
def mma_ws_dec(w_desc, x_desc, sw_ptr, alpha_ptr, out_ptr, M, N, KW, cp, stride_om, stride_on,
               alpha_stride, per_split, split_stride, BN: gl.constexpr, BT: gl.constexpr,
               BKW: gl.constexpr, STAGES: gl.constexpr, ASTAGES: gl.constexpr,
               GROUP: gl.constexpr, DEC_REGS: gl.constexpr, DECODERS: gl.constexpr = 1,
               CONS_REGS: gl.constexpr = 128, INFLIGHT: gl.constexpr = 0):  # fmt: skip
    off_n, off_t = tile_at(gl.program_id(0), M, N, BN, BT, GROUP)
    pid_k = gl.program_id(1)
    first = pid_k * per_split
    steps = gl.minimum(gl.cdiv(KW, BKW) - first, per_split)
    out_ptr += pid_k * split_stride
    w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BKW], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, 8 * BKW, BT], x_desc.layout)
    a_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    a_bufs = gl.allocate_shared_memory(gl.float16, [ASTAGES, BN, 8 * BKW], a_layout)
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    w_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    x_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    a_ready = gl.allocate_shared_memory(gl.int64, [ASTAGES, 1], bar)
    a_empty = gl.allocate_shared_memory(gl.int64, [ASTAGES, 1], bar)
    for s in gl.static_range(STAGES):
        mbarrier.init(w_ready.index(s), count=1)
        mbarrier.init(w_empty.index(s), count=DECODERS)
        mbarrier.init(x_ready.index(s), count=1)
        mbarrier.init(x_empty.index(s), count=2)
    for d in gl.static_range(ASTAGES):
        mbarrier.init(a_ready.index(d), count=DECODERS)
        mbarrier.init(a_empty.index(d), count=2)
    fence_async_shared()
    if DECODERS == 1:
        gl.warp_specialize(
            [
                (_consumer, (a_bufs, x_bufs, a_ready, a_empty, x_ready, x_empty, alpha_ptr, out_ptr,
                             off_n, off_t, M, N, steps, stride_om, stride_on, alpha_stride, 0, INFLIGHT)),
                (_consumer, (a_bufs, x_bufs, a_ready, a_empty, x_ready, x_empty, alpha_ptr, out_ptr,
                             off_n, off_t, M, N, steps, stride_om, stride_on, alpha_stride, 1, INFLIGHT)),
                (_decoder, (w_bufs, a_bufs, w_ready, w_empty, a_ready, a_empty, sw_ptr, off_n, N, KW,
                            cp, first, steps, BT, 0, 1)),
                (_loader, (w_desc, x_desc, w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, off_n,
                           off_t, first, steps, BKW)),
            ],
            [4, 4, 1],
            [CONS_REGS, DEC_REGS, 40],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_decoder, (w_bufs, a_bufs, w_ready, w_empty, a_ready, a_empty, sw_ptr, off_n, N, KW,
                            cp, first, steps, BT, 0, 2)),
                (_decoder, (w_bufs, a_bufs, w_ready, w_empty, a_ready, a_empty, sw_ptr, off_n, N, KW,
                            cp, first, steps, BT, 1, 2)),
                (_consumer, (a_bufs, x_bufs, a_ready, a_empty, x_ready, x_empty, alpha_ptr, out_ptr,
                             off_n, off_t, M, N, steps, stride_om, stride_on, alpha_stride, 0, INFLIGHT)),
                (_consumer, (a_bufs, x_bufs, a_ready, a_empty, x_ready, x_empty, alpha_ptr, out_ptr,
                             off_n, off_t, M, N, steps, stride_om, stride_on, alpha_stride, 1, INFLIGHT)),
                (_loader, (w_desc, x_desc, w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, off_n,
                           off_t, first, steps, BKW)),
            ],
            [4, 4, 4, 1],
            [DEC_REGS, CONS_REGS, CONS_REGS, 24],
        )  # fmt: skip


def run_ws_dec(*args: Any, bn: int = 128, bt: int = 128, stages: int = 3, astages: int = 2,
               split: int = 0, dec_regs: int = 216, decoders: int = 1, launch_regs: int = 128,
               cons_regs: int = 128, inflight: int = 0) -> torch.Tensor:  # fmt: skip
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    c, a32, w32 = th._checked_words(args, "hopper-ws", torch.int32)
    sw32 = th._scale_words(args[3])
    k = th.kernels()
    kw, bkw = c.kh // 4, W.STEP_WORDS
    steps = k.cdiv(kw, bkw)
    tiles = k.cdiv(c.n, bn) * k.cdiv(c.m, bt)
    sms = triton_fp4._sms(c.out.device)
    if split == 0:
        split = max(1, min(16, steps // 8, sms // max(tiles, 1)))
        split = math.ceil(steps / math.ceil(steps / split))
    parts = th._partials(c, split)
    split = 1 if parts is None else split
    per_split = k.cdiv(steps, split)
    mp = k.cdiv(c.m, bt) * bt
    pdl = th._pdl(args, c.out.device)
    x = th._a_planes(c, a32, args[8], steps, bkw, mp, pdl)
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, bkw], gl.int32)
    x_layout = gl.NVMMASharedLayout.get_default_for([8 * bkw, bt], gl.float16)
    w_desc = TensorDescriptor(w32, list(w32.shape), list(w32.stride()), [bn, bkw], w_layout)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [8 * bkw, bt], x_layout)
    if parts is None:
        dst, strides, alpha_stride = c.out, c.out.stride(), W.ALPHA_STRIDE[c.alpha_kind]
    else:
        dst, strides, alpha_stride = parts, (c.n, 1), -1
    mma_ws_dec[(tiles, split)](
        w_desc, x_desc, sw32, c.alpha_ptr, dst, c.m, c.n, kw, c.cp, strides[0], strides[1],
        alpha_stride, per_split, c.m * c.n,
        BN=bn, BT=bt, BKW=bkw, STAGES=stages, ASTAGES=astages, GROUP=W.TILE_GROUP,
        DEC_REGS=dec_regs, DECODERS=decoders, CONS_REGS=cons_regs, INFLIGHT=inflight, num_warps=4,
        maxnreg=launch_regs,
    )  # fmt: skip
    if parts is not None:
        th._reduce_partials(parts, c, split, pdl)
    return c.out
