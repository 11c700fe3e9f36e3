"""Cold cost: how long tuning takes, for one key and for a model's whole shape set.

Measures, with the backends available on this machine, the wall time of a first call
(discover, validate at several M, time, store) for one key, then `warm` over every dense
linear shape of a model preset and every M bucket up to --max-m, then the same set again
from the disk store in a fresh selector (the cost a restarted server pays).

    python benchmarks/bench_cold.py --device cuda --preset llama3-8b --max-m 8192
    python benchmarks/bench_cold.py --device cpu --preset tiny --max-m 16

``--defaults`` tunes with fp4select's own settings (sandboxed, its timing budget), as
``fp4select warm`` does out of the box. ``--jit-share`` starts from an empty Triton cache and
tunes the whole set twice, the second time into a fresh store with the Triton cache the first
pass filled: the difference bounds what compiling kernels cost (it also holds other one-time
costs, such as the first imports). With a sandbox, each pass also says where its time went:
seconds per (backend, phase) from the child's ``run`` events (the time until the next event),
and with ``--jit-share`` the kernels the first compiled, by name (the Triton cache's entries).
``--time-limit-s`` ends the first pass early (the JSON then says how many keys it tuned).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch
from _common import table, write

import fp4select
from fp4select.keys import Problem
from fp4select.keys import buckets_up_to as buckets
from fp4select.sandbox import attempt as sandbox_attempt
from fp4select.timing import TimingOptions

# (N, K) of the dense linear layers per transformer block, unsharded.
PRESETS = {
    "tiny": [(256, 512), (512, 256)],
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "qwen3-32b": [(10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--max-m", type=int, default=16)
    parser.add_argument("--isolation", choices=("inprocess", "subprocess"), default="inprocess")
    parser.add_argument("--budget-s", type=float, default=0.5, help="timing budget per key")
    parser.add_argument("--defaults", action="store_true", help="fp4select's own settings")
    parser.add_argument("--jit-share", action="store_true", help="tune twice, see the docstring")
    parser.add_argument("--time-limit-s", type=float, default=None, help="end the first pass")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.defaults:
        defaults = fp4select.settings.Settings()
        args.isolation, args.budget_s = defaults.isolation, defaults.time_budget_s
    timing = TimingOptions(budget_s=args.budget_s)
    shapes = PRESETS[args.preset]
    problems = [Problem(n=n, k=k, m_bucket=b) for n, k in shapes for b in buckets(args.max_m)]
    triton_cache = tempfile.TemporaryDirectory() if args.jit_share else None
    if triton_cache is not None:
        os.environ["TRITON_CACHE_DIR"] = triton_cache.name  # workers inherit it

    phases = PhaseTrace()
    phases.install()
    with tempfile.TemporaryDirectory() as cache:
        sel = fp4select.configure(cache_dir=cache, isolation=args.isolation, timing=timing)
        start = time.perf_counter()
        sel.registry()
        discover_s = time.perf_counter() - start
        start = time.perf_counter()
        first = sel.decide(problems[0], device)
        one_key_s = time.perf_counter() - start
        per_key = []
        start = time.perf_counter()
        limit = start + args.time_limit_s if args.time_limit_s else None
        for i, problem in enumerate(problems[1:], 2):
            if limit is not None and time.perf_counter() > limit:
                print(f"time limit: {i - 1} of {len(problems)} keys tuned", flush=True)
                break
            t0 = time.perf_counter()
            decision = sel.decide(problem, device)
            per_key.append((problem, decision, time.perf_counter() - t0))
            # as it goes, so that a run cut short by a time limit still says how far it got
            print(f"{i}/{len(problems)} {problem.describe()}: {per_key[-1][2]:.1f} s, "
                  f"{decision.winner}", flush=True)  # fmt: skip
        model_s = time.perf_counter() - start + one_key_s
        tuned = 1 + len(per_key)
        print(f"{tuned} of {len(problems)} keys: {model_s:.1f} s", flush=True)
        sel.close()
        phases.remove()

        sel = fp4select.configure(cache_dir=cache, isolation=args.isolation, timing=timing)
        sel.registry()
        start = time.perf_counter()
        for problem in problems[:tuned]:
            assert sel.decide(problem, device).source == "disk"
        reload_s = time.perf_counter() - start
        sel.close()

    compiled = compiled_kernels(triton_cache.name) if triton_cache is not None else {}
    compiled_s = None
    compiled_phases = PhaseTrace()
    # Again, kernels compiled: what is left is not JIT (not after a cut-short first pass).
    if triton_cache is not None and tuned == len(problems):
        compiled_phases.install()
        with tempfile.TemporaryDirectory() as cache:
            sel = fp4select.configure(cache_dir=cache, isolation=args.isolation, timing=timing)
            sel.registry()
            start = time.perf_counter()
            for problem in problems:
                sel.decide(problem, device)
            compiled_s = time.perf_counter() - start
            sel.close()
        compiled_phases.remove()
    if triton_cache is not None:
        triton_cache.cleanup()

    winners = sorted({d.winner for _, d, _ in per_key} | {first.winner})
    rows = [
        ["discover backends", f"{discover_s:.2f}"],
        [f"tune one key ({problems[0].describe()})", f"{one_key_s:.2f}"],
        [
            f"tune {tuned} of {len(problems)} keys ({args.preset}, M<={args.max_m})",
            f"{model_s:.2f}",
        ],
        [f"read {tuned} keys back from disk", f"{reload_s:.3f}"],
    ]
    if compiled_s is not None:
        rows.append([f"tune {len(problems)} keys again, kernels compiled", f"{compiled_s:.2f}"])
        rows.append(
            [
                "share of the first not repeated (JIT, at most)",
                f"{max(0.0, 1 - compiled_s / model_s):.0%}",
            ]
        )
    print(table(rows, ["step", "seconds"]))
    print(f"winners: {', '.join(str(w) for w in winners)}; isolation: {args.isolation}")
    by_phase, compiled_by_phase = phases.by_phase(), compiled_phases.by_phase()
    for name, traced in (("first pass", by_phase), ("kernels compiled", compiled_by_phase)):
        if traced:
            rows = [[b, ph, f"{sec:.1f}", n] for (b, ph), (sec, n) in traced.items()][:25]
            print(table(rows, ["backend", f"phase ({name})", "seconds", "events"]))
    if compiled:
        print(f"kernels compiled: {sum(compiled.values())} ({json.dumps(compiled)})")
    path = write(
        f"cold_{args.preset}",
        device,
        {
            "preset": args.preset,
            "shapes": shapes,
            "max_m": args.max_m,
            "keys": len(problems),
            "keys_tuned": tuned,
            "isolation": args.isolation,
            "timing": timing.to_json(),
            "seconds": {
                "discover": discover_s,
                "one_key": one_key_s,
                "all_keys": model_s,
                "reload_all_keys": reload_s,
                "all_keys_kernels_compiled": compiled_s,
            },
            "jit_share_at_most": None if compiled_s is None else max(0.0, 1 - compiled_s / model_s),
            "per_key": [
                {
                    "problem": p.describe(),
                    "winner": d.winner,
                    "seconds": s,
                    "verdicts": {n: v.status for n, v in d.verdicts.items()},
                }
                for p, d, s in per_key
            ],
            "winners": winners,
            "first_pass_by_phase": [
                {"backend": b, "phase": ph, "seconds": sec, "events": n}
                for (b, ph), (sec, n) in by_phase.items()
            ],
            "compiled_pass_by_phase": [
                {"backend": b, "phase": ph, "seconds": sec, "events": n}
                for (b, ph), (sec, n) in compiled_by_phase.items()
            ],
            "kernels_compiled": compiled,
        },
    )
    print(f"wrote {path}")


class PhaseTrace:
    """Seconds per (backend, phase) of sandboxed probing, from the child's ``run`` events.

    Each event's time runs until the next event the parent reads. It wraps the parser the
    parent reads events with (benchmark instrumentation; the library has no hook for it).
    """

    def __init__(self) -> None:
        self.seconds: collections.Counter[tuple[str, str]] = collections.Counter()
        self.events: collections.Counter[tuple[str, str]] = collections.Counter()
        self._open: tuple[tuple[str, str], float] | None = None
        self._parse = sandbox_attempt.parse

    def _close(self, now: float) -> None:
        if self._open is not None:
            key, since = self._open
            self.seconds[key] += now - since
            self._open = None

    def _traced(self, line: bytes) -> dict | None:
        event = self._parse(line)
        now = time.perf_counter()
        self._close(now)
        if isinstance(event, dict) and event.get("event") == "run":
            key = (str(event.get("backend")), str(event.get("phase")))
            self.events[key] += 1
            self._open = (key, now)
        return event

    def install(self) -> None:
        sandbox_attempt.parse = self._traced

    def remove(self) -> None:
        self._close(time.perf_counter())
        sandbox_attempt.parse = self._parse

    def by_phase(self) -> dict[tuple[str, str], tuple[float, int]]:
        """Longest first."""
        return {k: (s, self.events[k]) for k, s in self.seconds.most_common()}


def compiled_kernels(cache_dir: str) -> dict[str, int]:
    """How many kernels of each name a Triton cache holds (one entry per compiled variant)."""
    names: collections.Counter[str] = collections.Counter()
    for meta in Path(cache_dir).glob("*/*.json"):
        if meta.name.startswith("__grp__"):
            continue
        try:
            names[json.loads(meta.read_text())["name"]] += 1
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return dict(names.most_common())


def kernel_signatures(cache_dir: str, name: str) -> list[str]:
    """Each compiled variant of kernel ``name`` in a Triton cache: its options that differ
    between tiles and its TTGIR entry's argument types (with divisibility), which tell one
    specialization from another."""
    found = []
    for meta in sorted(Path(cache_dir).glob(f"*/{name}.json")):
        try:
            options = json.loads(meta.read_text())
            text = meta.with_suffix(".ttgir").read_text()
        except (OSError, ValueError):
            continue
        keep = ("shared", "num_warps", "maxnreg", "launch_pdl")
        head = next((line for line in text.splitlines() if f"@{name}(" in line), "")
        head = re.sub(r' loc\("[^"]*"\(#loc\d*\)\)', "", head)
        found.append(f"{[options.get(k) for k in keep]} {' '.join(head.split())}"[:3000])
    return found


if __name__ == "__main__":
    main()
