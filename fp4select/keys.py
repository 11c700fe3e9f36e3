"""What a decision is keyed on: the environment it was measured in and the problem it answers.

Design rules:

* A key field that is missing lets a decision be replayed where it is invalid (flashinfer once
  replayed tactics across the 8x4 and 128x4 scale layouts). Every input that can change which
  backend is *correct* or *fastest* is a field here, and a test flips each one.
* The environment holds the versions of everything that compiles or runs a kernel: a change in
  any of them gives a new environment, so stale decisions and blacklists are simply not found.
* M is bucketed as flashinfer buckets it (powers of two to 256, steps of 256 to 2048, of 512
  to 4096, then powers of two) and rounded up, so that one decision covers a range of batch
  sizes; the validator checks several M inside the bucket so the decision holds for all of them.
"""

from __future__ import annotations

import bisect
import functools
import importlib.metadata
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from fp4select._version import __version__
from fp4select.formats import A_SF_LAYOUTS, ALPHA_KINDS, B_LAYOUTS, OUT_DTYPES
from fp4select.store._jsonfile import SCHEMA_VERSION, digest

# A batch-invariant problem has one decision for every M: its key's bucket is this one, and it
# is validated at INVARIANT_MS (decode to prefill), since no bucket narrows where it must hold.
INVARIANT_BUCKET = 1
INVARIANT_MS = (1, 37, 300)
# The largest N or K a key may hold: 16 Mi elements, far beyond any dense layer (the widest
# published FFN is ~10^5), small enough that a key read from a file cannot ask for tensors no
# machine can hold (10**30 was accepted once).
MAX_DIM = 1 << 24


def _bucket_edges() -> list[int]:
    edges = [1 << i for i in range(9)]  # 1 .. 256
    edges += list(range(512, 2048 + 1, 256))
    edges += list(range(2560, 4096 + 1, 512))
    edges += [1 << i for i in range(13, 31)]  # 8192 .. 2**30
    return edges


M_BUCKETS: tuple[int, ...] = tuple(_bucket_edges())
_DIRECT_LIMIT = 4096
# Index = M, value = bucket: the warm path pays one list index, not a search.
_BUCKET_OF_M: list[int] = [1] + [
    M_BUCKETS[bisect.bisect_left(M_BUCKETS, m)] for m in range(1, _DIRECT_LIMIT + 1)
]


def m_bucket(m: int) -> int:
    """Round M up to its bucket; the decision for a bucket is made once and reused for all M in it."""
    if m <= _DIRECT_LIMIT:
        if m < 1:
            raise ValueError(f"M (rows of a) must be >= 1, got {m}")
        return _BUCKET_OF_M[m]
    return 1 << (m - 1).bit_length()


def bucket_range(bucket: int) -> tuple[int, int]:
    """The (lowest, highest) M that round up to ``bucket``."""
    i = bisect.bisect_left(M_BUCKETS, bucket)
    if i == len(M_BUCKETS) or M_BUCKETS[i] != bucket:
        raise ValueError(f"{bucket} is not an M bucket")
    lo = M_BUCKETS[i - 1] + 1 if i else 1
    return lo, bucket


def validation_ms(bucket: int) -> tuple[int, ...]:
    """The M values a candidate must be right at before it may serve the bucket.

    The edges catch tile-boundary bugs (one backend returned zeros only at M=3072); the odd M
    catches kernels that assume even or aligned M.
    """
    lo, hi = bucket_range(bucket)
    odd = min(hi, (lo + (hi - lo) // 2) | 1)
    return tuple(sorted({lo, odd, hi}))


@dataclass(frozen=True)
class Problem:
    """One dense FP4 GEMM shape class: everything except the exact M.

    ``k`` is the logical K in elements (twice ``a.shape[1]``). It is also what the sandbox child
    receives: no tensor crosses a process boundary, only this description.
    """

    n: int
    k: int
    m_bucket: int
    out_dtype: str = "bfloat16"
    block_size: int = 16
    use_nvfp4: bool = True
    a_sf_layout: str = "128x4"
    b_layout: str = "plain"
    alpha_kind: str = "scalar"
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(
                f"out_dtype must be one of {sorted(OUT_DTYPES)}, got {self.out_dtype!r}"
            )
        if self.a_sf_layout not in A_SF_LAYOUTS:
            raise ValueError(f"a_sf_layout must be one of {A_SF_LAYOUTS}, got {self.a_sf_layout!r}")
        if self.b_layout not in B_LAYOUTS:
            raise ValueError(f"b_layout must be one of {B_LAYOUTS}, got {self.b_layout!r}")
        if self.alpha_kind not in ALPHA_KINDS:
            raise ValueError(f"alpha_kind must be one of {ALPHA_KINDS}, got {self.alpha_kind!r}")
        for name in ("n", "k", "m_bucket", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.m_bucket not in M_BUCKETS:
            raise ValueError(f"m_bucket must be an M bucket (see M_BUCKETS), got {self.m_bucket}")
        for name in ("use_nvfp4", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("n", "k"):
            if getattr(self, name) > MAX_DIM:
                raise ValueError(f"{name} must be at most {MAX_DIM}, got {getattr(self, name)}")
        expected_block = 16 if self.use_nvfp4 is True else 32
        if self.block_size != expected_block:
            raise ValueError(
                f"block_size must be {expected_block} for {self.format}, got {self.block_size}"
            )
        if self.k % self.block_size:
            raise ValueError(f"k={self.k} must be a multiple of block_size={self.block_size}")
        if self.batch_invariant and self.m_bucket != INVARIANT_BUCKET:
            raise ValueError(
                f"a batch-invariant problem has one decision for every M: m_bucket must be "
                f"{INVARIANT_BUCKET}, got {self.m_bucket}"
            )

    @property
    def format(self) -> str:
        return "nvfp4" if self.use_nvfp4 else "mxfp4"

    @property
    def torch_out_dtype(self) -> torch.dtype:
        return OUT_DTYPES[self.out_dtype]

    @property
    def m_range(self) -> tuple[int, int]:
        if self.batch_invariant:
            return 1, M_BUCKETS[-1]
        return bucket_range(self.m_bucket)

    def validation_ms(self) -> tuple[int, ...]:
        """The M values a candidate must be right at before it may serve this problem."""
        return INVARIANT_MS if self.batch_invariant else validation_ms(self.m_bucket)

    def timing_m(self) -> int:
        """The M a candidate is timed at: the heaviest its decision must serve."""
        return INVARIANT_MS[-1] if self.batch_invariant else self.m_bucket

    def to_json(self) -> dict[str, Any]:
        data = {"schema": SCHEMA_VERSION, **asdict(self)}
        if not self.batch_invariant:
            # Absent when False, so that keys stored before the field existed still match.
            del data["batch_invariant"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Problem:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def digest(self) -> str:
        return digest(self.to_json())

    def describe(self) -> str:
        lo, hi = self.m_range
        rows = "M=any (batch invariant)" if self.batch_invariant else f"M={lo}..{hi}"
        return (
            f"N={self.n} K={self.k} {rows} {self.format} out={self.out_dtype} "
            f"a_sf={self.a_sf_layout} b={self.b_layout} alpha={self.alpha_kind}"
        )


def buckets_up_to(max_m: int) -> list[int]:
    """The M buckets that batches of 1 to ``max_m`` rows fall in."""
    top = m_bucket(max_m)
    return [b for b in M_BUCKETS if b <= top]


def shape_problems(
    shapes: Iterable[tuple[int, int]], max_m: int, fmt: str = "nvfp4", **fields: Any
) -> list[Problem]:
    """Every (N, K) of ``shapes`` at every M bucket up to ``max_m``'s, in ``fmt`` ("nvfp4" or
    "mxfp4", its block size with it); ``fields`` are the key's others (out_dtype, layouts...)."""
    nvfp4 = fmt == "nvfp4"
    return [
        Problem(n=n, k=k, m_bucket=b, use_nvfp4=nvfp4, block_size=16 if nvfp4 else 32, **fields)
        for n, k in shapes
        for b in buckets_up_to(max_m)
    ]


def installed_version(dist: str) -> str | None:
    """The installed version of the distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def environment(device_index: int | None = None) -> dict[str, Any]:
    """The fingerprint of the machine and the kernel-producing software on it.

    ``device_index`` None means the CPU. Cached: versions and device properties do not change
    inside a process, and the selector asks on every miss.
    """
    env: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "fp4select": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "flashinfer": installed_version("flashinfer-python"),
        "flashinfer_cubin": installed_version("flashinfer-cubin"),
        "cutlass_dsl": installed_version("nvidia-cutlass-dsl"),
        "cudnn_frontend": installed_version("nvidia-cudnn-frontend"),
        "triton": installed_version("triton"),  # compiles the triton-* and torch-dequant kernels
    }
    if device_index is None:
        env.update(device="cpu", gpu=None, cc=None, sm_count=None)
        return env
    props = torch.cuda.get_device_properties(device_index)
    env.update(
        device="cuda",
        gpu=props.name,
        cc=props.major * 10 + props.minor,
        sm_count=props.multi_processor_count,
    )
    try:
        env["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # cuDNN missing from this torch build: recorded as None
        env["cudnn"] = None
    return env


def env_difference(
    a: Mapping[str, Any], b: Mapping[str, Any], where: tuple[str, str] | None = None
) -> str:
    """The fields two environments differ in: ``field: a -> b``, or with ``where`` (the two
    places) ``field: a on A, b on B``; "" when equal."""
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if where is None:
        return "; ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys)
    return "; ".join(f"{k}: {a.get(k)!r} {where[0]}, {b.get(k)!r} {where[1]}" for k in keys)


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """``device`` with its CUDA index filled in; None: the current CUDA device, else the CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def environment_for(device: torch.device) -> dict[str, Any]:
    device = resolve_device(device)
    return environment(device.index if device.type == "cuda" else None)
