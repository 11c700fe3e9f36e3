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
from collections.abc import Mapping
from typing import Any

from fp4select.keys import env_difference
from fp4select.store import digest
from fp4select.store.archive import read_archive

__all__ = ["applicability", "difference"]


def difference(archive_env: Mapping[str, Any], here: Mapping[str, Any]) -> str:
    """The fields that differ, as ``field: archive value -> value here``; "" when equal."""
    return env_difference(archive_env, here)


def applicability(path: str | os.PathLike[str], here: Mapping[str, Any]) -> dict[str, Any]:
    """{"entries", "apply", "do_not_apply", "reasons": {difference: count}} for an archive.

    Raises ``ValueError`` for a file that is not an archive, ``OSError`` when it cannot be
    read (the user named it).
    """
    entries = [env for env, _, _ in read_archive(path)[0]]
    here_hash = digest(dict(here))
    reasons: dict[str, int] = {}
    applies = 0
    for env in entries:
        if digest(env) == here_hash:
            applies += 1
        else:
            why = difference(env, here)
            reasons[why] = reasons.get(why, 0) + 1
    return {
        "entries": len(entries),
        "apply": applies,
        "do_not_apply": len(entries) - applies,
        "reasons": reasons,
    }
