"""List the places where a kernel's SASS rewrites a register that a wgmma still in flight reads.

Why: a wgmma whose left operand is in registers reads them while it runs; PTX leaves writing
them before the ``wgmma.wait_group`` that covers it undefined, and Triton's pipelining of such
loops had exactly that hazard (triton-lang/triton#9433; fixed by triton#9514 together with
ptxas 13.3). ``hopper-mma`` (and ``hopper-prefill``, retired since) is such a loop: this
compiles its tactics, and ``hopper-ws``' Gluon kernel's, for sm90 on the CPU (Triton ships ptxas; no GPU
needed) and reports the writes it finds in each. Since each step waits for its wgmma
(``_hopper_kernels.retired``) it finds none; before, it found 79-467 per tactic with Triton
3.6 (whose sm90 ptxas is 12.8), and some too with Triton 3.6 given ptxas 13.4 or Triton 3.9
given ptxas 12.8 (Triton 3.9 uses 13.4 for sm90).

How (an approximation, read its output as a lead, not a proof): in the main loop's SASS (the
backward branch around the most ``HGMMA``), taken twice to model the loop, every ``HGMMA``
adds its four A registers to the open group, ``gsb0`` closes the group, ``WARPGROUP.DEPBAR.LE
gsb0, N`` retires groups until N remain; an instruction whose destination register belongs
to a group still in flight is reported. Destination widths come from the opcode suffix
(``.64``, ``.128``, ``.WIDE``); predicated writes count as writes.

Usage: ``python tools/wgmma_hazards.py [--all]`` (``--all``: print every write, not three).
Exit status 1 when any tactic has a hazard.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_SKIP = ("ST", "BRA", "BAR", "SYNCS", "WARPGROUP", "UTMA", "RED", "ATOM", "MEMBAR", "FENCE")


def _sass(kernel) -> str:
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        return subprocess.run(
            [str(nvdisasm), "-c", cubin], capture_output=True, text=True, check=True
        ).stdout


def mma_loops(sass: str) -> list[list[str]]:
    """The instructions of each backward-branch loop with an HGMMA, predicates kept (one per
    consumer partition in a warp-specialized kernel)."""
    lines = sass.splitlines()
    spans = []
    for i, line in enumerate(lines):
        # a loop's latch is a branch back: predicated, or not where the loop is rotated (its
        # exit test mid-body: Triton 3.9's loading consumers); the unpredicated ones that come
        # right after a predicated branch return from the out-of-line slow path of an mbarrier
        # wait (placed after the kernel's end)
        m = re.search(r"@!?U?P\d+ BRA `\((\.L_x_\d+)\)", line)
        if not m:
            m = re.search(r"^\s*/\*\w+\*/\s+BRA `\((\.L_x_\d+)\)", line)
            if not m or (i and re.search(r"@!?U?P\d+ BRA ", lines[i - 1])):
                continue
        start = next((j for j, x in enumerate(lines) if x.startswith(m.group(1) + ":")), None)
        if start is not None and start < i and any("HGMMA" in x for x in lines[start:i]):
            spans.append((start, i))
    # the innermost ones: a loop around a consumer's (a partition dispatch) is not one
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    bodies = [lines[a : b + 1] for a, b in inner]
    code = r"\s+/\*[0-9a-f]{4,}\*/\s+\S"  # addresses past 0xffff have five digits
    return [
        [
            re.sub(r"^\s*/\*\w+\*/\s*", "", x).split(";")[0].strip()
            for x in body
            if re.match(code, x)
        ]
        for body in bodies
    ]


def main_loop(sass: str) -> list[str]:
    """The loop with the most HGMMA (``mma_loops``)."""
    return max(mma_loops(sass), key=lambda loop: sum("HGMMA" in x for x in loop), default=[])


def _width(opcode: str) -> int:
    if ".128" in opcode:
        return 4
    return 2 if ".64" in opcode or ".WIDE" in opcode else 1


def hazards(loop: list[str]) -> list[str]:
    """The loop's writes to registers of an HGMMA group still in flight (see the module doc)."""
    in_flight: list[set[int]] = []
    group: set[int] = set()
    found: list[str] = []
    for lap in range(2):
        for line in loop:
            text = re.sub(r"^@!?U?P\w+\s+", "", line)
            opcode = text.split()[0] if text else ""
            if opcode.startswith("HGMMA"):
                m = re.match(r"HGMMA\.\S+ R\d+, R(\d+), gdesc", text)
                if m:
                    group |= set(range(int(m.group(1)), int(m.group(1)) + 4))
                if "gsb0" in text:
                    in_flight.append(group)
                    group = set()
                continue
            if opcode.startswith("WARPGROUP.DEPBAR"):
                pending = int(text.split(",")[-1], 16)
                del in_flight[: max(0, len(in_flight) - pending)]
                continue
            if opcode.startswith(_SKIP) or opcode.startswith("U"):
                continue
            m = re.match(r"\S+\s+R(\d+)", text)
            if m and lap == 1:
                written = set(range(int(m.group(1)), int(m.group(1)) + _width(opcode)))
                if any(written & g for g in in_flight):
                    found.append(line)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="print every write found")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this tree's fp4select and test helpers
    import test_hopper_layout as layout  # the compile helpers the layout tests use

    from fp4select.backends import hopper_configs

    configs = {c for _, cs in hopper_configs.MMA_TACTICS for c in cs}
    kernels = [(cfg, layout._compile_mma) for cfg in sorted(configs, key=str)]
    kernels += [
        (cfg, lambda c: layout._compile_ws(c, 2, pdl=True))  # as SM90 runs it by default
        for cfg in hopper_configs.candidates("ws", None)
    ]
    worst = 0
    for cfg, compile_kernel in kernels:
        found = [w for loop in mma_loops(_sass(compile_kernel(cfg))) for w in hazards(loop)]
        worst = max(worst, len(found))
        shown = found if args.all else found[:3]
        print(f"{cfg}: {len(found)} writes to in-flight A registers {shown}")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
