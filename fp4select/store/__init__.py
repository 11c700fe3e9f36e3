"""On-disk memory of fp4select's decisions: one JSON file per (environment, problem key).

This is the lowest layer of fp4select and imports nothing else from it (a test checks):
environments, keys and records are plain JSON-able dicts here.  The rules exist because a
cache that can break the program it is meant to speed up is worse than no cache.  Layout::

    <root>/v<SCHEMA_VERSION>/<env_hash>/env.json
                                       /entries/<key_hash>.json
                                       /locks/<key_hash>.lock
                                       /blacklist/<backend_file_name>.json

The schema number is in the path so that fp4select versions with different schemas can share
a root without reading each other's files.  Each module keeps its own rules at its top:

- ``_jsonfile``: strict JSON, ``digest``, bounded reads of regular files, atomic writes (a
  leaf: ``keys`` imports it for ``digest`` and ``SCHEMA_VERSION``).
- ``_collection``: damaged files are misses; a failing disk turns the root memory-only.
- ``_records``: what an entry and a blacklist record are (``RecordKind``), checked field by field.
- ``_lock``: per-key locks across processes and threads (``filelock``), fork-safe.
- ``_warn``: ``CacheWarning`` and ``first_time``/``warn_once``, fp4select's one say-it-once helper.
- ``_store``: ``Store``, the public face of all of the above.
- ``archive``: export and import of one archive file, where problems raise.
"""

from __future__ import annotations

from ._jsonfile import MAX_DEPTH, SCHEMA_VERSION, digest, too_deep
from ._store import ClearResult, Store, default_root
from ._warn import CacheWarning, first_time, warn_once
from .archive import ExportResult, ImportResult, read_archive

__all__ = [
    "MAX_DEPTH",
    "SCHEMA_VERSION",
    "CacheWarning",
    "ClearResult",
    "ExportResult",
    "ImportResult",
    "Store",
    "default_root",
    "digest",
    "first_time",
    "read_archive",
    "too_deep",
    "warn_once",
]
