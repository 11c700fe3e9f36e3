"""The Triton kernels behind ``triton_fp4`` (imported only when a Triton backend first runs).

Kept apart because Triton resolves a kernel's helper functions through the module's globals,
and because importing triton costs about a second that fp4select should not pay at import.
See ``triton_fp4`` for the design rules (exact float16 operands, nibble-split K, split-K).
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # grid dependency control (Triton 3.4+): what programmatic dependent launch needs
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: nothing is ever launched with PDL (see ``pdl_start``)
    gdc_launch_dependents = gdc_wait = None

cdiv = triton.cdiv
PDL_SUPPORTED = gdc_wait is not None


@triton.jit
def pdl_start(PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """Under programmatic dependent launch (PDL, SM90+), the first thing a kernel does.

    Launched with PDL, a kernel may start while the one before it on the stream is still
    running: ``gdc_wait`` holds it until that kernel has finished and its writes are visible,
    so it must come before the first read of anything an earlier kernel wrote. ``TRIGGER`` lets
    the next kernel launch now (it waits in its own ``pdl_start``), which hides the launch gap
    between a chain's kernels; a consumer outside the chain waits for our completion the same way.
    """
    if PDL:
        gdc_wait()
        if TRIGGER:
            gdc_launch_dependents()


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """The next launch may start now: for a kernel that waited with ``pdl_start(PDL, False)``
    and triggers late, after its main loop, so the next kernel's programs do not sit on the SMs
    it still streams through."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _e2m1_f16(c):
    """Nibble code (low 4 bits of an int32) -> float16 holding e2m1 * 2**-14, exactly."""
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _scale(s, NVFP4: tl.constexpr):
    """Scale bytes (int32) -> float16 e4m3 value (NVFP4) or float32 2**(b-127) (MXFP4)."""
    if NVFP4:
        # e4m3 bits shifted into float16's fields give value * 2**-8 (subnormals too).
        bits = ((s & 0x7F) << 7) | ((s & 0x80) << 8)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True) * 256.0
    else:
        f = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
        return tl.where(s == 255, float("nan"), f)


@triton.jit
def _decode(x, s, NVFP4: tl.constexpr):
    """Packed bytes (int32) and their broadcast scales -> (low, high) dot operands."""
    if NVFP4:
        lo = _e2m1_f16(x) * s
        hi = _e2m1_f16(x >> 4) * s
    else:
        lo = (_e2m1_f16(x).to(tl.float32) * 16384.0 * s).to(tl.bfloat16)
        hi = (_e2m1_f16(x >> 4).to(tl.float32) * 16384.0 * s).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _sf_offset(row, col, cp, LAYOUT_8X4: tl.constexpr):
    if LAYOUT_8X4:
        return (row // 8) * cp * 8 + (col // 4) * 32 + (row % 8) * 4 + col % 4
    else:
        return (
            (row // 128) * cp * 128
            + (col // 4) * 512
            + (row % 32) * 16
            + ((row % 128) // 32) * 4
            + col % 4
        )


@triton.jit
def _epilogue(acc, offs_m, mask_m, alpha_ptr, alpha_value, ALPHA: tl.constexpr):
    if ALPHA == 1:
        acc = acc * alpha_value
    elif ALPHA == 2:
        acc = acc * tl.load(alpha_ptr).to(tl.float32)
    elif ALPHA == 3:
        per_row = tl.load(alpha_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        acc = acc * per_row[:, None]
    return acc


@triton.jit
def fp4_mm(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    alpha_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    KH,
    stride_am,
    stride_bn,
    stride_om,
    stride_on,
    cp,
    iters_per_split,
    alpha_value,
    NVFP4: tl.constexpr,
    A_8X4: tl.constexpr,
    ALPHA: tl.constexpr,
    PARTIALS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKH: tl.constexpr,
    GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    SPB: tl.constexpr = 8 if NVFP4 else 16  # packed bytes per block scale
    NC: tl.constexpr = BKH // SPB
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    in_group = GROUP_M * grid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = tl.where(offs_m < M, offs_m, 0)  # clamped: loads need no row/col mask
    cols = tl.where(offs_n < N, offs_n, 0)
    c_idx = tl.arange(0, NC)
    e_idx = tl.arange(0, SPB)
    k_in_tile = c_idx[:, None] * SPB + e_idx[None, :]  # (NC, SPB) byte offsets

    a_rows = a_ptr + rows[:, None, None] * stride_am
    b_cols = b_ptr + cols[None, None, :] * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # range() over a kernel argument, not over program-id arithmetic: the interpreter
    # (CPU tests) can only loop over scalars. Steps past K load nothing (masked).
    for i in range(0, iters_per_split):
        kb = (pid_k * iters_per_split + i) * BKH
        k_bytes = kb + k_in_tile
        k_ok = k_bytes < KH
        x_a = tl.load(a_rows + k_bytes[None, :, :], mask=k_ok[None, :, :], other=0)
        x_b = tl.load(b_cols + k_bytes[:, :, None], mask=k_ok[:, :, None], other=0)
        # Scale columns past K are clamped, not masked (masked loads of float8 pointers need
        # an `other` that float8 cannot take); their data bytes load as 0, so they add 0.
        sf_col = tl.minimum(kb // SPB + c_idx, cp - 1)
        s_a = tl.load(sa_ptr + _sf_offset(rows[:, None], sf_col[None, :], cp, A_8X4))
        s_b = tl.load(sb_ptr + _sf_offset(cols[None, :], sf_col[:, None], cp, False))
        s_a = _scale(s_a.to(tl.uint8, bitcast=True).to(tl.int32), NVFP4)
        s_b = _scale(s_b.to(tl.uint8, bitcast=True).to(tl.int32), NVFP4)
        a_lo, a_hi = _decode(x_a.to(tl.int32), s_a[:, :, None], NVFP4)
        b_lo, b_hi = _decode(x_b.to(tl.int32), s_b[:, None, :], NVFP4)
        if INTERPRETED and not NVFP4:
            # Triton 3.6's interpreter multiplies bfloat16 dot operands as integers; the
            # values were already rounded to bfloat16, so float32 gives the GPU's product.
            a_lo, a_hi = a_lo.to(tl.float32), a_hi.to(tl.float32)
            b_lo, b_hi = b_lo.to(tl.float32), b_hi.to(tl.float32)
        acc = tl.dot(tl.reshape(a_lo, (BM, BKH)), tl.reshape(b_lo, (BKH, BN)), acc)
        acc = tl.dot(tl.reshape(a_hi, (BM, BKH)), tl.reshape(b_hi, (BKH, BN)), acc)
    if NVFP4:
        acc = acc * 268435456.0  # 2**28: both operands carry 2**-14
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_n[None, :] < N)
    if not PARTIALS:
        acc = _epilogue(acc, offs_m, mask_m, alpha_ptr, alpha_value, ALPHA)
        ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ptrs = part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def reduce_split(
    part_ptr,
    alpha_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    stride_on,
    alpha_value,
    split_k,
    ALPHA: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL, False)
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_n[None, :] < N)
    ptrs = part_ptr + offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(0, split_k):  # fixed order: the result is deterministic
        acc += tl.load(ptrs + s * M * N, mask=mask, other=0.0)
    acc = _epilogue(acc, offs_m, mask_m, alpha_ptr, alpha_value, ALPHA)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dequant_bf16(
    x_ptr,
    s_ptr,
    out_ptr,
    R,
    KH,
    stride_x,
    cp,
    NVFP4: tl.constexpr,
    SF_8X4: tl.constexpr,
    BR: tl.constexpr,
    BKH: tl.constexpr,
):
    """Packed (R, K/2) rows and their swizzled scales -> bfloat16 (R, K), row-major.

    ``out_ptr`` is the bfloat16 workspace viewed as int32 (R, K/2): each byte's two values are
    written as one word (low nibble's bfloat16 in the low half), so no interleave is needed.
    The float32 products are exact and representable in bfloat16, so their top 16 bits are the
    bfloat16. NVFP4 values are exact in bfloat16; MXFP4 ones while in its normal range.
    """
    SPB: tl.constexpr = 8 if NVFP4 else 16
    NC: tl.constexpr = BKH // SPB
    # 3-D (rows, scale blocks, bytes of a block): one scale load per block, broadcast in
    # registers (a gathered load per byte made this kernel load-issue bound).
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    blocks = tl.program_id(1) * NC + tl.arange(0, NC)
    ks = blocks[:, None] * SPB + tl.arange(0, SPB)[None, :]  # (NC, SPB) byte index
    row_ok = rows < R
    safe_rows = tl.where(row_ok, rows, 0)
    mask = row_ok[:, None, None] & (ks < KH)[None, :, :]
    x = tl.load(x_ptr + safe_rows[:, None, None] * stride_x + ks[None, :, :], mask=mask, other=0)
    x = x.to(tl.int32)
    col = tl.minimum(blocks, cp - 1)
    s = tl.load(s_ptr + _sf_offset(safe_rows[:, None], col[None, :], cp, SF_8X4))
    # The codes' float16 carries 2**-14: NVFP4 folds the 2**14 back into the scale; MXFP4 puts
    # it on the value, as its scale (up to 2**127) times 2**14 overflows float32.
    UNIT: tl.constexpr = 1.0 if NVFP4 else 16384.0
    s = _scale(s.to(tl.uint8, bitcast=True).to(tl.int32), NVFP4).to(tl.float32) * (16384.0 / UNIT)
    s = s[:, :, None]
    lo = (_e2m1_f16(x).to(tl.float32) * UNIT * s).to(tl.int32, bitcast=True)
    hi = (_e2m1_f16(x >> 4).to(tl.float32) * UNIT * s).to(tl.int32, bitcast=True)
    word = ((lo >> 16) & 0xFFFF) | (hi & -65536)
    tl.store(out_ptr + rows[:, None, None] * KH + ks[None, :, :], word, mask=mask)


@triton.jit
def _e2m1_f16x2(x, CODE: tl.constexpr):
    """Codes CODE and CODE + 4 of each packed word (int32) -> ``_e2m1_f16``'s bits, in the low and
    high half of an int32.

    The two codes lie 16 bits apart, so one shift moves both: bits 0-2 of a code to bits 9-11
    of its half (float16's low exponent bits and first mantissa bit), bit 3 to bit 15 (sign).
    Two shifts and two masks for two values, where ``_e2m1_f16`` takes five ops for one.
    """
    mag = x >> 3 if CODE == 3 else x << (9 - 4 * CODE)
    sign = x << (12 - 4 * CODE)
    return (mag & 0x0E000E00) | (sign & -2147450880)  # -2147450880: 0x80008000 as int32


@triton.jit
def _bf16(c, s, HIGH: tl.constexpr, UNIT: tl.constexpr):
    """The float16 bits in half HIGH of ``c`` -> their value times ``UNIT * s``, as bfloat16
    bits (int16): the top half of the exact float32 product."""
    if HIGH:
        c = c >> 16
    v = c.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * UNIT * s
    return (v.to(tl.int32, bitcast=True) >> 16).to(tl.int16)


@triton.jit
def dequant_bf16_words(
    x_ptr,
    s_ptr,
    out_ptr,
    R,
    KW,
    stride_w,
    cp,
    NVFP4: tl.constexpr,
    SF_8X4: tl.constexpr,
    BR: tl.constexpr,
    BW: tl.constexpr,
    WIDE: tl.constexpr,
):
    """``dequant_bf16``'s output, bit for bit, from the packed data viewed as int32 words.

    ``x_ptr``: (R, KW) words of 8 codes (row stride ``stride_w`` words); ``out_ptr``: the
    bfloat16 (R, 8 * KW) workspace, row-major. Why: the byte kernel ran well below a copy's
    speed (docs/hopper_kernels.md), bound by per-byte work (byte loads in a 3-D tile,
    8-9 ops per value, a store per byte). Here a 32-bit load brings 8 values, two shifts and
    two masks decode two codes (``_e2m1_f16x2``), a word's 8 values leave as one 16-byte store,
    and each scale is loaded once per block (2 words NVFP4, 4 MXFP4), broadcast in registers.

    WIDE: each thread loads 4 consecutive words (16-byte loads), and Triton reorders the
    output through shared memory for its 16-byte stores. Otherwise each thread loads single
    words 32 apart (a warp still reads 128 contiguous bytes) and stores with no reorder.
    benchmarks/decode_sweep.py measures both.
    """
    WPB: tl.constexpr = 2 if NVFP4 else 4  # words per scale block
    NB: tl.constexpr = BW // WPB
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    words = tl.program_id(1) * BW + tl.arange(0, BW)
    row_ok = rows < R
    safe_rows = tl.where(row_ok, rows, 0)  # clamped: loads need no row mask
    x_rows = x_ptr + safe_rows[:, None].to(tl.int64) * stride_w
    if not WIDE:
        words = tl.max_contiguous(words, 1)  # declared contiguity 1: one word per load
    x = tl.load(x_rows + words[None, :], mask=(words < KW)[None, :], other=0)
    col = tl.minimum(tl.program_id(1) * NB + tl.arange(0, NB), cp - 1)
    s = tl.load(s_ptr + _sf_offset(safe_rows[:, None], col[None, :], cp, SF_8X4))
    UNIT: tl.constexpr = 1.0 if NVFP4 else 16384.0  # as in dequant_bf16
    s = _scale(s.to(tl.uint8, bitcast=True).to(tl.int32), NVFP4).to(tl.float32) * (16384.0 / UNIT)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BR, NB, WPB)), (BR, BW))
    # The same float16 bits and float32 products as ``dequant_bf16``: the same output bits.
    c04 = _e2m1_f16x2(x, 0)  # codes 0 and 4 of each word
    c15 = _e2m1_f16x2(x, 1)
    c26 = _e2m1_f16x2(x, 2)
    c37 = _e2m1_f16x2(x, 3)
    v0 = _bf16(c04, s, False, UNIT)
    v4 = _bf16(c04, s, True, UNIT)
    v1 = _bf16(c15, s, False, UNIT)
    v5 = _bf16(c15, s, True, UNIT)
    v2 = _bf16(c26, s, False, UNIT)
    v6 = _bf16(c26, s, True, UNIT)
    v3 = _bf16(c37, s, False, UNIT)
    v7 = _bf16(c37, s, True, UNIT)
    # join(...)[r, w, i, j, k] is value 4i + 2j + k of word w: reshaped row-major, word w's
    # 8 values land at 8w..8w+7, adjacent in each thread.
    out = tl.join(
        tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7))
    )
    out = tl.reshape(out, (BR, 8 * BW)).to(tl.bfloat16, bitcast=True)
    cols = tl.program_id(1) * (8 * BW) + tl.arange(0, 8 * BW)
    ptrs = out_ptr + rows[:, None].to(tl.int64) * (8 * KW) + cols[None, :]
    tl.store(ptrs, out, mask=row_ok[:, None] & (cols < 8 * KW)[None, :])


@triton.jit
def fp4_gemv(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    alpha_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    KH,
    stride_am,
    stride_bn,
    stride_om,
    stride_on,
    cp,
    iters_per_split,
    alpha_value,
    NVFP4: tl.constexpr,
    A_8X4: tl.constexpr,
    ALPHA: tl.constexpr,
    PARTIALS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKH: tl.constexpr,
):
    """Small-M product on the CUDA cores: no tensor-core tile to fill, no operand shuffles.

    Each program owns BN columns and a slice of K. Weight nibbles are decoded to float32
    (exact), multiplied by a's decoded values (scale included) and summed over each scale
    block before b's block scale is applied once per block. Rows of a (at most BM) are
    unrolled; programs along K write partial sums like fp4_mm.
    """
    SPB: tl.constexpr = 8 if NVFP4 else 16
    NC: tl.constexpr = BKH // SPB
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    cols = tl.where(offs_n < N, offs_n, 0)
    c_idx = tl.arange(0, NC)
    k_in_tile = c_idx[:, None] * SPB + tl.arange(0, SPB)[None, :]
    row_ids = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    b_cols = b_ptr + cols[:, None, None] * stride_bn
    for i in range(0, iters_per_split):
        kb = (pid_k * iters_per_split + i) * BKH
        k_bytes = kb + k_in_tile
        k_ok = k_bytes < KH
        w = tl.load(b_cols + k_bytes[None, :, :], mask=k_ok[None, :, :], other=0).to(tl.int32)
        w_lo = _e2m1_f16(w).to(tl.float32)
        w_hi = _e2m1_f16(w >> 4).to(tl.float32)
        sf_col = tl.minimum(kb // SPB + c_idx, cp - 1)
        s_b = tl.load(sb_ptr + _sf_offset(cols[:, None], sf_col[None, :], cp, False))
        s_b = _scale(s_b.to(tl.uint8, bitcast=True).to(tl.int32), NVFP4).to(tl.float32)
        for r in tl.static_range(BM):
            row = tl.minimum(r, M - 1)
            x = tl.load(a_ptr + row * stride_am + k_bytes, mask=k_ok, other=0).to(tl.int32)
            s_a = tl.load(sa_ptr + _sf_offset(row, sf_col, cp, A_8X4))
            s_a = _scale(s_a.to(tl.uint8, bitcast=True).to(tl.int32), NVFP4).to(tl.float32)
            x_lo = _e2m1_f16(x).to(tl.float32) * s_a[:, None]
            x_hi = _e2m1_f16(x >> 4).to(tl.float32) * s_a[:, None]
            block = tl.sum(w_lo * x_lo[None, :, :] + w_hi * x_hi[None, :, :], axis=2)
            contrib = tl.sum(block * s_b, axis=1)
            acc += tl.where(row_ids[:, None] == r, contrib[None, :], 0.0)
    acc = acc * 268435456.0  # 2**28: both decoded nibbles carry 2**-14
    offs_m = row_ids
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_n[None, :] < N)
    if not PARTIALS:
        acc = _epilogue(acc, offs_m, mask_m, alpha_ptr, alpha_value, ALPHA)
        ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ptrs = part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])  # M only bounds the tiles: one compile for every M
def mm_tma_alpha(
    x_desc,  # (M, K) bfloat16, blocks [BM, BK]
    w_desc,  # (N, K) bfloat16, blocks [BN, BK]
    alpha_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_om,
    stride_on,
    alpha_value,
    ALPHA: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    UPCAST: tl.constexpr,  # float32 operands: Triton's CPU interpreter multiplies bf16 wrongly
):
    """out = alpha * (x @ w^T), one rounding: a persistent GEMM fed by TMA (zeros past M, N,
    K), alpha applied to the float32 tile before the single conversion to the output dtype.

    Tiles are visited in groups of GROUP row tiles so that programs running together share
    weight tiles in L2. The grid (at most one program per SM) is a launch argument, not a
    constant, so a new M never compiles a new kernel.
    """
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    in_group = GROUP * grid_n
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, tl.num_programs(0), flatten=True):
        first_m = (tile // in_group) * GROUP
        size = tl.minimum(grid_m - first_m, GROUP)
        pid_m = first_m + (tile % in_group) % size
        pid_n = (tile % in_group) // size
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            x = x_desc.load([pid_m * BM, k * BK])
            w = w_desc.load([pid_n * BN, k * BK])
            if UPCAST:
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32).T, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w.T, acc)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_m = offs_m < M
        acc = _epilogue(acc, offs_m, mask_m, alpha_ptr, alpha_value, ALPHA)
        ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
