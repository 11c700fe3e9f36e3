"""Proving a candidate right: inputs on the FP4 grid, an exact reference, a derived tolerance.

Design rules:

* Inputs are drawn directly as FP4 codes and representable block scales, so nothing is lost
  to quantisation and the float64 reference is the exact value every correct kernel
  approximates. Drawn on the target device from a seeded generator, so the sandbox child and
  the caller see the same numbers.
* The tolerance is derived, not tuned. With operands on the grid, every product
  ``a_i * b_i * sa * sb`` is exact in float32 (2+2+4+4 significant bits), so a correct kernel
  errs only by (1) float32 accumulation over K terms, bounded by ``K * 2**-24 * sum|a_i b_i|``
  (we allow twice that: ``K * 2**-23``), and (2) one rounding to the output dtype, at most the
  unit roundoff: ``2**-8 |ref|`` for bf16 (8 significant bits), ``2**-11 |ref|`` for fp16 (we
  allow twice that). The elementwise bound is their sum plus the dtype's smallest normal. A
  correct kernel lands at half of it or less; ``worst_ratio`` records where it landed.
* The elementwise bound is loose where K is large (it is a worst case). A second, aggregate
  bound catches systematic errors the loose one would let through (a wrong alpha, a scale off
  by one percent): ``||out - ref|| / ||ref|| <= 2 * 2**-8 (bf16) / 2 * 2**-11 (fp16) +
  sqrt(K) * 2**-22``: the same two error sources, the accumulation one at its rms size
  (independent roundings) with a margin of four.
* The check must fail on NaN/Inf, zeros, all-zero rows, a transposed result, a wrong alpha and
  a linear-vs-swizzled scale mix-up; tests plant each one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp4select import formats
from fp4select.keys import Problem

_OUT_ROUNDING = {torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-11}
_AGGREGATE = _OUT_ROUNDING
# Exponents of the block scales we draw: a range wide enough that a scale mix-up shows,
# narrow enough that outputs stay far inside fp16's range.
_SCALE_EXPONENTS = (-3, 1)


@dataclass
class ProbeInputs:
    """One M's worth of inputs in the problem's layouts, with the reference and its bound."""

    m: int
    a: torch.Tensor
    b: torch.Tensor
    a_descale: torch.Tensor
    b_descale: torch.Tensor
    alpha: torch.Tensor | None
    ref: torch.Tensor
    tol: torch.Tensor
    aggregate_bound: float

    def args(self, problem: Problem, out: torch.Tensor | None = None) -> tuple:
        """Positional runner arguments (flashinfer.mm_fp4's order without ``backend``)."""
        return (
            self.a, self.b, self.a_descale, self.b_descale, self.alpha, problem.torch_out_dtype,
            out, problem.block_size, problem.a_sf_layout == "8x4", problem.use_nvfp4, True,
        )  # fmt: skip

    def kwargs(self, problem: Problem, out: torch.Tensor | None = None) -> dict:
        """Keyword arguments for ``best_mm_fp4`` / ``flashinfer.mm_fp4`` (with b_layout)."""
        names = (
            "a", "b", "a_descale", "b_descale", "alpha", "out_dtype", "out", "block_size",
            "use_8x4_sf_layout", "use_nvfp4", "enable_pdl",
        )  # fmt: skip
        kwargs = dict(zip(names, self.args(problem, out)))
        kwargs["b_layout"] = problem.b_layout
        return kwargs

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.a, self.b, self.a_descale, self.b_descale)
        )


@dataclass
class CheckResult:
    ok: bool
    reason: str
    worst_ratio: float
    rel_error: float


def _random_scales(shape: tuple[int, int], use_nvfp4: bool, gen: torch.Generator) -> torch.Tensor:
    lo, hi = _SCALE_EXPONENTS
    device = gen.device
    exponent = torch.randint(lo, hi + 1, shape, generator=gen, device=device)
    if not use_nvfp4:
        return (exponent + 127).to(torch.uint8)
    mantissa = 1 + torch.randint(0, 8, shape, generator=gen, device=device).float() / 8
    return (mantissa * torch.pow(2.0, exponent.float())).to(torch.float8_e4m3fn)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class _Weight:
    data: torch.Tensor  # (N, K/2) packed, shuffled for trtllm
    descale: torch.Tensor  # (Np, Cp) 128x4 swizzled
    value: torch.Tensor | None  # (N, K) float64, decoded: the reference's operand


# The weight depends on N, K and the formats, not on M: every M of a key (and every key of the
# same N, K) reuses it. Drawn on the device, so a 28672 x 4096 weight costs milliseconds on a
# GPU rather than seconds on the host. Cleared after each probe (it may hold a GPU gigabyte).
_weights: dict[tuple, _Weight] = {}


def clear_cache() -> None:
    _weights.clear()


def _weight(problem: Problem, device: torch.device, seed: int, with_value: bool) -> _Weight:
    key: tuple = (problem.n, problem.k, problem.block_size, problem.use_nvfp4, problem.b_layout)
    key += (str(device), seed)
    cached = _weights.get(key)
    if cached is not None and (cached.value is not None or not with_value):
        return cached
    n, k, bs = problem.n, problem.k, problem.block_size
    gen = _generator(device, seed * 1_000_003)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8, device=device)
    sf = _random_scales((n, k // bs), problem.use_nvfp4, gen)
    value = (
        formats.e2m1_decode(codes, torch.float64) * _expand(sf, problem, bs) if with_value else None
    )
    data, shuffled_sf = formats.pack_nibbles(codes), sf
    if problem.b_layout == "trtllm":
        data = formats.shuffle_rows_trtllm(data)
        shuffled_sf = formats.shuffle_rows_trtllm(sf.view(torch.uint8)).view(sf.dtype)
    weight = _Weight(data, formats.swizzle_sf(shuffled_sf, "128x4"), value)
    _weights.clear()  # one weight at a time: bounded memory, and keys arrive grouped by N, K
    _weights[key] = weight
    return weight


def make_inputs(
    problem: Problem,
    m: int,
    device: torch.device | str,
    seed: int = 0,
    *,
    with_reference: bool = True,
) -> ProbeInputs:
    """Inputs for one M of ``problem`` on ``device``; the reference is computed in float64.

    The same (problem, M, seed, device) always gives the same numbers.
    """
    device = torch.device(device)
    k, bs = problem.k, problem.block_size
    if k % bs:
        raise ValueError(f"K={k} is not a multiple of the block size {bs}")
    weight = _weight(problem, device, seed, with_reference)
    gen = _generator(device, seed * 1_000_003 + m)
    codes_a = torch.randint(0, 16, (m, k), generator=gen, dtype=torch.uint8, device=device)
    sf_a = _random_scales((m, k // bs), problem.use_nvfp4, gen)

    # Output rms ~ sqrt(K) * rms(a) * rms(b) ~ 4 sqrt(K); alpha brings it near 1, with a
    # mantissa so that "alpha ignored" or "alpha applied twice" cannot look right.
    alpha_value = 1.375 * 2.0 ** -math.ceil(math.log2(4 * math.sqrt(k)))
    if problem.alpha_kind == "none":
        alpha = None
        alpha_rows = torch.ones(m, 1, dtype=torch.float64, device=device)
    elif problem.alpha_kind == "scalar":
        alpha = torch.tensor([alpha_value], dtype=torch.float32, device=device)
        alpha_rows = alpha.double().expand(m, 1)
    else:
        factors = 1 + torch.randint(0, 16, (m,), generator=gen, device=device).float() / 16
        alpha = (alpha_value * factors).float()
        alpha_rows = alpha.double().unsqueeze(1)

    if with_reference:
        a_val = formats.e2m1_decode(codes_a, torch.float64) * _expand(sf_a, problem, bs)
        b_val = weight.value
        assert b_val is not None  # _weight decodes the value whenever a reference is wanted
        ref = (a_val @ b_val.T) * alpha_rows
        absdot = (a_val.abs() @ b_val.abs().T) * alpha_rows.abs()
        out_dtype = problem.torch_out_dtype
        tol = (
            _OUT_ROUNDING[out_dtype] * ref.abs()
            + (k * 2.0**-23) * absdot
            + torch.finfo(out_dtype).tiny
        )
        aggregate = _AGGREGATE[out_dtype] + math.sqrt(k) * 2.0**-22
    else:
        ref = tol = torch.empty(0)
        aggregate = math.inf

    return ProbeInputs(
        m=m,
        a=formats.pack_nibbles(codes_a),
        b=weight.data.T,
        a_descale=formats.swizzle_sf(sf_a, problem.a_sf_layout),
        b_descale=weight.descale.T,
        alpha=alpha,
        ref=ref,
        tol=tol,
        aggregate_bound=aggregate,
    )


def prefix_inputs(inputs: ProbeInputs, m: int, problem: Problem) -> ProbeInputs:
    """The first ``m`` rows of ``inputs`` as a problem of its own, sharing their memory.

    A batch-invariant kernel must give these rows the same bits at M=m as it gave them
    inside the larger batch. The swizzled scale layouts tile rows (128 or 8 at a time) with
    whole tiles stored one after another, so the first tiles of the buffer are the scales of
    a smaller batch (rows past ``m`` in the last tile are padding the kernel must ignore).
    """
    if not 1 <= m <= inputs.m:
        raise ValueError(f"m must be in 1..{inputs.m}, got {m}")
    tile = 8 if problem.a_sf_layout == "8x4" else 128
    cols = inputs.a_descale.shape[-1]
    rows = -(-m // tile) * tile
    alpha = inputs.alpha
    if alpha is not None and alpha.numel() == inputs.m and inputs.m > 1:
        alpha = alpha[:m]
    return ProbeInputs(
        m=m,
        a=inputs.a[:m],
        b=inputs.b,
        a_descale=inputs.a_descale.reshape(-1)[: rows * cols].view(rows, cols),
        b_descale=inputs.b_descale,
        alpha=alpha,
        ref=inputs.ref[:m],
        tol=inputs.tol[:m],
        aggregate_bound=inputs.aggregate_bound,
    )


def _expand(sf: torch.Tensor, problem: Problem, bs: int) -> torch.Tensor:
    return formats.decode_scales(sf, problem.use_nvfp4).double().repeat_interleave(bs, dim=1)


def _refused(reason: str) -> CheckResult:
    """An output not worth measuring: not a tensor, the wrong shape, dtype or device, or NaN."""
    return CheckResult(False, reason, math.inf, math.inf)


def check(out: object, inputs: ProbeInputs, out_dtype: torch.dtype) -> CheckResult:
    """Compare a candidate's output with the reference; the reason says what went wrong."""
    m, n = inputs.ref.shape
    if not isinstance(out, torch.Tensor):
        return _refused(f"returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != (m, n):
        hint = " (transposed?)" if tuple(out.shape) == (n, m) else ""
        return _refused(f"shape {tuple(out.shape)}, expected {(m, n)}{hint}")
    if out.dtype != out_dtype:
        return _refused(f"dtype {out.dtype}, expected {out_dtype}")
    if out.device != inputs.ref.device:
        return _refused(f"on {out.device}, expected {inputs.ref.device}")

    got = out.double()
    finite = torch.isfinite(got)
    if not bool(finite.all()):
        nan = int(torch.isnan(got).sum())
        inf = int((~finite).sum()) - nan
        where = tuple(int(i) for i in (~finite).nonzero()[0])
        return _refused(f"non-finite output: {nan} NaN, {inf} Inf, first at {where}")

    err = (got - inputs.ref).abs()
    ratio = err / inputs.tol
    worst = float(ratio.max()) if ratio.numel() else 0.0
    ref_norm = float(inputs.ref.norm())
    rel = float((got - inputs.ref).norm()) / ref_norm if ref_norm else float(got.norm())

    zero_rows = ((got == 0).all(dim=1) & (inputs.ref != 0).any(dim=1)).nonzero().flatten()
    if zero_rows.numel():
        first = [int(r) for r in zero_rows[:5]]
        return CheckResult(
            False, f"{zero_rows.numel()} of {m} rows all zero (first: {first})", worst, rel
        )
    if worst > 1.0:
        bad = int((ratio > 1).sum())
        r, c = (int(i) for i in divmod(int(ratio.argmax()), n))
        return CheckResult(
            False,
            f"{bad} of {m * n} elements outside the bound; worst at ({r}, {c}): "
            f"got {float(got[r, c]):.6g}, expected {float(inputs.ref[r, c]):.6g} "
            f"({worst:.3g}x the bound)",
            worst,
            rel,
        )
    if rel > inputs.aggregate_bound:
        return CheckResult(
            False,
            f"relative error {rel:.3g} over the aggregate bound {inputs.aggregate_bound:.3g} "
            "(a systematic error such as a wrong alpha or scale)",
            worst,
            rel,
        )
    return CheckResult(True, "", worst, rel)
