"""A separate process for tests/test_store.py: locks only mean something between processes.

Usage: python _store_worker.py MODE ROOT ARGS_JSON.  A worker announces itself in the
``ready`` directory and then waits for the ``go`` file (when given), so that the test can
release all workers at the same moment, once every interpreter has started.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# fp4select.store imports nothing else from fp4select, so load the package by path: fp4select's
# __init__ pulls in torch, which would make eight workers on two cores take seconds, not a moment.
_package = Path(__file__).resolve().parents[1] / "fp4select" / "store"
_spec = importlib.util.spec_from_file_location(
    "_fp4select_store", _package / "__init__.py", submodule_search_locations=[str(_package)]
)
assert _spec is not None and _spec.loader is not None
_store = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _store
_spec.loader.exec_module(_store)
CacheWarning, Store = _store.CacheWarning, _store.Store


def wait_for(path: str | None, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while path is not None and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {path}")
        time.sleep(0.005)


def tune(store: Any, args: dict) -> None:
    # The caller's documented pattern: a cheap unlocked read, then lock and read again.
    env, key = args["env"], args["key"]
    missed = store.read_entry(env, key) is None
    with store.lock(env, key, timeout=args.get("timeout", 30.0)):
        if store.read_entry(env, key) is None:
            time.sleep(args["tune_seconds"])
            store.write_entry(env, key, {"tuned_by": os.getpid()})
            with open(args["log"], "a") as log:
                log.write(f"{os.getpid()}\n")
    print(json.dumps({"missed": missed, "record": store.read_entry(env, key)}))


def blacklist(store: Any, args: dict) -> None:
    store.add_to_blacklist(args["env"], args["backend"], {"reason": "test", "kind": "crash"})


def hold(store: Any, args: dict) -> None:
    with store.lock(args["env"], args["key"]):
        Path(args["held"]).touch()
        wait_for(args["release"])


def churn(store: Any, args: dict) -> None:
    # Any torn or half-written file would show up as a CacheWarning, which is an error here.
    env, key = args["env"], args["key"]
    for i in range(args["rounds"]):
        store.write_entry(env, key, {"writer": args["id"], "round": i, "pad": "x" * 4096})
        if store.read_entry(env, key) is None:
            raise SystemExit("read after write missed")


def _cap_memory(args: dict) -> None:
    # A regression that reads /dev/zero must fail fast with MemoryError, not fill the machine.
    if args.get("max_memory"):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (args["max_memory"], args["max_memory"]))


def read(store: Any, args: dict) -> None:
    # Every lookup a caller can make; the CacheWarnings come back as data.
    _cap_memory(args)
    env, key = args["env"], args["key"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = {
            "entry": store.read_entry(env, key),
            "entries": len(list(store.iter_entries(env))),
            "blacklist": sorted(store.blacklist(env)),
            "environments": len(store.environments()),
        }
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    print(json.dumps(result))


def import_archive(store: Any, args: dict) -> None:
    _cap_memory(args)
    try:
        store.import_archive(args["archive"])
    except (OSError, ValueError) as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    else:
        print(json.dumps({"error": None}))


def main() -> None:
    mode, root, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    warnings.simplefilter("error", CacheWarning)
    store = Store(root)
    if "ready" in args:
        Path(args["ready"], str(os.getpid())).touch()
    wait_for(args.get("go"))
    modes = {
        "tune": tune,
        "blacklist": blacklist,
        "hold": hold,
        "churn": churn,
        "read": read,
        "import": import_archive,
    }
    modes[mode](store, args)


if __name__ == "__main__":
    main()
