"""Prepare what benchmarks/gpu_run.sh carries to a GPU machine that cannot reach PyPI.

* ``.whl/``: wheels that machine lacks (platformdirs; apache-tvm-ffi for Python 3.12).
* ``.fi/``: the Python modules that ``import flashinfer`` loads, copied from this machine's
  install. flashinfer's whole wheel is too large to carry, and it has no SM90 FP4 kernels
  anyway; the modules are enough for its runtime backend list and support answers.

Run here (with flashinfer-python installed), then call the device tool with
``carry=[".whl", ".fi"]`` and ``bash benchmarks/gpu_run.sh``. Both folders are in
``.gitignore``: never for a commit.

    python benchmarks/gpu_carry.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = {"platformdirs": "platformdirs==4.14.8", "apache_tvm_ffi": "apache-tvm-ffi==0.1.15.post2"}


def download_wheels() -> None:
    for requirement in WHEELS.values():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.12",
                "--implementation",
                "cp",
                "--platform",
                "manylinux_2_28_x86_64",
                "--platform",
                "manylinux_2_17_x86_64",
                "--platform",
                "manylinux2014_x86_64",
                "-d",
                str(ROOT / ".whl"),
                requirement,
            ],
            check=True,
        )


def copy_flashinfer_modules() -> int:
    import flashinfer
    import flashinfer.fused_moe.utils
    import flashinfer.gemm.batch_invariant.api  # the batch-invariant class's architectures
    import flashinfer.quantization.fp4_quantization
    import flashinfer.trace.templates.gemm
    from flashinfer.gemm import gemm_base  # noqa: F401

    site = Path(flashinfer.__file__).parent.parent
    files = {
        Path(m.__file__).relative_to(site)
        for m in list(sys.modules.values())
        if getattr(m, "__name__", "").startswith("flashinfer") and getattr(m, "__file__", None)
    }
    for root, _, names in os.walk(site / "flashinfer"):
        if "/data" in root:
            continue
        files |= {
            Path(root, n).relative_to(site)
            for n in names
            if n == "__init__.py" or n.endswith(".json")
        }
    target = ROOT / ".fi"
    shutil.rmtree(target, ignore_errors=True)
    for rel in files:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site / rel, target / rel)
    for dist in site.glob("flashinfer_python-*.dist-info"):
        shutil.copytree(dist, target / dist.name)
    return len(files)


if __name__ == "__main__":
    download_wheels()
    print(f"copied {copy_flashinfer_modules()} flashinfer files into .fi/")
