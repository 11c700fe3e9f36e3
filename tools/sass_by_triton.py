"""The shipped Hopper tactics' sm90 code under several Triton releases, side by side.

Why: every Hopper number was measured with the H200's Triton 3.6, but a user gets the Triton
their torch pins (3.7.1 for torch 2.12, 3.8.0 for torch 2.14, which vLLM 0.34 requires). With
no GPU, the closest check is the compiled code: for each tactic of ``GEMV_TACTICS``,
``MMA_TACTICS`` and ``WS_TACTICS`` as it launches on SM90, its registers, local-memory
traffic (STL/LDL) and the instruction count of its main loops, compiled on the CPU with the
ptxas each Triton ships. Same registers and loops within a few percent say the measurements
carry over; a jump says to measure that Triton before trusting them.

    python tools/sass_by_triton.py 3.6.0 3.7.1 3.8.0   # and the installed one; about 1 min each

Each release is installed with ``pip install --no-deps --target`` into a temporary folder put
first on PYTHONPATH (as ``.ci/run``'s triton step does) and compiled in a child process. The
table goes to stdout, the JSON to benchmarks/results/sass_by_triton_cpu.json.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "sass_by_triton_cpu.json"
CODE = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+\S")  # one instruction line of nvdisasm


def _loops(sass: str) -> list[int]:
    """Instruction counts of the innermost loops closed by a predicated backward branch."""
    lines = sass.splitlines()
    spans = []
    for i, line in enumerate(lines):
        latch = re.search(r"@!?U?P\d+ BRA `\((\.L_x_\d+)\)", line)
        if latch:
            start = next((j for j, x in enumerate(lines) if x.startswith(latch[1] + ":")), None)
            if start is not None and start < i:
                spans.append((start, i))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return sorted(
        (sum(map(bool, map(CODE.match, lines[a : b + 1]))) for a, b in inner), reverse=True
    )


def _kernel_record(kernel, mma: bool) -> dict:
    import triton
    from wgmma_hazards import _sass, mma_loops

    sass = _sass(kernel)
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run(
            [str(bin_dir / "cuobjdump"), "--dump-resource-usage", str(cubin)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    lines = [x for x in sass.splitlines() if CODE.match(x)]
    return {
        "registers": int(re.search(r"REG:(\d+)", usage)[1]),
        "stl_ldl": sum(1 for x in lines if re.search(r"\b(STL|LDL)\b", x)),
        "instructions": len(lines),
        # the mma and ws kernels: the loops with a wgmma (one a consumer); the GEMV: its longest
        "main_loops": [len(x) for x in mma_loops(sass)] if mma else _loops(sass)[:1],
    }


def _short(config: object) -> str:
    """A tactic's repr without its field names: ``WsConfig(128, 256, 3, 0, 256, 0)``."""
    return re.sub(r"\w+=", "", repr(config))


def compile_all() -> dict:
    """Run in the child: every shipped tactic compiled with the Triton on sys.path."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tools"), str(ROOT)]
    import test_hopper_layout as layout
    import triton

    from fp4select.backends import hopper_configs as hc

    kernels = {}
    for m, configs in hc.GEMV_TACTICS:
        for cfg in configs:
            kernels[f"gemv M<={m} {_short(cfg)}"] = _kernel_record(
                layout._compile_gemv(cfg, m), False
            )
    for family, table, build in (
        ("mma", hc.MMA_TACTICS, layout._compile_mma),
        ("ws", hc.WS_TACTICS, lambda cfg: layout._compile_ws(cfg, 2, pdl=True)),
    ):
        for cfg in dict.fromkeys(c for _, configs in table for c in configs):
            kernels[f"{family} {_short(cfg)}"] = _kernel_record(build(cfg), True)
    return {"triton": triton.__version__, "kernels": kernels}


def _under(version: str | None) -> dict:
    """``compile_all`` in a child process, with Triton ``version`` installed for it (None: the
    installed one)."""
    with tempfile.TemporaryDirectory(prefix="sass-by-triton-") as folder:
        env = dict(os.environ)
        if version is not None:
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", folder,
                 f"triton=={version}"],
                check=True,
            )  # fmt: skip
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")]))
        child = subprocess.run(
            [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True
        )
        if child.returncode:
            sys.exit(f"triton {version or '(installed)'}: {child.stderr[-2000:]}")
        record = json.loads(child.stdout.strip().splitlines()[-1])
    if version is not None and record["triton"] != version:
        sys.exit(f"expected triton {version}, the child imported {record['triton']}")
    return record


def main(versions: list[str]) -> int:
    records = [_under(v) for v in versions] + [_under(None)]
    records = list({r["triton"]: r for r in records}.values())  # the installed one may repeat
    names = [r["triton"] for r in records]
    print(f"{'kernel':<46} " + " | ".join(f"{'triton ' + n:<30}" for n in names))
    for kernel in records[0]["kernels"]:
        cells = []
        for record in records:
            k = record["kernels"].get(kernel)
            cells.append(
                f"{k['registers']:>3} reg {k['stl_ldl']:>3} stl/ldl {k['main_loops']}"
                if k else "-"
            )  # fmt: skip
        print(f"{kernel:<46} " + " | ".join(f"{c:<30}" for c in cells))
    payload = {
        "what": __doc__.split("\n")[0],
        "date": dt.date.today().isoformat(),
        "python": sys.version.split()[0],
        "target": "sm90 (compiled on the CPU; nothing ran)",
        "records": records,
    }
    RESULT.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {RESULT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(compile_all()))
    else:
        raise SystemExit(main(sys.argv[1:]))
