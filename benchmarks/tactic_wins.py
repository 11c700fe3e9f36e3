"""Which tactics earn their compile: a decision store's tuned tactic timings, per candidate.

Each tactic candidate costs deploying a compile (``hopper_tactics``). From the decisions a
``fp4select warm`` stored (``gpu_run.sh wins`` warms the record's 16 shapes), for every
backend and tactic: at how many keys it was timed, at how many it was the backend's fastest,
at how many of those its backend won the key, and what dropping it would cost there (the
backend's next tactic, or the key's next backend if that is faster, over its time). The
tuning times are short (``TUNE_BUDGET_S`` a candidate): a loss of a percent or two is noise.

    python benchmarks/tactic_wins.py DECISIONS_DIR [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import math
from pathlib import Path

from _common import RESULTS, dumps, table


def keys_of(root: Path) -> list[dict]:
    """Each stored decision's record (the store's entry files; JSON only, never executed),
    those without a winner and verdicts of the expected types left out."""
    records = []
    for path in sorted(root.glob("v*/*/entries/*.json")):
        try:
            record = json.loads(path.read_text())["record"]
            if isinstance(record["ranking"]["winner"], str) and isinstance(
                record["verdicts"], dict
            ):
                records.append(record)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records


def tactic_rows(records: list[dict]) -> list[dict]:
    stats: dict[tuple[str, str], dict] = collections.defaultdict(
        lambda: {"timed": 0, "fastest": 0, "key_won": 0, "loss_if_dropped": []}
    )
    for record in records:
        winner = record["ranking"]["winner"]
        backend_us = {n: t.get("median_us") for n, t in (record.get("timings") or {}).items()}
        for backend, verdict in record["verdicts"].items():
            timed = ((verdict.get("detail") or {}).get("tactic") or {}).get("timed_us") or {}
            if not timed:
                continue
            for tactic in timed:
                stats[(backend, tactic)]["timed"] += 1
            best = min(timed, key=timed.get)
            row = stats[(backend, best)]
            row["fastest"] += 1
            if backend != winner:
                continue
            row["key_won"] += 1
            rest = sorted(t for name, t in timed.items() if name != best)
            next_tactic = rest[0] / timed[best] if rest else math.inf
            mine = backend_us.get(backend)
            rivals = [t for n, t in backend_us.items() if n != backend and t]
            next_backend = min(rivals) / mine if mine and rivals else math.inf
            row["loss_if_dropped"].append(min(next_tactic, next_backend))
    return [
        {
            "backend": backend,
            "tactic": tactic,
            **{k: v for k, v in row.items() if k != "loss_if_dropped"},
            "worst_loss_if_dropped": max(row["loss_if_dropped"], default=None),
        }
        for (backend, tactic), row in sorted(stats.items())
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("decisions", type=Path, help="a decision store (FP4SELECT_CACHE_DIR)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    records = keys_of(args.decisions)
    rows = tactic_rows(records)
    cells = []
    for r in rows:
        loss = r["worst_loss_if_dropped"]
        cells.append([r["backend"], r["tactic"], r["timed"], r["fastest"], r["key_won"],
                      "-" if loss is None else f"{loss:.3f}"])  # fmt: skip
    header = ["backend", "tactic", "timed", "fastest", "its key won", "worst loss if dropped"]
    print(table(cells, header))
    envs = {json.dumps(r.get("env"), sort_keys=True) for r in records}
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = "_".join(sorted({(r.get("env") or {}).get("gpu", "?") for r in records}))
    path = args.out / f"tactic_wins_{gpu.split()[-1].lower()}.json"
    record = {
        "benchmark": "tactic_wins",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environments": [json.loads(e) for e in sorted(envs)],
        "keys": len(records),
        "rows": rows,
    }
    path.write_text(dumps(record))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
