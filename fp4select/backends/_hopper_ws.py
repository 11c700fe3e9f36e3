"""``hopper-ws``'s kernel: ``mma_planes``' product, warp-specialized ping-pong, in Gluon (SM90).

A program computes 64, 128 or 256 weight rows x 64, 128 or 256 tokens over all of K or, split
(program axis 1), over a range of it into float32 partial sums that ``reduce_split`` adds.
The weight's words and a's decoded tiles reach shared memory by TMA, several stages ahead;
two consumer warpgroups, each a partition of its own, decode their words in the registers
the MMA reads, multiply (one wgmma a plane over all the tile's tokens, or two over 64-token
halves), and wait for the MMA before their next decode. The loads come from a loader warp of
their own or, with ``OWN_LOADS``, from the second consumer as it gives each stage back: then
8 warps run instead of 12 (Triton pads the loader's one warp to a warpgroup), so a thread may
hold 255 registers instead of 168, which a 256-token tile's accumulators need. With 128 or 256
rows each consumer takes half of them (256 read a's tiles once for twice the weight rows);
with 64 rows (twice the programs, for narrow layers) they take every other step and the first
adds the second's sums through shared memory at the end (always with a loader warp). The two
run apart, so one decodes while the other's MMA runs: the decode overlaps the tensor cores
without touching registers a wgmma in flight reads. On alternate steps they also issue their
wgmma in turn, which measured faster (the row-splitting tiles did not gain). (Tiles of 16-32
tokens, for M <= 32, were slower than ``hopper-mma`` at every point timed, code at commit
15e63df; four consumers, two a row half on alternate steps, were no faster: removed, code at
commit 5a144e9. Measured: docs/hopper_kernels.md, 'Tried and removed', 'Four consumers'.)
The arithmetic is ``mma_planes``': a step of 16 words is decoded into 8 planes
(``_PAIR_TO_F16_CVT``), plane p multiplies rows 16p .. 16p + 15 of a's workspace
(``decode_planes``' order), so each plane is one k16 wgmma. The planes are joined in the
registers the MMA reads; ``convert_layout(..., assert_trivial=True)`` holds that at compile
time.

Design rules:

* With ``OWN_LOADS`` the second consumer refills a stage only once both consumers gave it
  back (the stage's ``empty`` barrier, as the loader warp does); the first waits for nothing
  but loaded stages, which the second issued a whole ring of stages earlier, so the two never
  wait on each other in a circle.
* A wait on a barrier's parity cannot tell phase k from k - 2: no consumer may reach a
  barrier two phases ahead. Where both consumers take every step (128 rows or more) each
  consumed the stage's last step itself. Where they take alternate steps (64 rows), a stage's
  last step was the other one's: with one ready barrier a stage, a consumer could pass a stage
  whose last load had not landed (one loader warp issues the steps in order, so only if a load
  landed three steps late: never seen; the four-consumer experiment, whose consumers loaded
  for themselves, did with an odd ring, 3 stages: wrong outputs on the H200). So those
  tiles take a ready barrier a stage and step parity (``READY`` = 2 x STAGES where BN = 64):
  step j's is j % READY, last used by step j - READY of the same consumer, so its wait can
  only be for step j's load.
* Each consumer waits for its step's wgmma before its next decode writes a register: a wgmma
  reads its register operand while it runs (``_hopper_kernels.retired`` says why Triton's own
  schedule is not trusted with that). ``tests/test_hopper_layout.py`` reads the SASS for it.
* The turn barriers (64-row tiles) let the first consumer issue its n-th step only after the
  second issued its step n - 1, and the second only after the first issued its step n: each
  waits for a phase the other completes next, so neither is ever two phases ahead of a
  barrier, and the consumer with the last step (the first, if the steps are odd) waits for
  nothing the other does not issue.
* Under PDL (``PDL``, as a's decode launches it) a program starts while a's decode still runs.
  Whoever loads the stages (the loader warp, or without it the prologue) asks for the first
  STAGES steps' weight words, then waits for the decode (griddepcontrol.wait), then asks for
  a's tiles: nothing else reads what the decode writes (the consumers read a only from the
  stages), and every kernel before the decode has ended (the decode lets this kernel launch
  after its own wait), so the weight, its scales, alpha and out are safe to touch early.
  It does not let the next kernel in early (the split's reduction, or the caller's next
  kernel, starts when it ends).
* alpha reaches the consumers as the stride of one load (``ALPHA_STRIDE``): with its kind
  branched on in a worker partition, or loaded as a scalar there, Triton 3.6's LLVM lowering
  asserts. So a Python number for alpha is not taken (``run_ws`` hands it to hopper-mma).
* Gluon's API moves between Triton releases; the one name that differs between 3.6 (the
  H200's) and 3.9 is aliased below, and both compile this for sm90 (the same test).
* Imported only by ``triton_hopper.ws_kernels()``: importing fp4select never imports triton.
* ``W_TILED`` (reading a copy of the weight re-laid by ``hopper_args.tiled_words``: only the
  TMA boxes' coordinates change, ``_load_w``) is an experiment of
  ``benchmarks/hopper_sweep.py`` that no backend launches.
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

from fp4select.backends._hopper_planes import _PAIR_TO_F16_CVT

# Triton 3.6's name for a TMA load is async_copy_global_to_shared; 3.9 renamed it (and the old
# name raises there).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
STEP_WORDS = 16  # words per step: one k16 wgmma per plane
TILE_GROUP = 8  # weight tiles visited together (``tile_at``'s GROUP), as run_ws launches
# registers a thread at launch (the first consumer's; the partitions then set their own): no
# tile spills at this (tests/test_hopper_layout.py)
MAXNREG = 168
# without the loader warp (and the 3 warps Triton pads it with): 8 warps, all the registers
MAXNREG_8_WARPS = 255
WORKER_REGS = gl.constexpr(256)  # the second consumer's then (setmaxnreg)


def launch_regs(loader_warp: int) -> int:
    """The registers a thread ``mma_ws`` is launched with (``maxnreg``) for a WsConfig's form."""
    return MAXNREG if loader_warp else MAXNREG_8_WARPS


# alpha kind (0 none, 2 a device scalar, 3 one per token) -> the stride of the consumers' load
ALPHA_STRIDE = {0: -1, 2: 0, 3: 1}


@gluon.jit
def _gdc_wait():
    """Under PDL: wait until the kernel before (a's decode) has finished and its writes are
    visible (griddepcontrol.wait), before anything reads them."""
    gl.inline_asm_elementwise(
        "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _load_step(
    w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, first, j, BKW: gl.constexpr,
    TILED: gl.constexpr = False,
):  # fmt: skip
    """This program's step j (step first + j of K) into stage j % STAGES, once the stage's
    step j - STAGES has been given back (at once for j < STAGES); ready barrier j % READY."""
    _load_w(w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, first, j, BKW, TILED)
    _load_x(x_desc, w_bufs, x_bufs, ready, off_t, first, j, BKW)


@gluon.jit
def _load_w(
    w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, first, j, BKW: gl.constexpr,
    TILED: gl.constexpr = False,
):  # fmt: skip
    """``_load_step``'s first half: the stage given back, its ready barrier told the bytes of
    the whole step, the weight's words asked for. TILED (an experiment, ``mma_ws``' W_TILED):
    ``w_desc`` reads the weight re-laid by ``hopper_args.tiled_words(w, BN, BKW)`` as rows of
    BKW words, and ``off_n`` is the tiled row of the tile's step 0."""
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    READY: gl.constexpr = ready.type.shape[0]
    HALVES: gl.constexpr = x_bufs.type.shape[0] // STAGES
    nbytes: gl.constexpr = w_desc.block_type.nbytes + HALVES * x_desc.block_type.nbytes
    s = j % STAGES
    mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
    r = j % READY
    mbarrier.expect(ready.index(r), nbytes)
    if TILED:
        BN: gl.constexpr = w_bufs.type.shape[1]
        _tma_load(w_desc, [off_n + (first + j) * BN, 0], ready.index(r), w_bufs.index(s))
    else:
        _tma_load(w_desc, [off_n, (first + j) * BKW], ready.index(r), w_bufs.index(s))


@gluon.jit
def _load_x(x_desc, w_bufs, x_bufs, ready, off_t, first, j, BKW: gl.constexpr):
    """``_load_step``'s second half: a's decoded tiles of step j (what a's decode writes)."""
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    READY: gl.constexpr = ready.type.shape[0]
    HALVES: gl.constexpr = x_bufs.type.shape[0] // STAGES
    XW: gl.constexpr = x_bufs.type.shape[2]
    s = j % STAGES
    r = j % READY
    for h in gl.static_range(HALVES):
        _tma_load(
            x_desc, [(first + j) * 8 * BKW, off_t + XW * h], ready.index(r),
            x_bufs.index(s * HALVES + h),
        )  # fmt: skip


@gluon.jit
def _first_loads(
    w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, first, steps, BKW: gl.constexpr,
    PDL: gl.constexpr, TILED: gl.constexpr = False,
):  # fmt: skip
    """The ring's first STAGES steps. Under PDL the weight's words are asked for before the
    wait for a's decode, a's tiles after it (the design rules); without, each step's loads
    go together, as in the loop (held apart, they cost 256 x 128 a spilled register pair)."""
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    if PDL:
        for j in gl.static_range(STAGES):
            if j < steps:
                _load_w(w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, first, j, BKW, TILED)
        _gdc_wait()
        for j in gl.static_range(STAGES):
            if j < steps:
                _load_x(x_desc, w_bufs, x_bufs, ready, off_t, first, j, BKW)
    else:
        for j in gl.static_range(STAGES):
            if j < steps:
                _load_step(
                    w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, first, j, BKW,
                    TILED,
                )  # fmt: skip


@gluon.jit
def _loader(
    w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, first, steps, BKW: gl.constexpr,
    PDL: gl.constexpr, TILED: gl.constexpr = False,
):  # fmt: skip
    """Steps first .. first + steps - 1 of K, each into stage j % STAGES (j counts from 0)."""
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    _first_loads(
        w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, first, steps, BKW, PDL, TILED
    )
    for j in range(STAGES, steps):
        _load_step(w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, first, j, BKW, TILED)


@gluon.jit
def _planes(wq, sb):
    return gl.inline_asm_elementwise(
        _PAIR_TO_F16_CVT, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [wq, sb],
        dtype=(gl.float16,) * 8, is_pure=True, pack=2,
    )  # fmt: skip


@gluon.jit
def _scale_words(sw_ptr, row_part, kw, i, KW, BKW: gl.constexpr):
    """For each word of step i, the 128x4 scale word holding its block's scale (block
    (i * BKW + w) // 2 of its row; block 0's past K). L2 serves these: an eighth of the
    weight's bytes. (Loaded further ahead, through a cp.async ring, the 128-token tiles were
    slower, which outweighed the 16-token tiles' gain: commit 15e63df, docs/hopper_kernels.md.)"""
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
def _decode(words, sw, i, kw, op: gl.constexpr, BKW: gl.constexpr):
    """Step i's weight words (a [rows, BKW] tile in shared memory) decoded into one MMA operand:
    plane p at columns p * BKW .. p * BKW + BKW, joined in the registers the MMA reads."""
    sb = sw >> ((((i * BKW + kw) // 2) & 3) * 8)[None, :]  # _PAIR_TO_F16_CVT reads the low byte
    ROWS: gl.constexpr = words.type.shape[0]
    p0, p1, p2, p3, p4, p5, p6, p7 = _planes(words.load(op), sb)
    w = gl.join(
        gl.join(gl.join(p0, p4), gl.join(p2, p6)), gl.join(gl.join(p1, p5), gl.join(p3, p7))
    )  # [ROWS, BKW, 2, 2, 2]: plane p at index (p >> 2, (p >> 1) & 1, p & 1)
    w = gl.reshape(gl.permute(gl.reshape(w, [ROWS, BKW, 8]), [0, 2, 1]), [ROWS, 8 * BKW])
    return gl.convert_layout(w, op, assert_trivial=True)


@gluon.jit
def mma_step(a, x_bufs, empty, s, acc0, acc1, turn, n, ROLE: gl.constexpr, ORDER: gl.constexpr):
    """Stage s's wgmma (one group over the tile's tokens, or one a 64-token half) on the
    decoded operand ``a``, waited for before a register is written again; the stage given
    back. With ORDER the consumers issue in turn: the first its n-th step's wgmma after the
    second issued its step n - 1, the second after the first issued its step n (``turn``,
    one barrier each; neither can get two phases ahead)."""
    HALVES: gl.constexpr = x_bufs.type.shape[0] // empty.type.shape[0]
    if ORDER:
        if ROLE == 0:
            mbarrier.wait(turn.index(0), (n - 1) & 1, pred=n > 0)
        else:
            mbarrier.wait(turn.index(1), n & 1)
    acc0 = warpgroup_mma(a, x_bufs.index(s * HALVES), acc0, is_async=True)
    if HALVES == 2:
        acc1 = warpgroup_mma(a, x_bufs.index(s * HALVES + 1), acc1, is_async=True)
    if ORDER:
        mbarrier.arrive(turn.index(1 - ROLE))
    acc0, acc1, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, a))
    fence_async_shared()  # the stage's words were read by ld.shared; TMA writes it next
    mbarrier.arrive(empty.index(s))
    return acc0, acc1


@gluon.jit
def _consumer(
    w_bufs, x_bufs, ready, empty, partial, done, turn, sw_ptr, alpha_ptr, out_ptr,
    off_n, off_t, M, N, KW, cp, first, steps, stride_om, stride_on, alpha_stride,
    w_desc, x_desc, ROLE: gl.constexpr, LOADS: gl.constexpr, ORDER: gl.constexpr,
):  # fmt: skip
    """One warpgroup: each of its steps decode, issue the step's wgmma (one group over the
    tile's tokens or one a 64-token half), wait for them, give the stage back (and with
    ``LOADS`` fill it with step j + STAGES). With 128-row tiles it takes every step of rows
    off_n + 64 * ROLE .. + 63 and stores them; with 64-row tiles every other step (from ROLE),
    and the first consumer adds the second's sums (``partial``, ``done``) and stores."""
    BN: gl.constexpr = w_bufs.type.shape[1]
    BKW: gl.constexpr = w_bufs.type.shape[2]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    READY: gl.constexpr = ready.type.shape[0]
    HALVES: gl.constexpr = x_bufs.type.shape[0] // STAGES
    XW: gl.constexpr = x_bufs.type.shape[2]  # tokens one wgmma takes
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, XW, 16]
    )
    op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    SPLIT_ROWS: gl.constexpr = BN >= 128  # each takes half the rows, else every other step
    ROWS: gl.constexpr = BN // 2 if SPLIT_ROWS else BN  # this consumer's
    FIRST_STEP: gl.constexpr = 0 if SPLIT_ROWS else ROLE
    EVERY: gl.constexpr = 1 if SPLIT_ROWS else 2
    ROW0: gl.constexpr = ROWS * ROLE if SPLIT_ROWS else 0
    off_n = off_n + ROW0
    row_part, kw = _rows(off_n, N, cp, ROWS, BKW, op)
    acc0 = gl.zeros((ROWS, XW), gl.float32, mma)
    acc1 = gl.zeros((ROWS, XW), gl.float32, mma)
    sw = _scale_words(sw_ptr, row_part, kw, first + FIRST_STEP, KW, BKW)
    for j in range(FIRST_STEP, steps, EVERY):
        s = j % STAGES
        i = first + j  # the step of K; j counts this program's steps
        mbarrier.wait(ready.index(j % READY), (j // READY) & 1)
        a = _decode(w_bufs.index(s).slice(ROW0, ROWS), sw, i, kw, op, BKW)
        sw = _scale_words(sw_ptr, row_part, kw, i + EVERY, KW, BKW)  # a step ahead of its use
        acc0, acc1 = mma_step(
            a, x_bufs, empty, s, acc0, acc1, turn, (j - FIRST_STEP) // EVERY, ROLE, ORDER
        )
        if LOADS:  # noqa: SIM102 (a constexpr: the branch compiles away)
            if j + STAGES < steps:
                _load_step(
                    w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n - ROW0, off_t, first,
                    j + STAGES, BKW,
                )  # fmt: skip
    if EVERY == 2 and FIRST_STEP == 1:  # the second consumer's sums, for the first to add
        partial.index(0).store(acc0)
        if HALVES == 2:
            partial.index(1).store(acc1)
        mbarrier.arrive(done.index(0))
    else:
        if EVERY == 2:
            mbarrier.wait(done.index(0), 0)
            acc0 += partial.index(0).load(mma)
            if HALVES == 2:
                acc1 += partial.index(1).load(mma)
        _store(acc0, acc1, alpha_ptr, out_ptr, off_n, off_t, M, N, stride_om, stride_on,
               alpha_stride, HALVES)  # fmt: skip


@gluon.jit
def _store(
    acc0, acc1, alpha_ptr, out_ptr, off_n, off_t, M, N, stride_om, stride_on, alpha_stride,
    HALVES: gl.constexpr,
):  # fmt: skip
    """A consumer's rows' sums over the token halves, scaled (2**28 undoes both operands'
    2**-14; alpha) and stored, masked to N and M."""
    mma: gl.constexpr = acc0.type.layout
    offs_n = off_n + gl.arange(0, acc0.shape[0], layout=gl.SliceLayout(1, mma))
    XW: gl.constexpr = acc0.shape[1]
    for h in gl.static_range(HALVES):
        acc = acc0 if h == 0 else acc1
        offs_t = off_t + XW * h + gl.arange(0, XW, layout=gl.SliceLayout(0, mma))
        mask_t = offs_t < M
        alpha = gl.load(
            alpha_ptr + offs_t * alpha_stride, mask=mask_t & (alpha_stride >= 0), other=1.0
        )
        val = acc * (alpha.to(gl.float32) * 268435456.0)[None, :]
        ptrs = out_ptr + offs_t[None, :] * stride_om + offs_n[:, None] * stride_on
        mask = (offs_n < N)[:, None] & mask_t[None, :]
        gl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _tile(M, N, BN: gl.constexpr, BT: gl.constexpr, GROUP: gl.constexpr):
    """This program's (first weight row, first token): ``tile_at`` its program id."""
    return tile_at(gl.program_id(0), M, N, BN, BT, GROUP)


@gluon.jit
def tile_at(pid, M, N, BN: gl.constexpr, BT: gl.constexpr, GROUP: gl.constexpr):
    """Tile ``pid``'s (first weight row, first token), visited in groups of GROUP weight tiles
    so that programs running together share a's tiles in L2 (as ``mma_planes``)."""
    grid_n = gl.cdiv(N, BN)
    in_group = GROUP * gl.cdiv(M, BT)
    first_n = (pid // in_group) * GROUP
    size = gl.minimum(grid_n - first_n, GROUP)
    return (first_n + (pid % in_group) % size) * BN, ((pid % in_group) // size) * BT


# Not specialized on M or the K steps per split, as mma_planes: each distinct divisibility was
# a compile of its own (24 of 1.5 s each in Llama-3.1-8B's warm-up).
@gluon.jit(do_not_specialize=["M", "per_split"])
def mma_ws(
    w_desc,  # int32 words of the weight (N, K/8), blocks [BN, BKW]
    x_desc,  # float16 (XK, MP) from decode_planes (same BKW), blocks [8 * BKW, 64 or BT]
    sw_ptr,  # int32 view of the weight's 128x4 scales
    alpha_ptr,
    out_ptr,  # the output; with a K split, float32 partial sums (split_stride apart)
    M, N, KW, cp, stride_om, stride_on,
    alpha_stride,  # ALPHA_STRIDE of alpha's kind (-1 for partial sums)
    per_split,  # steps of K a program takes (program axis 1 splits K)
    split_stride,  # elements between two splits' partial sums
    BN: gl.constexpr, BT: gl.constexpr, BKW: gl.constexpr, STAGES: gl.constexpr,
    GROUP: gl.constexpr, OWN_LOADS: gl.constexpr = False, PDL: gl.constexpr = False,
    W_TILED: gl.constexpr = False,
):  # fmt: skip
    """out^T = W . A^T for one [BN, BT] tile and one range of K (see the module docstring);
    num_warps=4 (the default partition is the first consumer). W_TILED (an experiment of
    ``benchmarks/hopper_sweep.py``, with the loader warp only): ``w_desc`` reads
    ``hopper_args.tiled_words(w, BN, BKW)`` as rows of BKW words, each step one contiguous
    box."""
    FIRST: gl.constexpr = 0  # the consumers' roles (``_consumer``)
    SECOND: gl.constexpr = 1
    XW: gl.constexpr = x_desc.block_type.shape[1]  # tokens a wgmma takes: 64 (halves) or BT
    HALVES: gl.constexpr = BT // XW
    off_n, off_t = _tile(M, N, BN, BT, GROUP)
    pid_k = gl.program_id(1)
    first = pid_k * per_split
    steps = gl.minimum(gl.cdiv(KW, BKW) - first, per_split)
    out_ptr += pid_k * split_stride
    w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BKW], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(gl.float16, [STAGES * HALVES, 8 * BKW, XW], x_desc.layout)
    # Consumers on alternate steps (64 rows) take a ready barrier for each stage and step
    # parity, so that each barrier is one consumer's (the design rules).
    READY: gl.constexpr = 2 * STAGES if BN == 64 else STAGES
    ready = gl.allocate_shared_memory(gl.int64, [READY, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    # Consumers on alternate steps issue their wgmma in turn (``mma_step``): measured faster
    # there, and no faster where they split the rows (docs/hopper_kernels.md, 'In turn').
    ORDER: gl.constexpr = BN == 64
    if ORDER:
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for r in gl.static_range(2):
            mbarrier.init(turn.index(r), count=1)
    else:
        turn = done  # unused
    # the second consumer's sums, for the first to add (64-row tiles)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    PARTS: gl.constexpr = HALVES if BN == 64 else 1
    partial = gl.allocate_shared_memory(gl.float32, [PARTS, 64, XW], plain)
    for r in gl.static_range(READY):
        mbarrier.init(ready.index(r), count=1)
    for s in gl.static_range(STAGES):
        # with 128 rows or more both consumers read every stage; with 64 each stage is one's
        mbarrier.init(empty.index(s), count=2 if BN >= 128 else 1)
    mbarrier.init(done.index(0), count=1)
    fence_async_shared()
    gl.static_assert(not (W_TILED and OWN_LOADS), "W_TILED takes the loader warp")
    # the tiled copy's row of this tile's step 0 (``_load_w``), else the tile's first row
    w_off = (off_n // BN) * gl.cdiv(KW, BKW) * BN if W_TILED else off_n
    # The arguments written out in place: in a tuple variable a constexpr loses being one.
    if OWN_LOADS:  # no loader warp: the stages filled here, then by the second consumer
        _first_loads(
            w_desc, x_desc, w_bufs, x_bufs, ready, empty, off_n, off_t, first, steps, BKW, PDL
        )
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (w_bufs, x_bufs, ready, empty, partial, done, turn, sw_ptr, alpha_ptr,
                     out_ptr, off_n, off_t, M, N, KW, cp, first, steps, stride_om,
                     stride_on, alpha_stride, w_desc, x_desc, FIRST, False, ORDER),
                ),
                (
                    _consumer,
                    (w_bufs, x_bufs, ready, empty, partial, done, turn, sw_ptr, alpha_ptr,
                     out_ptr, off_n, off_t, M, N, KW, cp, first, steps, stride_om,
                     stride_on, alpha_stride, w_desc, x_desc, SECOND, True, ORDER),
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
                    (w_bufs, x_bufs, ready, empty, partial, done, turn, sw_ptr, alpha_ptr, out_ptr,
                     off_n, off_t, M, N, KW, cp, first, steps, stride_om, stride_on,
                     alpha_stride, w_desc, x_desc, FIRST, False, ORDER),
                ),
                (
                    _consumer,
                    (w_bufs, x_bufs, ready, empty, partial, done, turn, sw_ptr, alpha_ptr, out_ptr,
                     off_n, off_t, M, N, KW, cp, first, steps, stride_om, stride_on,
                     alpha_stride, w_desc, x_desc, SECOND, False, ORDER),
                ),
                (
                    _loader,
                    (w_desc, x_desc, w_bufs, x_bufs, ready, empty, w_off, off_t, first, steps,
                     BKW, PDL, W_TILED),
                ),
            ],
            [4, 1],
            [232, 40],
        )  # fmt: skip
