"""``hopper-gemv``'s kernel written in Gluon, Triton's layout-explicit dialect.

Same arithmetic as ``_hopper_kernels.gemv_dp4a`` (the same asm decodes and ``dp4a`` dot
products, the same exact block sums scaled once in float32), so it is its twin, not a new
method. What Gluon adds is the layout: every tile of a step (the weight's 16-byte loads, both
scales, the decoded values, the accumulators) lives in one explicit blocked layout, where
Triton's layout passes gave the byte-wide scale loads and the accumulator layouts of their
own and converted them through shared memory in every step (two to six barriers per step, 128
registers a thread at 8 rows x 128 blocks; this kernel: no shared memory in the loop, 72
registers, 15% fewer instructions; sm90 SASS of Triton 3.6).

Design rules:

* Optional. Gluon is experimental and its API changes between Triton releases: ``available``
  says whether this module's kernel compiles here, and any error on the way (an import, a
  compile) sends ``hopper-gemv`` back to the plain Triton kernel for the rest of the process;
  ``fp4select doctor`` says which one runs.
* No interpreter: Gluon does not run under ``TRITON_INTERPRET``. The CPU tests run the Triton
  twin; the GPU tests run this one against the exact reference.
* Importing this module imports triton; ``triton_hopper`` imports it on first use only.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fp4select.backends._hopper_kernels import _DECODE_S8, _DECODE_W, _DOT4, _DOT8


@gluon.jit
def _e4m3_f32(b):
    """e4m3 bytes (zero-extended to int32) -> float32 values, subnormals included."""
    bits = ((b & 0x7F) << 20) | ((b & 0x80) << 24)
    return bits.to(gl.float32, bitcast=True) * 1.329227995784916e36  # 2**120


@gluon.jit
def _weight(w_rows, sw_rows, k, KW, EVICT_FIRST: gl.constexpr):
    """A step's weight words and their scale bytes (zeros and block 0's scales past K)."""
    k_ok = k < KW
    kc = gl.where(k_ok, k, 0)
    w_ptrs = w_rows + k[None, :]
    sw_ptrs = sw_rows + ((kc >> 2) * 512 + (kc & 3))[None, :]
    if EVICT_FIRST:  # read once: see _hopper_kernels._gemv_weight
        w = gl.load(w_ptrs, mask=k_ok[None, :], other=0, eviction_policy="evict_first")
        sw = gl.load(sw_ptrs, eviction_policy="evict_first")
    else:
        w = gl.load(w_ptrs, mask=k_ok[None, :], other=0)
        sw = gl.load(sw_ptrs)
    return w, sw


@gluon.jit
def _row(
    p0, p1, p2, p3, n0, n1, n2, n3, swf, a_ptr, sa_ptr, r: gl.constexpr,
    M, k, k_ok, kc, stride_am, cp, A_8X4: gl.constexpr, SPLIT: gl.constexpr,
):  # fmt: skip
    """Row r of a against the decoded weight tile: float32 block contributions."""
    row = gl.minimum(M - 1, r)
    x = gl.load(a_ptr + row * stride_am + k[None, :], mask=k_ok[None, :], other=0)
    if A_8X4:
        sa_off = (row // 8) * cp * 8 + (row % 8) * 4 + (kc >> 2) * 32 + (kc & 3)
    else:
        row_part = (row // 128) * cp * 128 + (row % 32) * 16 + ((row % 128) // 32) * 4
        sa_off = row_part + (kc >> 2) * 512 + (kc & 3)
    sa = gl.load(sa_ptr + sa_off[None, :]).to(gl.uint8, bitcast=True).to(gl.int32)
    x0, x1, x2, x3 = gl.inline_asm_elementwise(
        _DECODE_S8, "=r,=r,=r,=r,l", [x], dtype=(gl.int32,) * 4, is_pure=True, pack=1
    )
    if SPLIT:
        d = gl.inline_asm_elementwise(
            _DOT8, "=r,r,r,r,r,r,r,r,r,r,r,r,r", [p0, p1, p2, p3, n0, n1, n2, n3, x0, x1, x2, x3],
            dtype=gl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        d = gl.inline_asm_elementwise(
            _DOT4, "=r,r,r,r,r,r,r,r,r", [p0, p1, p2, p3, x0, x1, x2, x3],
            dtype=gl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    return d.to(gl.float32) * (swf * _e4m3_f32(sa))


@gluon.jit
def _store(
    acc, r: gl.constexpr, M, rows, N, out_ptr, stride_om, stride_on, alpha_ptr, alpha_value,
    ALPHA: gl.constexpr,
):  # fmt: skip
    if r < M:
        v = gl.sum(acc, axis=1) * 0.25  # dp4a multiplied 2w by 2x
        if ALPHA == 1:
            v = v * alpha_value
        elif ALPHA == 2:
            v = v * gl.load(alpha_ptr).to(gl.float32)
        elif ALPHA == 3:
            v = v * gl.load(alpha_ptr + r).to(gl.float32)
        ptrs = out_ptr + r * stride_om + rows * stride_on
        gl.store(ptrs, v.to(out_ptr.dtype.element_ty), mask=rows < N)


@gluon.jit
def gemv_dp4a(
    a_ptr, w_ptr, sa_ptr, sw_ptr, alpha_ptr, out_ptr,
    M, N, KW, stride_am, stride_wn, stride_om, stride_on, cp, alpha_value,
    A_8X4: gl.constexpr, ALPHA: gl.constexpr, BM: gl.constexpr, R: gl.constexpr,
    BK: gl.constexpr, W: gl.constexpr,
    PREFETCH: gl.constexpr = False, PDL: gl.constexpr = False, EVICT_FIRST: gl.constexpr = False,
):  # fmt: skip
    """``_hopper_kernels.gemv_dp4a`` (same arguments, plus W, the warps) in one layout."""
    # Each thread holds two adjacent words (16 bytes) of a row; threads and then warps along
    # K as far as the step reaches, the rest along the rows.
    TK: gl.constexpr = 32 if BK >= 64 else BK // 2
    WK: gl.constexpr = W if BK >= 64 * W else max(1, BK // 64)
    L: gl.constexpr = gl.BlockedLayout([1, 2], [32 // TK, TK], [W // WK, WK], [1, 0])
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // dummy $0", "=r", [],
            dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    pid = gl.program_id(0)
    rows = pid * R + gl.arange(0, R, layout=gl.SliceLayout(1, L))
    rows_c = gl.where(rows < N, rows, N - 1)
    kk = gl.arange(0, BK, layout=gl.SliceLayout(0, L))
    w_rows = w_ptr + rows_c[:, None].to(gl.int64) * stride_wn
    sw_part = (rows_c // 128) * cp * 128 + (rows_c % 32) * 16 + ((rows_c % 128) // 32) * 4
    sw_rows = sw_ptr + sw_part[:, None]
    acc0 = gl.zeros((R, BK), gl.float32, L)
    acc1 = gl.zeros((R, BK), gl.float32, L)
    acc2 = gl.zeros((R, BK), gl.float32, L)
    acc3 = gl.zeros((R, BK), gl.float32, L)
    acc4 = gl.zeros((R, BK), gl.float32, L)
    acc5 = gl.zeros((R, BK), gl.float32, L)
    acc6 = gl.zeros((R, BK), gl.float32, L)
    acc7 = gl.zeros((R, BK), gl.float32, L)
    if PREFETCH:
        w, sw = _weight(w_rows, sw_rows, kk, KW, EVICT_FIRST)
    for k0 in range(0, KW, BK):
        k = k0 + kk
        k_ok = k < KW
        kc = gl.where(k_ok, k, 0)
        if PREFETCH:
            w_next, sw_next = _weight(w_rows, sw_rows, k0 + BK + kk, KW, EVICT_FIRST)
        else:
            w, sw = _weight(w_rows, sw_rows, k, KW, EVICT_FIRST)
        swf = _e4m3_f32(sw.to(gl.uint8, bitcast=True).to(gl.int32))
        if BM == 1:  # one row of a: split magnitudes, as in the Triton kernel
            p0, p1, p2, p3, n0, n1, n2, n3 = gl.inline_asm_elementwise(
                _DECODE_W, "=r,=r,=r,=r,=r,=r,=r,=r,l", [w],
                dtype=(gl.int32,) * 8, is_pure=True, pack=1,
            )  # fmt: skip
        else:
            p0, p1, p2, p3 = gl.inline_asm_elementwise(
                _DECODE_S8, "=r,=r,=r,=r,l", [w], dtype=(gl.int32,) * 4, is_pure=True, pack=1
            )
            n0, n1, n2, n3 = p0, p1, p2, p3
        row = (p0, p1, p2, p3, n0, n1, n2, n3, swf, a_ptr, sa_ptr)
        at = (M, k, k_ok, kc, stride_am, cp, A_8X4, BM == 1)
        acc0 += _row(*row, 0, *at)
        if BM > 1:
            acc1 += _row(*row, 1, *at)
        if BM > 2:
            acc2 += _row(*row, 2, *at)
            acc3 += _row(*row, 3, *at)
        if BM > 4:
            acc4 += _row(*row, 4, *at)
            acc5 += _row(*row, 5, *at)
            acc6 += _row(*row, 6, *at)
            acc7 += _row(*row, 7, *at)
        if PREFETCH:
            w, sw = w_next, sw_next
    args = (M, rows, N, out_ptr, stride_om, stride_on, alpha_ptr, alpha_value, ALPHA)
    _store(acc0, 0, *args)
    if BM > 1:
        _store(acc1, 1, *args)
    if BM > 2:
        _store(acc2, 2, *args)
        _store(acc3, 3, *args)
    if BM > 4:
        _store(acc4, 4, *args)
        _store(acc5, 5, *args)
        _store(acc6, 6, *args)
        _store(acc7, 7, *args)
