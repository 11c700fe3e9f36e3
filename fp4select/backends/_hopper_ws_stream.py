"""``hopper-ws`` with its last wave of tiles cut into runs of K steps (``WsConfig.split = -1``).

``mma_ws`` runs one program an SM (its registers). Where its tiles fill the SMs' waves badly,
the last wave runs mostly empty: between the powers of two, 4608 x 7168 at M = 1024 is 144
tiles of 128 x 256 on 132 SMs, two waves for 1.09 waves of work (1.90x bf16 cuBLAS's time,
against 1.13x at M = 768's one full wave; ``results/hopper_sweep_mid.json``). A K split must
be a whole number of parts per tile, which rarely evens that out. Here each program first takes
``whole`` tiles (p, p + P, ...) as ``mma_ws`` does, and the (tile, K step) units of the tiles
left are cut into one equal run per program (stream-K): the program multiplies its run's steps
with ``mma_ws``'s consumers, tile by tile, its stage ring going on across tiles. A tile one
program holds is stored as ``mma_ws`` stores it; one shared by several is left as float32
partial sums, two slots a program (a run's first tile and its last can be partial, none
between), which ``stream_fixup`` adds in program order, scales by alpha and stores: the result
does not depend on timing. ``hopper_configs.stream_plan`` decides where and how to cut.

Design rules:

* Program p's run is units ``p * q + min(p, r)`` up to the next program's, for U units over
  P programs (``q, r = divmod(U, P)``), counted after the whole tiles'; ``owner`` inverts
  that. The kernel, the fixup and ``hopper_configs.stream_runs`` compute the same runs.
* Every program's g-th unit (``_unit``: its whole tiles' steps, then its run's) takes stage
  g % STAGES, ready barrier g % STAGES and phase g // STAGES, as ``mma_ws``'s j-th step: both
  consumers take every step (128 rows or more, one ready barrier a stage), so the parity waits
  hold as there.
* Whoever loads (the loader warp, or the second consumer) walks the units by a cursor that
  ``_advance`` moves by additions, working a tile's first row and token out once a tile; it
  must name the same (tile, step) as ``_unit`` (the prologue's) for every g, which
  ``tests/test_hopper_ws_stream.py`` walks on the CPU from the kernels' own source.
* The tile order is ``_hopper_ws.tile_at``'s, so a tile's rows and tokens are the same in the
  kernel and the fixup.
* Not launched under PDL: the kernel starts when a's decode has ended, so nothing here waits
  for it (a few microseconds of overlap are small beside the idle wave this removes).
* An experiment in no tactic table until timed on a GPU (``hopper_sweep.py --families
  stream``). Its first form (all tiles in runs below two waves, a fixup program a tile;
  commit 223faa6) beat every other candidate at 2 of 18 H200 points at M = 256-2048, where
  the tiles mostly filled the SMs; the buckets between the powers of two were not timed then.
  There its 128 x 128 tile with the loader warp took 0.78x its split form's time where 72
  tiles filled 55% of the SMs (4608 x 7168, M = 512), while 128 x 256 without the loader warp
  was slower than its split form wherever it cut (128 KB slots, one fixup program a tile,
  and a loading consumer dividing its unit's index out at every step; not since): so both
  forms stay, and the sweep times both.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from fp4select.backends._hopper_ws import (
    WORKER_REGS,
    _decode,
    _load_step,
    _rows,
    _scale_words,
    _store,
    mma_step,
    tile_at,
)

FIXUP_COLUMNS = 16  # tokens a fixup program adds (a [block_n, 16] float32 block a partial)


@gluon.jit
def _first(p, q, r):
    return p * q + gl.minimum(p, r)


@gluon.jit
def owner(u, q, r):
    """The program whose run holds unit u."""
    long_runs = r * (q + 1)  # the first r programs take q + 1 units
    return gl.where(u < long_runs, u // (q + 1), r + (u - long_runs) // gl.maximum(q, 1))


@gluon.jit
def _unit(g, p, P, whole, u0, S):
    """The program's g-th unit as (tile, step): its whole tiles first (p, p + P, ...), then
    its run from unit u0."""
    first_whole = g < whole * S
    u = u0 + g - whole * S
    return gl.where(first_whole, p + (g // S) * P, u // S), gl.where(first_whole, g % S, u % S)


@gluon.jit
def _advance(
    t, i, off_n, off_t, g, P, whole_units, rt, ri, S, M, N, BN: gl.constexpr, BT: gl.constexpr,
    GROUP: gl.constexpr,
):  # fmt: skip
    """The loader's cursor (the loader warp's, or the loading consumer's) from unit g to unit
    g + 1: (tile, step, the tile's first weight row and token) of the next step, the next whole tile (P on), the run's first unit
    (rt, ri) or the run's next tile. ``_unit`` divides by S and P and ``tile_at`` by the tile
    counts: at every step that took the loading consumer's loop from about 300 sm90
    instructions (``mma_ws``'s) to 450, and its decode is what the step waits on; here
    ``tile_at`` runs once a tile."""
    i += 1
    run_starts = g + 1 == whole_units
    tile_ends = i == S
    t = gl.where(run_starts, rt, gl.where(tile_ends, t + gl.where(g + 1 < whole_units, P, 1), t))
    i = gl.where(run_starts, ri, gl.where(tile_ends, 0, i))
    if run_starts | tile_ends:
        off_n, off_t = tile_at(t, M, N, BN, BT, GROUP)
    return t, i, off_n, off_t


@gluon.jit
def _load_unit(w_desc, x_desc, w_bufs, x_bufs, ready, empty, t, i, g, M, N, GROUP: gl.constexpr):
    """Step i of tile t into stage g % STAGES: ``_load_step`` of that tile."""
    BN: gl.constexpr = w_bufs.type.shape[1]
    BKW: gl.constexpr = w_bufs.type.shape[2]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    BT: gl.constexpr = x_bufs.type.shape[2] * (x_bufs.type.shape[0] // STAGES)
    off_n, off_t = tile_at(t, M, N, BN, BT, GROUP)
    _load_step(w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, i - g, g, BKW)


@gluon.jit
def _loader(
    w_desc, x_desc, w_bufs, x_bufs, ready, empty, p, P, whole, u0, u1, S, M, N,
    GROUP: gl.constexpr,
):  # fmt: skip
    """The loader warp: every unit of the program in order, by the cursor ``_advance`` keeps."""
    BN: gl.constexpr = w_bufs.type.shape[1]
    BKW: gl.constexpr = w_bufs.type.shape[2]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    BT: gl.constexpr = x_bufs.type.shape[2] * (x_bufs.type.shape[0] // STAGES)
    total = whole * S + u1 - u0
    rt, ri = u0 // S, u0 % S  # the run's first unit
    t, i = _unit(0, p, P, whole, u0, S)
    off_n, off_t = tile_at(t, M, N, BN, BT, GROUP)
    for g in range(total):
        _load_step(w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, i - g, g, BKW)
        if g + 1 < total:
            t, i, off_n, off_t = _advance(
                t, i, off_n, off_t, g, P, whole * S, rt, ri, S, M, N, BN, BT, GROUP
            )


@gluon.jit
def _store_part(acc0, acc1, part_ptr, ROW0: gl.constexpr, BN: gl.constexpr, HALVES: gl.constexpr):
    """A consumer's rows of a partial tile into its slot (token-major, so the fixup's loads
    along the rows are contiguous), scaled as ``_store`` scales (2**28), without alpha."""
    mma: gl.constexpr = acc0.type.layout
    XW: gl.constexpr = acc0.shape[1]
    rows = ROW0 + gl.arange(0, acc0.shape[0], layout=gl.SliceLayout(1, mma))
    for h in gl.static_range(HALVES):
        acc = acc0 if h == 0 else acc1
        cols = XW * h + gl.arange(0, XW, layout=gl.SliceLayout(0, mma))
        gl.store(part_ptr + cols[None, :] * BN + rows[:, None], acc * 268435456.0)


@gluon.jit
def _tile_sums(
    w_bufs, x_bufs, ready, empty, sw_ptr, off_n, k0, k1, g, cursor, P, whole, rt, ri, total, S,
    M, N, KW, cp, w_desc, x_desc, ROW0: gl.constexpr, LOADS: gl.constexpr, GROUP: gl.constexpr,
):  # fmt: skip
    """Steps k0 .. k1 - 1 of the tile at weight row off_n, this consumer's rows, as
    ``_hopper_ws._consumer`` takes them; the program's g-th unit first. With ``LOADS`` each
    step then loads unit g + STAGES, at ``cursor`` (``_advance``). Returns the sums, the units
    taken so far and the cursor."""
    BN: gl.constexpr = w_bufs.type.shape[1]
    BKW: gl.constexpr = w_bufs.type.shape[2]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    XW: gl.constexpr = x_bufs.type.shape[2]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, XW, 16]
    )
    op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    ROWS: gl.constexpr = BN // 2
    row_part, kw = _rows(off_n + ROW0, N, cp, ROWS, BKW, op)
    acc0 = gl.zeros((ROWS, XW), gl.float32, mma)
    acc1 = gl.zeros((ROWS, XW), gl.float32, mma)
    sw = _scale_words(sw_ptr, row_part, kw, k0, KW, BKW)
    BT: gl.constexpr = XW * (x_bufs.type.shape[0] // STAGES)
    ct, ci, cn, ctok = cursor
    for i in range(k0, k1):
        s = g % STAGES
        mbarrier.wait(ready.index(s), (g // STAGES) & 1)
        a = _decode(w_bufs.index(s).slice(ROW0, ROWS), sw, i, kw, op, BKW)
        sw = _scale_words(sw_ptr, row_part, kw, i + 1, KW, BKW)  # a step ahead of its use
        acc0, acc1 = mma_step(a, x_bufs, empty, s, acc0, acc1, ready, 0, 0, False)
        if LOADS:  # noqa: SIM102 (a constexpr: the branch compiles away)
            if g + STAGES < total:
                j = g + STAGES
                _load_step(w_desc, x_desc, w_bufs, x_bufs, ready, empty, cn, ctok, ci - j, j, BKW)
                if j + 1 < total:  # past the last unit a tile's row and token are not made
                    ct, ci, cn, ctok = _advance(
                        ct, ci, cn, ctok, j, P, whole * S, rt, ri, S, M, N, BN, BT, GROUP
                    )
        g += 1
    return acc0, acc1, g, (ct, ci, cn, ctok)


@gluon.jit
def _consumer(
    w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr, part_ptr,
    p, P, whole, u0, u1, S, M, N, KW, cp, stride_om, stride_on, alpha_stride,
    w_desc, x_desc, ROLE: gl.constexpr, LOADS: gl.constexpr, GROUP: gl.constexpr,
):  # fmt: skip
    """``_hopper_ws._consumer`` (rows off_n + BN / 2 * ROLE .. of every step) over the
    program's whole tiles, then over its run, tile by tile: a whole tile stored, a partial
    one into the program's slot (0: the run's first tile, 1: its last)."""
    BN: gl.constexpr = w_bufs.type.shape[1]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    HALVES: gl.constexpr = x_bufs.type.shape[0] // STAGES
    BT: gl.constexpr = x_bufs.type.shape[2] * HALVES
    ROW0: gl.constexpr = BN // 2 * ROLE
    g = 0  # the program's units so far: stage g % STAGES
    total = whole * S + u1 - u0
    rt, ri = u0 // S, u0 % S  # the run's first unit
    ct, ci = _unit(STAGES, p, P, whole, u0, S)  # the first unit the loading consumer loads
    cn, ctok = tile_at(ct, M, N, BN, BT, GROUP)  # (a tile past the last when it loads nothing)
    cursor = (ct, ci, cn, ctok)
    for n in range(whole):
        off_n, off_t = tile_at(p + n * P, M, N, BN, BT, GROUP)
        acc0, acc1, g, cursor = _tile_sums(
            w_bufs, x_bufs, ready, empty, sw_ptr, off_n, 0, S, g, cursor, P, whole, rt, ri,
            total, S, M, N, KW, cp, w_desc, x_desc, ROW0, LOADS, GROUP,
        )  # fmt: skip
        _store(acc0, acc1, alpha_ptr, out_ptr, off_n + ROW0, off_t, M, N, stride_om,
               stride_on, alpha_stride, HALVES)  # fmt: skip
    # the run's tiles (none for an empty run, which a program after the r-th has when q = 0)
    t_end = gl.where(u1 > u0, (u1 - 1) // S + 1, u0 // S)
    for t in range(u0 // S, t_end):
        off_n, off_t = tile_at(t, M, N, BN, BT, GROUP)
        k0 = gl.maximum(u0 - t * S, 0)
        k1 = gl.minimum(u1 - t * S, S)
        acc0, acc1, g, cursor = _tile_sums(
            w_bufs, x_bufs, ready, empty, sw_ptr, off_n, k0, k1, g, cursor, P, whole, rt, ri,
            total, S, M, N, KW, cp, w_desc, x_desc, ROW0, LOADS, GROUP,
        )  # fmt: skip
        if k1 - k0 == S:
            _store(acc0, acc1, alpha_ptr, out_ptr, off_n + ROW0, off_t, M, N, stride_om,
                   stride_on, alpha_stride, HALVES)  # fmt: skip
        else:
            slot = (t * S > u0).to(gl.int32)  # 0: the run starts in this tile
            _store_part(acc0, acc1, part_ptr + slot * (BN * BT), ROW0, BN, HALVES)


# Not specialized on M or the runs' sizes (each value's divisibility would be a compile).
@gluon.jit(do_not_specialize=["M", "S", "whole", "q", "r"])
def mma_ws_stream(
    w_desc, x_desc, sw_ptr, alpha_ptr, out_ptr,
    part_ptr,  # float32, two [BT, BN] slots a program
    M, N, KW, cp, stride_om, stride_on, alpha_stride,
    S,  # K steps a tile
    whole,  # whole tiles a program takes first: p, p + P, ...
    q, r,  # divmod(the units of the tiles after those, programs)
    BN: gl.constexpr, BT: gl.constexpr, BKW: gl.constexpr, STAGES: gl.constexpr,
    GROUP: gl.constexpr, OWN_LOADS: gl.constexpr = False,
):  # fmt: skip
    """``mma_ws``'s tiles: program p's whole tiles, then its run of (tile, step) units;
    num_warps=4."""
    XW: gl.constexpr = x_desc.block_type.shape[1]
    HALVES: gl.constexpr = BT // XW
    p = gl.program_id(0)
    P = gl.num_programs(0)
    base = whole * P * S  # the runs' units come after the whole tiles'
    u0 = base + _first(p, q, r)
    u1 = base + _first(p + 1, q, r)
    part_ptr += p * (2 * BN * BT)
    w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BKW], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(gl.float16, [STAGES * HALVES, 8 * BKW, XW], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumers read every stage
    fence_async_shared()
    # The arguments written out in place: in a tuple variable a constexpr loses being one.
    if OWN_LOADS:  # no loader warp: the stages filled here, then by the second consumer
        for j in gl.static_range(STAGES):
            if j < whole * S + u1 - u0:
                t, i = _unit(j, p, P, whole, u0, S)
                _load_unit(w_desc, x_desc, w_bufs, x_bufs, ready, empty, t, i, j, M, N, GROUP)
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr, part_ptr, p, P,
                     whole, u0, u1, S, M, N, KW, cp, stride_om, stride_on, alpha_stride,
                     w_desc, x_desc, 0, False, GROUP),
                ),
                (
                    _consumer,
                    (w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr, part_ptr, p, P,
                     whole, u0, u1, S, M, N, KW, cp, stride_om, stride_on, alpha_stride,
                     w_desc, x_desc, 1, True, GROUP),
                ),
            ],
            [4],
            [WORKER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr, part_ptr, p, P,
                     whole, u0, u1, S, M, N, KW, cp, stride_om, stride_on, alpha_stride,
                     w_desc, x_desc, 0, False, GROUP),
                ),
                (
                    _consumer,
                    (w_bufs, x_bufs, ready, empty, sw_ptr, alpha_ptr, out_ptr, part_ptr, p, P,
                     whole, u0, u1, S, M, N, KW, cp, stride_om, stride_on, alpha_stride,
                     w_desc, x_desc, 1, False, GROUP),
                ),
                (
                    _loader,
                    (w_desc, x_desc, w_bufs, x_bufs, ready, empty, p, P, whole, u0, u1, S, M,
                     N, GROUP),
                ),
            ],
            [4, 1],
            [232, 40],
        )  # fmt: skip


@gluon.jit(do_not_specialize=["M", "S", "first_tile", "q", "r"])
def stream_fixup(
    part_ptr, alpha_ptr, out_ptr, M, N, stride_om, stride_on, alpha_stride, S, first_tile, q, r,
    BN: gl.constexpr, BT: gl.constexpr, CT: gl.constexpr, GROUP: gl.constexpr,
):  # fmt: skip
    """Tokens CT * c .. of tile first_tile + t (program (t, c)) where several programs' runs
    share the tile: their partial sums added in program order, scaled by alpha, stored (a tile
    one program holds was stored by it); num_warps=4."""
    t = gl.program_id(0)  # among the runs' tiles
    p_first = owner(t * S, q, r)
    p_last = owner(t * S + S - 1, q, r)
    if p_first != p_last:
        off_n, off_t = tile_at(first_tile + t, M, N, BN, BT, GROUP)
        layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
        cols = gl.program_id(1) * CT + gl.arange(0, CT, layout=gl.SliceLayout(0, layout))
        offs = cols[None, :] * BN + rows[:, None]
        acc = gl.zeros([BN, CT], gl.float32, layout)
        for p in range(p_first, p_last + 1):
            slot = (t * S > _first(p, q, r)).to(gl.int32)  # 1: the run's last tile
            acc += gl.load(part_ptr + (p * 2 + slot) * (BN * BT) + offs)
        offs_n = off_n + rows
        offs_t = off_t + cols
        mask_t = offs_t < M
        alpha = gl.load(
            alpha_ptr + offs_t * alpha_stride, mask=mask_t & (alpha_stride >= 0), other=1.0
        )
        val = acc * alpha.to(gl.float32)[None, :]
        ptrs = out_ptr + offs_t[None, :] * stride_om + offs_n[:, None] * stride_on
        mask = (offs_n < N)[:, None] & mask_t[None, :]
        gl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=mask)
