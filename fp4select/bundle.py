"""Which entries of an exported archive apply on this machine, and why the others do not.

A decision is keyed on its environment (GPU kind and the versions of everything that builds
or runs a kernel). An archive made on a build machine applies on a fleet machine only where
the two environments are identical; the rest are imported but never read there. Saying how
many, and which field differs, turns "warm did nothing" into "the fleet has flashinfer 0.7.4,
the build machine 0.7.2".

Design rule: this only reads (JSON, checked before use); ``Store.import_archive`` writes.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from typing import Any

from fp4select.keys import env_difference
from fp4select.store import digest
from fp4select.store.archive import read_archive

__all__ = ["applicability"]


def applicability(path: str | os.PathLike[str], here: Mapping[str, Any]) -> dict[str, Any]:
    """{"entries", "apply", "do_not_apply", "reasons": {difference: count}} for an archive.

    Raises ``ValueError`` for a file that is not an archive, ``OSError`` when it cannot be
    read (the user named it).
    """
    entries = [env for env, _, _ in read_archive(path)[0]]
    here_hash = digest(dict(here))
    # A difference reads ``field: archive value -> value here``.
    reasons = Counter(env_difference(env, here) for env in entries if digest(env) != here_hash)
    missed = sum(reasons.values())
    return {
        "entries": len(entries),
        "apply": len(entries) - missed,
        "do_not_apply": missed,
        "reasons": dict(reasons),
    }
