"""What each part of the warm key costs on this machine, measured as whole call paths.

Each candidate is a function with best_mm_fp4's signature that builds one key, looks it up and
calls a runner that does nothing; ``direct`` calls that runner alone. The candidates run
interleaved, so the differences between them are what each part of the key adds here.

    python benchmarks/diag_warm_key.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

_B16 = 16
_NO_ALPHA = torch.empty(0)


def nothing(*args):
    return None


def make(name, build):
    table = {}

    def call(
        a, b, a_descale, b_descale, alpha=None, out_dtype=torch.bfloat16, out=None,
        block_size=16, use_8x4_sf_layout=False, backend="auto", use_nvfp4=True,
        enable_pdl=True, *, batch_invariant=False, b_layout="plain", allow_blacklisted=False,
    ):  # fmt: skip
        runner = table.get(
            build(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size,
                  use_8x4_sf_layout, backend, use_nvfp4, enable_pdl, batch_invariant,
                  b_layout, allow_blacklisted)
        )  # fmt: skip
        return runner(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size,
                      use_8x4_sf_layout, use_nvfp4, enable_pdl)  # fmt: skip

    return name, call, table, build


def defaults(u8, nv, pdl, bi, ab, bs):
    return u8 is False and nv is True and pdl is True and bi is False and ab is False and bs is _B16


def k_old(a, b, ad, bd, al, od, out, bs, u8, be, nv, pdl, bi, bl, ab):
    return (a.shape, b.shape, a.get_device(), od, bs, u8, be, nv, bl,
            None if al is None else al.shape, None if out is None else out.shape, ab)  # fmt: skip


def k_ids_only(a, b, ad, bd, al, od, out, bs, u8, be, nv, pdl, bi, bl, ab):
    return (a.shape, id(b), id(bd), id(al), od, be, bl, defaults(u8, nv, pdl, bi, ab, bs))


def k_lean(a, b, ad, bd, al, od, out, bs, u8, be, nv, pdl, bi, bl, ab):
    flags = defaults(u8, nv, pdl, bi, ab, bs)
    return (a.shape, a.dtype, a.get_device(), a.is_contiguous(), ad.numel(), ad.dtype,
            ad.get_device(), id(b), id(bd), id(al), None if out is None else out.shape, od, be,
            bl, flags)  # fmt: skip


def k_lean_device(a, b, ad, bd, al, od, out, bs, u8, be, nv, pdl, bi, bl, ab):
    flags = defaults(u8, nv, pdl, bi, ab, bs)
    return (a.shape, a.dtype, a.device, a.is_contiguous(), ad.numel(), ad.dtype,
            ad.device, id(b), id(bd), id(al), None if out is None else out.shape, od, be,
            bl, flags)  # fmt: skip


def k_no_contig(a, b, ad, bd, al, od, out, bs, u8, be, nv, pdl, bi, bl, ab):
    flags = defaults(u8, nv, pdl, bi, ab, bs)
    return (a.shape, a.dtype, a.get_device(), ad.numel(), ad.dtype,
            ad.get_device(), id(b), id(bd), id(al), None if out is None else out.shape, od, be,
            bl, flags)  # fmt: skip


def k_stride(a, b, ad, bd, al, od, out, bs, u8, be, nv, pdl, bi, bl, ab):
    flags = defaults(u8, nv, pdl, bi, ab, bs)
    return (a.shape, a.stride(), a.dtype, a.get_device(), ad.numel(), ad.dtype,
            ad.get_device(), id(b), id(bd), id(al), None if out is None else out.shape, od, be,
            bl, flags)  # fmt: skip


def make_guarded(args):
    """fp4select's warm path: shapes in the key, everything else in one guard."""
    from fp4select.tensor_guard import guard

    table = {}

    def call(
        a, b, a_descale, b_descale, alpha=None, out_dtype=torch.bfloat16, out=None,
        block_size=16, use_8x4_sf_layout=False, backend="auto", use_nvfp4=True,
        enable_pdl=True, *, batch_invariant=False, b_layout="plain", allow_blacklisted=False,
    ):  # fmt: skip
        flags = defaults(use_8x4_sf_layout, use_nvfp4, enable_pdl, batch_invariant,
                         allow_blacklisted, block_size)  # fmt: skip
        entry = table.get((a.shape, b.shape, a.get_device(), alpha is None, out is None,
                           out_dtype, backend, b_layout, flags))  # fmt: skip
        runner = None
        if entry is not None and entry[0](a, b, a_descale, b_descale,
                                          _NO_ALPHA if alpha is None else alpha):  # fmt: skip
            runner = entry[1]
        return runner(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size,
                      use_8x4_sf_layout, use_nvfp4, enable_pdl)  # fmt: skip

    a, b, ad, bd, al = args
    key = (a.shape, b.shape, a.get_device(), False, True, torch.bfloat16, "auto", "plain", True)
    table[key] = (guard(a, b, ad, bd, al), nothing)
    return call


CANDIDATES = [
    ("old (before the strict path)", k_old),
    ("identity only", k_ids_only),
    ("lean: get_device", k_lean),
    ("lean: .device", k_lean_device),
    ("lean without is_contiguous", k_no_contig),
    ("lean, stride for contiguity", k_stride),
]


def per_call_ns(fn, args, calls):
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter_ns() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--calls", type=int, default=2000)
    opts = parser.parse_args()
    dev = torch.device(opts.device)
    a = torch.zeros(8, 256, dtype=torch.uint8, device=dev)
    b = torch.zeros(256, 256, dtype=torch.uint8, device=dev).t()
    ad = torch.zeros(128, 32, dtype=torch.float8_e4m3fn, device=dev)
    bd = torch.zeros(256, 32, dtype=torch.float8_e4m3fn, device=dev)
    al = torch.ones(1, device=dev)
    args = (a, b, ad, bd, al)
    fns = {"direct": lambda *x: nothing(*x, torch.bfloat16, None, 16, False, True, True)}
    for name, build in CANDIDATES:
        _, call, table, _ = make(name, build)
        table[build(*args, torch.bfloat16, None, 16, False, "auto", True, True, False, "plain",
                    False)] = nothing  # fmt: skip
        fns[name] = call
    fns["guarded (fp4select.tensor_guard)"] = make_guarded(args)
    samples = {name: [] for name in fns}
    for _ in range(opts.batches):
        for name, fn in fns.items():
            samples[name].append(per_call_ns(fn, args, opts.calls))
    direct = statistics.median(samples["direct"])
    print(f"{'call path':32s} {'p50 ns':>7s} {'over direct':>12s}")
    for name, values in samples.items():
        med = statistics.median(values)
        print(f"{name:32s} {med:7.0f} {med - direct:12.0f}")


if __name__ == "__main__":
    main()
